"""Operator tools behind ``prefix-router`` subcommands: the data-parallel rank check and the
Mooncake trace format that ``prefix-router audit`` reads."""
