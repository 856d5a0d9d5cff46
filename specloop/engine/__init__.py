"""The serving core: scheduler, KV manager, executor, engine."""
