"""The router process: its configuration, wiring, lifecycle, background loops and handlers."""
