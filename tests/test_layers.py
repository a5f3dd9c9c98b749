"""Layers that only look down: every import of the project's modules (read with `ast`, nothing is
imported) goes from a folder to a folder of a lower layer, or stays in its folder. An import inside a
function counts: it is as much a dependency as one at the top. The order is LAYERS below; it is
stated in docs/architecture.md ("Layers") too."""

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pdserve", "router", "prefill", "decode", "kvtransfer")  # the project's modules (tests apart)
# These top-level folders install inside the pdserve namespace (pyproject's package-dir): pdserve.router is router/.
NAMESPACED = ("router", "prefill", "decode", "kvtransfer")

# Lowest first. A folder imports from its own folder and from lower layers only; the folders of one
# layer are peers and import none of each other. "pdserve" is the modules directly in pdserve/.
LAYERS: list[tuple[tuple[str, ...], str]] = [
    (("pdserve",), "the nouns every process shares (config, protocol, messages, tokenizer, actors' names): no torch"),
    (("kvtransfer", "pdserve/channel"), "the data planes: KV between engines (imports none of the engine); "
                                          "requests and tokens between routers and workers (no torch)"),
    (("pdserve/forward",), "what a forward reads besides the weights: the step's batch and the KV cache"),
    (("pdserve/ops",), "the kernels (attention, MoE, norms) over those tensors"),
    (("pdserve/models",), "the model families, built from the ops"),
    (("pdserve/engine",), "the engine core: scheduler, blocks, model runner; loads a model and its kernels"),
    (("pdserve/worker",), "what every worker process shares: the engine in a Ray actor, its loop, its rank groups"),
    (("prefill", "decode", "router"), "the processes' own code, peers: the prefill and decode workers, the router"),
    (("pdserve/control",), "the control plane: starts, watches and replaces the processes"),
    (("pdserve/benchmarks",), "the measurements: they drive any layer"),
    (("pdserve/cli.py",), "the `pdserve` command: the entry point"),
]

# (importing file, imported module) -> why it must point up. None is needed; one added here says why.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    file: str  # the importing file, relative to the root
    line: int
    text: str  # the statement as written
    module: str  # the project module it names
    source: str  # the importing file's folder (a LAYERS entry)
    target: str | None  # the imported module's folder; None: in no layer


def module_path(module: str) -> list[str]:
    """pdserve.router.ray_core -> [router, ray_core]; pdserve.engine.engine -> [pdserve, engine, engine]."""
    parts = module.split(".")
    return parts[1:] if len(parts) > 1 and parts[1] in NAMESPACED else parts


def folder_of(path: list[str], layers=LAYERS) -> str | None:
    """The LAYERS entry a file or module (as path parts, no .py) belongs to; None: in no layer."""
    entries = sorted((e for names, _ in layers for e in names), key=len, reverse=True)
    for entry in entries:
        parts = entry.removesuffix(".py").split("/")
        if path[:len(parts)] == parts:
            if entry == "pdserve" and len(path) > 2:
                return None  # a folder of pdserve/ that LAYERS does not place
            return entry
    return None


def module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[0] in NAMESPACED:
        parts.insert(0, "pdserve")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _exists(root: Path, module: str) -> bool:
    p = root.joinpath(*module_path(module))
    return p.is_dir() or p.with_suffix(".py").is_file()


def _targets(node: ast.AST, package: str, root: Path) -> list[str]:
    """The project modules an import statement names (a name imported from a package that is a
    module of its own counts as that module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "pdserve"]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    if module.split(".")[0] != "pdserve":
        return []
    out = [f"{module}.{a.name}" for a in node.names if _exists(root, f"{module}.{a.name}")]
    return out or [module]


def scan(root: Path = ROOT, layers=LAYERS) -> tuple[list[Import], list[str]]:
    """Every import of a project module in the source folders; and the files that are in no layer."""
    imports, unplaced = [], []
    for top in SOURCES:
        for f in sorted((root / top).rglob("*.py")):
            rel = f.relative_to(root)
            source = folder_of(list(rel.with_suffix("").parts), layers)
            if source is None:
                unplaced.append(str(rel))
                continue
            name = module_name(rel)
            package = name if f.name == "__init__.py" else name.rpartition(".")[0]
            for node in ast.walk(ast.parse(f.read_text(), str(rel))):
                for module in _targets(node, package, root):
                    imports.append(Import(str(rel), node.lineno, ast.unparse(node), module, source,
                                          folder_of(module_path(module), layers)))
    return imports, unplaced


def rank_of(layers=LAYERS) -> dict[str, int]:
    return {name: i for i, (names, _) in enumerate(layers) for name in names}


def downward_violations(imports: list[Import], layers=LAYERS, allowed=ALLOWED_UPWARD) -> list[str]:
    """Each import that is not from a folder to itself or to a lower layer, in words."""
    rank = rank_of(layers)
    out = []
    for i in imports:
        if i.target == i.source or (i.file, i.module) in allowed:
            continue
        if i.target is None:
            out.append(f"{i.file}:{i.line}: `{i.text}`: {i.module} is in no layer of LAYERS")
            continue
        a, b = rank[i.source], rank[i.target]
        if b > a:
            out.append(f"{i.file}:{i.line}: `{i.text}`: {i.source} (layer {a}) imports {i.target} "
                       f"(layer {b}), a higher layer")
        elif b == a:
            out.append(f"{i.file}:{i.line}: `{i.text}`: {i.source} imports {i.target}, a peer of its layer {a}")
    return out


def folder_loops(imports: list[Import]) -> list[str]:
    """Each import from folder A to folder B where B's imports lead back to A, in words."""
    edges: dict[str, dict[str, Import]] = {}
    for i in imports:
        if i.target is not None and i.target != i.source:
            edges.setdefault(i.source, {}).setdefault(i.target, i)

    def path(start: str, goal: str) -> list[str] | None:
        seen, todo = {start}, [[start]]
        while todo:
            p = todo.pop(0)
            if p[-1] == goal:
                return p
            for nxt in edges.get(p[-1], {}):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(p + [nxt])
        return None

    out = []
    for a, targets in sorted(edges.items()):
        for b, i in sorted(targets.items()):
            back = path(b, a)
            if back:
                out.append(f"{i.file}:{i.line}: `{i.text}`: {a} imports {b}, and {' -> '.join(back)} "
                           f"leads back (e.g. {edges[back[0]][back[1]].file})")
    return out


def test_every_module_is_in_a_layer():
    _, unplaced = scan()
    assert not unplaced, f"files in no layer (give their folder a place in LAYERS): {unplaced}"


def test_no_folder_loop():
    imports, _ = scan()
    assert len(imports) > 200, "the scan found too few imports to be reading the project"
    loops = folder_loops(imports)
    assert not loops, "folder loops:\n" + "\n".join(loops)


def test_imports_only_look_down():
    imports, _ = scan()
    bad = downward_violations(imports)
    assert not bad, "imports that do not look down:\n" + "\n".join(bad)


def test_every_allowed_exception_is_still_needed():
    imports, _ = scan()
    used = {(i.file, i.module) for i in imports}
    assert not set(ALLOWED_UPWARD) - used, f"stale exceptions: {sorted(set(ALLOWED_UPWARD) - used)}"


def _tree(root: Path, files: dict[str, str]) -> None:
    for top in SOURCES:
        (root / top).mkdir(parents=True, exist_ok=True)
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_a_planted_upward_import_and_loop_are_reported(tmp_path):
    _tree(tmp_path, {
        "pdserve/__init__.py": "",
        "pdserve/config.py": "",
        "pdserve/ops/__init__.py": "",
        # Lazy, inside a function: it counts.
        "pdserve/ops/attention.py": "def f():\n    from pdserve.engine.engine import Engine\n",
        "pdserve/engine/__init__.py": "",
        "pdserve/engine/engine.py": "from pdserve.ops import attention\nfrom pdserve import config\n",
        "router/__init__.py": "",
        "router/dashboard.py": "from pdserve.control import watch\n",
        "pdserve/control/__init__.py": "",
        "pdserve/control/watch.py": "import pdserve.router.dashboard\n",
    })
    imports, unplaced = scan(tmp_path)
    assert not unplaced
    bad = downward_violations(imports)
    assert bad == [
        "pdserve/ops/attention.py:2: `from pdserve.engine.engine import Engine`: pdserve/ops (layer 3) imports "
        "pdserve/engine (layer 5), a higher layer",
        "router/dashboard.py:1: `from pdserve.control import watch`: router (layer 7) imports pdserve/control "
        "(layer 8), a higher layer",
    ]
    loops = folder_loops(imports)
    assert len(loops) == 4 and any(ln.startswith("router/dashboard.py:1: ") and "router imports pdserve/control"
                                   in ln for ln in loops), loops
    assert any("pdserve/engine imports pdserve/ops, and pdserve/ops -> pdserve/engine leads back" in ln
               for ln in loops), loops


def test_a_sideways_import_an_unplaced_folder_and_an_exception(tmp_path):
    _tree(tmp_path, {
        "prefill/worker.py": "from pdserve.decode import ep_group\n",
        "decode/ep_group.py": "from pdserve.kvtransfer import messages\n",
        "kvtransfer/messages.py": "from .. import kvtransfer\nfrom pdserve.engine.sequence import Sequence\n",
        "pdserve/engine/sequence.py": "",
        "pdserve/newfolder/thing.py": "",
    })
    imports, unplaced = scan(tmp_path)
    assert unplaced == ["pdserve/newfolder/thing.py"]
    bad = downward_violations(imports)
    assert any(b.startswith("prefill/worker.py:1: ") and "a peer of its layer 7" in b for b in bad), bad
    assert any(b.startswith("kvtransfer/messages.py:2: ") and "imports pdserve/engine (layer 5)" in b for b in bad), bad
    assert len(bad) == 2  # the relative import stays inside kvtransfer
    allowed = {("kvtransfer/messages.py", "pdserve.engine.sequence"): "a planted exception"}
    assert len(downward_violations(imports, allowed=allowed)) == 1
