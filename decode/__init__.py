"""The decode worker: the engine core in its decode role, receiving KV and mega-batching (serving path, not built yet)."""
