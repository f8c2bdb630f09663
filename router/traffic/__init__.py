"""Traffic control (issue 33): admission in front of the fleet, with a bounded router-side queue.

``admission`` is the pure core (limits, room, the queue, its refusals); ``gate`` the asyncio
wrapper the request path awaits; ``metrics`` its Prometheus series.
"""
