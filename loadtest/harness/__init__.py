"""The process harness: real processes and how they are started, waited on and stopped
(``processes``), Redis (an embedded server, replica and sentinel topologies), the loopback fleet
of the comparisons, vLLM CPU engines, a KV-event publisher and a fault proxy. The tests, the
benchmarks and the comparisons all start their processes through it."""
