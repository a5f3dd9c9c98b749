"""The engine core shared by every role: KV cache and block pool, scheduler, model runner, sampler."""
