"""The HTTP and Redis edges: the proxy to the replicas, the error responses, API keys, half-open
probes and the fleet sync from Redis."""
