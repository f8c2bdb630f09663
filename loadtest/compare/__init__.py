"""The comparison of routing policies, by job: which runs (``runs``), running them on fresh
fleets (``orchestration``), reading the replicas' /metrics and the processes' CPU
(``scraping``), whether a run can be trusted and the ranking (``verdict``), the table, plots
and results.json (``report``), and the ``compare``/``demo`` subcommands (``command``). Beside
them: the replay-speed calibration, the caching A/B, the emulator's fidelity against vLLM and
the fault scenarios."""
