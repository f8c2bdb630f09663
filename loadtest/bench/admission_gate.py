"""CPU cost of the admission gate (``router.traffic.gate``) on the event loop, per request:
admit + dispatched + release with admission off and on (room), and the pump that admits one
request from a queue of 1,000 (3 classes, 10 tenants) per released slot. CPU time
(``time.process_time``), so a busy machine slows it less than wall time.

    python -m loadtest.bench.admission_gate
"""

from __future__ import annotations

import asyncio
import time

from router.traffic.admission import AdmissionLimits, ReplicaLoad
from router.traffic.gate import AdmissionGate, AdmissionSlot

LOADS = [ReplicaLoad(f"r{i}", 0, 0.0) for i in range(8)]


async def per_request_us(limits: AdmissionLimits, n: int = 20_000) -> float:
    gate = AdmissionGate(limits, lambda model: LOADS)
    started = time.process_time()
    for i in range(n):
        slot = await gate.admit(str(i), "m", 0.01)
        slot.dispatched()
        slot.release()
    return (time.process_time() - started) / n * 1e6


async def pop_us(n: int = 1_000, tenants: int = 10) -> float:
    gate = AdmissionGate(AdmissionLimits(max_inflight=1, max_queue_length=n + 1),
                         lambda model: LOADS)
    slot: AdmissionSlot = await gate.admit("first", "m")
    pending = {asyncio.create_task(gate.admit(str(i), "m", 0.01 + (i % 7) * 0.003, i % 3,
                                              f"t{i % tenants}")) for i in range(n)}
    await asyncio.sleep(0)
    spent = 0.0
    while pending:
        slot.release()
        started = time.process_time()
        gate._pump()  # the next admission: the order's pop
        spent += time.process_time() - started
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        slot = done.pop().result()
    return spent / n * 1e6


async def main() -> None:
    print(f"admission off: {await per_request_us(AdmissionLimits()):.1f} us CPU/request")
    on = AdmissionLimits(max_inflight_per_replica=100)
    print(f"admission on, room (8 replicas): {await per_request_us(on):.1f} us CPU/request")
    print(f"from a queue of 1,000 (3 classes, 10 tenants): {await pop_us():.1f} us CPU/admission")


if __name__ == "__main__":
    asyncio.run(main())
