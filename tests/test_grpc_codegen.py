"""The committed gRPC code is what proto/ generates now, and it does not shadow our pdserve package."""

import importlib.metadata
import subprocess
import sys
from pathlib import Path

from pdserve.router.grpc_gen.generate import GEN_ROOT

REGENERATE = "python -m pdserve.router.grpc_gen.generate"


def test_generated_code_is_not_stale(tmp_path: Path):
    # protoc runs in a process of its own: loaded into this one, it would abort the first test after
    # it here that imports NIXL (their native libraries clash; see generate.py).
    subprocess.run([sys.executable, "-c", "import sys, pathlib; from pdserve.router.grpc_gen.generate import "
                    "generate; generate(pathlib.Path(sys.argv[1]))", str(tmp_path)], check=True, timeout=120)
    fresh = {p.relative_to(tmp_path): p.read_text() for p in (tmp_path / "pdserve").rglob("*")
             if p.suffix in (".py", ".pyi")}
    committed = {p.relative_to(GEN_ROOT): p.read_text()
                 for p in (GEN_ROOT / "pdserve").rglob("*") if p.suffix in (".py", ".pyi")}
    assert fresh, "no .proto found under proto/"
    stale = sorted(str(p) for p in fresh.keys() | committed.keys() if fresh.get(p) != committed.get(p))
    # A different grpcio-tools also changes the output (its version is written into the code).
    assert not stale, (f"router/grpc_gen differs from proto/ in {stale}; run `{REGENERATE}` "
                       f"(grpcio-tools {importlib.metadata.version('grpcio-tools')})")


def test_generated_code_leaves_pdserve_alone():
    # A fresh interpreter: here `pdserve` is already imported, which would hide a shadowing import.
    code = ("import pdserve.router.grpc_gen.pdserve.v1.completion_pb2_grpc, pdserve.protocol, sys;"
            "assert 'pdserve.v1' not in sys.modules;"
            "print(sys.modules['pdserve'].__file__)")
    root = GEN_ROOT.parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert Path(out.stdout.strip()) == root / "pdserve" / "__init__.py"
