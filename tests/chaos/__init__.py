"""Chaos suite (issue 13, part 5): hundreds of short requests through AsyncEngine and through
the HTTP server under random aborts, client disconnects, request-ID reuse and a KV pool
small enough that recompute preemption happens all the time, in every speculation mode.

Every run is driven by a seeded schedule (`schedule.py`; the seed is in every failure
message) and checked against solo runs and the engine's bookkeeping (`oracle.py`).
"""
