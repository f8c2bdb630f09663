"""What the router tells about itself: Prometheus metrics, the prompt audit, OpenTelemetry
tracing and the event-loop lag."""
