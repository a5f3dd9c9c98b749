"""What a new user reads: the README's two commands, the help texts; and the rule that the project
points at nothing outside its repository."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / n for n in names if n.endswith((".py", ".md", ".yaml", ".toml", ".sh", ".proto"))
            and "grpc_gen/pdserve" not in n and n != "tests/test_docs.py"]


def test_nothing_points_outside_the_repository():
    outside = re.compile(r"\.\./shared|DESIGN(\.md| §)")
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in tracked_text_files()
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if outside.search(line)]
    assert not hits, f"references to files outside the repository: {hits}"


def test_readme_install_is_what_ci_runs_and_says_what_tiny_moe_is():
    readme = (ROOT / "README.md").read_text()
    two = readme.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    ci = (ROOT / ".ci/run").read_text()
    install = re.search(r"pip install torch==2\.13\.0 -e \"(\.\[[\w,]+\])\"", two)
    assert install, "the README's install command"
    assert f'-e "{install[1]}"' in ci, "CI must install what the README says"
    # Serving alone: the test extras (Triton, Playwright, kubernetes-validate: ~1.3 GB) come with the tests.
    assert "test" not in install[1] and "plot" not in install[1], install[1]
    tests = re.search(r"```bash\n(pip install -e \"\.\[test\]\" && python -m pytest [^\n]+)\n```", two)
    assert tests, "the README's test command, installing the test extras itself"
    assert tests[1].replace("pip install", "python -m pip install -q") in ci, "CI must run the README's test command"
    assert "random weights" in two and "model.path" in two  # why the default's text is noise, and the way out
    assert "--index-url" in two and "/whl/cpu" in two  # the CPU torch build, where pip would take CUDA's


def test_help_texts_cite_no_design_file():
    for args in (["bench", "--help"], ["bench-engine", "--help"], ["--help"], ["up", "--help"]):
        r = subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "DESIGN" not in r.stdout + r.stderr
