"""The prefill worker (installed as pdserve.prefill): the engine core in its prefill role, pushing KV
through pdserve.kvtransfer layer by layer."""
