"""Regenerate router/grpc_gen/pdserve/ from proto/: python -m pdserve.router.grpc_gen.generate"""

import importlib.resources
import re
import shutil
import sys
import tempfile
from pathlib import Path

GEN_ROOT = Path(__file__).resolve().parent  # router/grpc_gen
PROTO_ROOT = GEN_ROOT.parents[1] / "proto"
# Generated import lines name a proto's package as a top-level module: `from pdserve.v1 import
# completion_pb2`. That `pdserve` would be our engine package, so such lines are made relative.
_GENERATED_IMPORT = re.compile(r"^from (pdserve(?:\.\w+)*) import (\w+_pb2(?:_grpc)?)\b", re.M)


def proto_files() -> list[str]:
    """The .proto files under proto/, relative to it, sorted (so output order is fixed)."""
    return sorted(p.relative_to(PROTO_ROOT).as_posix() for p in PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Write the Python code for every proto under out_dir/pdserve/; returns the files written."""
    # Imported here, not with the module: grpc_tools' protoc extension and NIXL's native libraries
    # abort a process that loads both ("munmap_chunk(): invalid pointer"), and importing this module
    # (for GEN_ROOT) must not load protoc.
    from grpc_tools import protoc

    well_known = importlib.resources.files("grpc_tools") / "_proto"  # google/protobuf/*.proto
    args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *proto_files()]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    written = sorted(p for p in (out_dir / "pdserve").rglob("*") if p.suffix in (".py", ".pyi"))
    for path in written:
        package = path.parent.relative_to(out_dir).as_posix().replace("/", ".")
        text = _GENERATED_IMPORT.sub(lambda m: f"from {_relative(m[1], package)} import {m[2]}",
                                     path.read_text())
        path.write_text(text)
    for package_dir in sorted({p.parent for p in written}):
        while package_dir != out_dir:
            init = package_dir / "__init__.py"
            if not init.exists():
                init.write_text("")
                written.append(init)
            package_dir = package_dir.parent
    return sorted(written)


def _relative(module: str, package: str) -> str:
    """`module` as a relative import from inside `package` (both dotted)."""
    a, b = package.split("."), module.split(".")
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    return "." * (len(a) - common + 1) + ".".join(b[common:])


def main() -> None:
    # Generate aside, then swap the whole tree in, so code of a deleted .proto does not linger.
    target = GEN_ROOT / "pdserve"
    with tempfile.TemporaryDirectory() as tmp:
        files = [f.relative_to(tmp) for f in generate(Path(tmp))]
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(Path(tmp) / "pdserve", target)
    for f in files:
        print(f"wrote {GEN_ROOT / f}", file=sys.stderr)


if __name__ == "__main__":
    main()
