"""The KV events of each engine step, taken from the GPU block pool and the CPU tier and handed
to the replica's ZMQ publisher (when events are on). The publisher does the I/O; this module
only decides what goes out together and when.
"""

from __future__ import annotations

from typing import Any

import zmq

from worker.emulator.config import EmulatorConfig, replica_endpoint
from worker.emulator.kv_cache import BlockPool
from worker.emulator.metrics import OffloadMetrics
from worker.emulator.offload import CpuOffload
from worker.emulator.publisher import PublisherConfig, ZmqEventPublisher


def engine_publisher(config: EmulatorConfig, index: int, dp_rank: int,
                     zmq_ctx: zmq.Context[Any]) -> ZmqEventPublisher | None:
    """The publisher of rank ``dp_rank`` of replica ``index`` (its endpoints offset by both),
    or None with KV events off."""
    if not config.kv_events.enabled:
        return None
    ev = config.kv_events
    dp_size = config.data_parallel_size
    pub = replica_endpoint(ev.endpoint, index, config.host, dp_rank, dp_size)
    replay = (replica_endpoint(ev.replay_endpoint, index, config.host, dp_rank, dp_size)
              if ev.replay_endpoint else None)
    return ZmqEventPublisher(PublisherConfig(
        endpoint=pub.address, bind=pub.bind,
        replay_endpoint=replay.address if replay else None,
        topic=ev.topic, buffer_steps=ev.buffer_steps, hwm=ev.hwm,
        int_block_hashes=config.int_block_hashes, block_size=config.block_size,
        data_parallel_rank=dp_rank),
        zmq_ctx)


class StepEvents:
    """Publishes one step's events as one batch: the GPU pool's, then the CPU tier's (vLLM: the
    cache manager's events, then the connector's), and brings the tier's counters up to date."""

    def __init__(self, pool: BlockPool, offload: CpuOffload | None,
                 offload_metrics: OffloadMetrics | None,
                 publisher: ZmqEventPublisher | None) -> None:
        assert (offload is None) == (offload_metrics is None)
        self.pool = pool
        self.offload = offload
        self.offload_metrics = offload_metrics
        self.publisher = publisher

    def publish(self) -> None:
        """Publish what the pool (and the CPU tier) queued since the last call."""
        if self.offload is not None:
            assert self.offload_metrics is not None
            if self.publisher is not None:
                self.publisher.publish([*self.pool.take_events(), *self.offload.take_events()])
            self.offload_metrics.sync(self.offload.stats)
        elif self.publisher is not None:
            self.publisher.publish(self.pool.take_events())
