"""Which NIXL is installed: the `nixl` meta package (the `gpu` extra: both CUDA builds, the one
matching torch's CUDA taken at import), or one build alone (the `nixl` extra: `nixl-cu12`, whose
UCX moves CPU memory as well; a CPU host needs no second build of ~230 MB). Imports neither torch
nor NIXL, so that `pdserve up` can check before anything starts."""

import importlib
import importlib.metadata
import logging
import importlib.util
import re

log = logging.getLogger(__name__)

# The meta package first: where it is installed, it knows which build matches the GPU's CUDA.
MODULES = ("nixl", "nixl_cu12", "nixl_cu13")


def nixl_module() -> str | None:
    """The name of the NIXL package to import, or None when NIXL is not installed."""
    return next((m for m in search_order(torch_cuda_major()) if importlib.util.find_spec(m) is not None), None)


def search_order(cuda_major: int | None) -> tuple[str, ...]:
    """The meta package, then the build of torch's CUDA (a CUDA 12 build beside a CUDA 13 torch
    would load two CUDA runtimes into one process), then the others."""
    own = f"nixl_cu{cuda_major}" if cuda_major else None
    return ("nixl",) + tuple(sorted(MODULES[1:], key=lambda m: m != own))


def torch_cuda_major() -> int | None:
    """The CUDA major version the installed torch was built for, from its package metadata (torch is
    not imported): its local version tag (2.11.0+cu130), else the CUDA runtime it requires
    (nvidia-cuda-runtime-cu12); None for a CPU build or no torch."""
    try:
        return cuda_major_of(importlib.metadata.version("torch"), importlib.metadata.requires("torch") or [])
    except importlib.metadata.PackageNotFoundError:
        return None


def cuda_major_of(version: str, requires: list[str]) -> int | None:
    """torch_cuda_major from a torch package's version and requirements."""
    if m := re.search(r"\+cu(\d\d)\d", version):
        return int(m[1])
    if "+cpu" in version:
        return None
    for r in requires:
        if m := re.match(r"nvidia-cuda-runtime-cu(\d+)", r):
            return int(m[1])
        if m := re.match(r"nvidia-cuda-runtime\s*[=~<>]=?\s*(\d+)", r):  # (CUDA 13's wheels drop the suffix)
            return int(m[1])
    return None


def nixl_api():
    """NIXL's `_api` module (nixl_agent, nixl_agent_config)."""
    name = nixl_module()
    if name is None:
        raise ImportError("NIXL is not installed: pip install 'pdserve[nixl]', or set kv_transfer.backend: tcp")
    major = torch_cuda_major()
    if major is not None and name != "nixl" and name != f"nixl_cu{major}":
        log.warning("NIXL's %s build is loaded beside a CUDA %d torch: install pdserve[gpu] (or nixl-cu%d) for "
                    "the matching one", name, major, major)
    return importlib.import_module(f"{name}._api")
