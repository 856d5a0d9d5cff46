"""Data parallelism: N engine replicas, each in its own process, behind one engine interface.

`engine.py` (`DataParallelEngine`, the server process's side) routes each request to the
least-loaded live replica (`router.py`), talks to each replica through a `ReplicaHandle`
(`handle.py`) over two pipes carrying `wire.py`'s msgspec messages, and merges the
replicas' statistics (`stats.py`); `worker.py` is the replica process: one `EngineCore`
stepping between the commands it reads.
"""
