"""Every backend in kvtransfer/backends/ keeps the KVBackend contract (kvtransfer/backend.py): each
method the ends call, with a signature they can call it by, and each capability declared on the
class itself. The ends trust it: they read capabilities and never probe a backend for methods."""

import importlib
import importlib.util
import inspect
import pathlib
import pkgutil
import re
import uuid

import pytest
import torch

from pdserve.forward.kv_cache import KVLayout, allocate_kv_cache
from pdserve.kvtransfer.backends.nixl_find import nixl_module
from pdserve.kvtransfer import backends
from pdserve.kvtransfer.backend import KVBackend
from pdserve.kvtransfer.backends import make_backend
from pdserve.kvtransfer.metadata import KVAgentMetadata

LAYOUT = KVLayout(2, 8, 4, 2, 8, torch.float32, "kv")
# The Protocol's operations with a default in KVBackend, and the capability that makes a backend
# owe its own (None: the default serves any backend). Every other operation each backend defines.
# Staging: the default of reserve_staging gives no slot, so the other three are never called on a
# backend that keeps it.
OPTIONAL = {"write_layers": None, "settled": None, "grant": None, "revoke": None, "write_range": "inline",
            "wait": "waits", "reserve_staging": None, "write_staged": None, "unstage": None, "drop_staging": None,
            "refusals": None}
# cuda_ipc's copy kernel is Triton's: a machine without Triton cannot import that module.
NEEDS = {"cuda_ipc": "triton", "block_copy": "triton"}


def operations() -> dict[str, inspect.Signature]:
    return {n: inspect.signature(f) for n, f in vars(KVBackend).items()
            if inspect.isfunction(f) and not n.startswith("_")}


def capabilities() -> list[str]:
    return [n for n, hint in KVBackend.__annotations__.items() if "ClassVar" in str(hint)]


def _params(cls: type, name: str) -> list[inspect.Parameter]:
    """The parameters a caller passes to cls.name (self left out)."""
    member = inspect.getattr_static(cls, name)
    params = list(inspect.signature(getattr(cls, name)).parameters.values())
    return params if isinstance(member, staticmethod) else params[1:]


def breaches(cls: type) -> list[str]:
    """How cls falls short of KVBackend; empty when it keeps the contract."""
    out = []
    if KVBackend not in cls.__mro__:
        out.append("does not subclass KVBackend (the defaults are there)")
    for cap in capabilities():
        value = inspect.getattr_static(cls, cap, None)
        if not isinstance(value, bool):
            out.append(f"capability {cap!r} not declared as a bool (got {value!r})")
    for name, sig in operations().items():
        if inspect.getattr_static(cls, name, None) is None:
            out.append(f"no {name}()")
            continue
        owner = next(c for c in cls.__mro__ if name in vars(c))
        needed_by = OPTIONAL.get(name, "always")
        owed = needed_by == "always" or (needed_by is not None and inspect.getattr_static(cls, needed_by, False))
        if owner is KVBackend and owed:
            out.append(f"{name}() left to KVBackend, but the backend " +
                       ("must define it" if needed_by == "always" else f"declares {needed_by}"))
            continue
        want, have = list(sig.parameters.values())[1:], _params(cls, name)
        names = [p.name for p in have[:len(want)]]
        extra = [p.name for p in have[len(want):]
                 if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if names != [p.name for p in want] or extra:
            out.append(f"{name}{inspect.signature(getattr(cls, name))} cannot be called as {name}{sig}")
    return out


def backend_classes() -> list:
    """Every *Backend class defined in kvtransfer/backends/, as pytest params (skipped where its module's
    dependency is missing here)."""
    out = []
    for m in pkgutil.iter_modules(backends.__path__):
        need = NEEDS.get(m.name)
        if need is not None and importlib.util.find_spec(need) is None:
            out.append(pytest.param(m.name, marks=pytest.mark.skip(reason=f"{m.name} needs {need}")))
            continue
        mod = importlib.import_module(f"{backends.__name__}.{m.name}")
        out += [pytest.param(c, id=c.__name__) for n, c in vars(mod).items()
                if inspect.isclass(c) and c.__module__ == mod.__name__ and n.endswith("Backend")]
    return out


def test_the_contract_names_what_the_ends_rely_on():
    assert set(operations()) == {"add_peer", "remove_peer", "write", "write_layers", "write_range", "state",
                                 "wait", "release", "settled", "notify", "notifications", "progress", "close",
                                 "grant", "revoke", "reserve_staging", "write_staged", "unstage", "drop_staging",
                                 "refusals"}
    assert set(OPTIONAL) <= set(operations())
    assert capabilities() == ["inline", "waits"]


def test_every_backend_of_the_package_is_found():
    found = {p.values[0].__name__ for p in backend_classes() if inspect.isclass(p.values[0])}
    assert {"NixlBackend", "TcpBackend", "AutoBackend"} <= found
    if importlib.util.find_spec("triton") is not None:
        assert "CudaIpcBackend" in found


@pytest.mark.parametrize("cls", backend_classes())
def test_a_backend_keeps_the_contract(cls):
    assert breaches(cls) == []


def test_a_backend_that_drops_a_method_or_a_capability_breaks_the_contract():
    from pdserve.kvtransfer.backends.tcp import TcpBackend

    class NoNotify(TcpBackend):
        notify = None

    class NoCapability(TcpBackend):
        inline = None

    class InlineWithoutWriteRange(TcpBackend):
        inline = True

    class WrongSignature(TcpBackend):
        def write(self, peer, layer, src_blocks, dst_blocks):
            return None

    assert breaches(NoNotify) == ["no notify()"]
    assert breaches(NoCapability) == ["capability 'inline' not declared as a bool (got None)"]
    assert breaches(InlineWithoutWriteRange) == ["write_range() left to KVBackend, but the backend declares inline"]
    assert [b.split("(")[0] for b in breaches(WrongSignature)] == ["write"]


@pytest.mark.parametrize("name", ["tcp", "nixl", "auto"])
def test_a_live_backend_on_the_cpu_is_a_kv_backend(name):
    """Built for real (NIXL over UCX on CPU memory), not from its class alone."""
    if name == "nixl" and nixl_module() is None:
        pytest.skip("nixl is not installed")
    kv = allocate_kv_cache(LAYOUT, torch.device("cpu"))
    meta = KVAgentMetadata.for_cache(f"contract-{uuid.uuid4().hex[:8]}", name, kv, LAYOUT, "tiny", "127.0.0.1")
    be = make_backend(name, meta, kv)
    try:
        assert isinstance(be, KVBackend)
        assert (be.inline, be.waits) == (False, False)  # on the CPU, every post goes through the posting thread
        assert be.notifications() == []
    finally:
        be.close()


def test_the_ends_read_capabilities_and_never_probe_a_backend():
    root = pathlib.Path(backends.__file__).parents[1]
    probe = re.compile(r"\b(hasattr|getattr)\(\s*(self\.)?(backends?|be)\b|\bcallable\(")
    for f in [*root.glob("*.py"), *root.glob("backends/*.py")]:
        hits = [line.strip() for line in f.read_text().splitlines() if probe.search(line)]
        assert hits == [], f"{f.name} probes a backend: {hits}"
