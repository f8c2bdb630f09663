"""The decision core: the fleet state, replica health, the block index, the ring, the policies,
the TTFT model and the KV-capacity arithmetic. Pure (no I/O library)."""
