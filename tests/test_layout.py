"""The installed layout: the repository's top-level folders live inside the pdserve namespace, and
the router's process runs without torch (it only routes, tokenizes and streams)."""

import subprocess
import sys

# Every module the Router actor loads (pdserve.router.server and what it imports, gRPC included; the
# dashboard's figures, the actors' names, the forecast's step costs).
ROUTER_MODULES = ["pdserve.router.server", "pdserve.router.core", "pdserve.router.http_api",
                  "pdserve.router.http_errors", "pdserve.router.http_stream",
                  "pdserve.router.grpc_server", "pdserve.router.metrics", "pdserve.router.replica_health",
                  "pdserve.router.decode_replica", "pdserve.router.dashboard", "pdserve.router.forecast",
                  "pdserve.cluster_view", "pdserve.actors", "pdserve.step_cost", "pdserve.config",
                  "pdserve.tokenizer", "pdserve.models", "pdserve.messages", "pdserve.protocol"]


def python(code: str, cwd) -> subprocess.CompletedProcess:
    # Not from the repository's root: there the folders would import as plain directories.
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_top_level_folders_import_only_inside_pdserve(tmp_path):
    for name in ("router", "prefill", "decode", "kvtransfer"):
        r = python(f"import {name}", tmp_path)
        assert r.returncode != 0 and "No module named" in r.stderr, f"`import {name}` worked"
    r = python("import pdserve.router.server, pdserve.prefill.worker, pdserve.decode.worker, pdserve.kvtransfer; "
               "print(pdserve.kvtransfer.__file__)", tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("kvtransfer/__init__.py")


def test_the_router_imports_no_torch(tmp_path):
    code = "; ".join(f"import {m}" for m in ROUTER_MODULES)
    heavy = "sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'matplotlib'))[:5]"
    r = python(f"import sys; {code}; print({heavy})", tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", f"the router's modules import torch or matplotlib: {r.stdout}"


def test_a_worker_imports_no_compiler(tmp_path):
    """A worker's start runs beside the replicas serving: torch._dynamo and inductor (loaded by any
    module that applies torch.compile at import, as llguidance.torch does) were about half the CPU of
    its imports, for nothing it uses (docs/benchmarks.md, "a worker's imports")."""
    heavy = "sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor')))[:5]"
    r = python(f"import sys; import pdserve.worker.engine_worker; print({heavy})", tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", f"a worker's imports load the compiler: {r.stdout}"
