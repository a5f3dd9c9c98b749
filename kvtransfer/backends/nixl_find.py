"""Which NIXL is installed: the `nixl` meta package (the `gpu` extra: both CUDA builds, the one
matching torch's CUDA taken at import), or one build alone (the `nixl` extra: `nixl-cu12`, whose
UCX moves CPU memory as well; a CPU host needs no second build of ~230 MB). Imports neither torch
nor NIXL, so that `pdserve up` can check before anything starts."""

import importlib
import importlib.util

# The meta package first: where it is installed, it knows which build matches the GPU's CUDA.
MODULES = ("nixl", "nixl_cu12", "nixl_cu13")


def nixl_module() -> str | None:
    """The name of the NIXL package to import, or None when NIXL is not installed."""
    return next((m for m in MODULES if importlib.util.find_spec(m) is not None), None)


def nixl_api():
    """NIXL's `_api` module (nixl_agent, nixl_agent_config)."""
    name = nixl_module()
    if name is None:
        raise ImportError("NIXL is not installed: pip install 'pdserve[nixl]', or set kv_transfer.backend: tcp")
    return importlib.import_module(f"{name}._api")
