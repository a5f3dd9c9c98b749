"""The decode worker (installed as pdserve.decode): the engine core in its decode role, receiving KV and
mega-batching, alone or as a rank of an expert-parallel group."""
