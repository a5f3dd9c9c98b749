"""The prefill worker: the engine core in its prefill role, pushing KV through kvtransfer (serving path, not built yet)."""
