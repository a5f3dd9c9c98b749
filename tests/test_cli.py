"""`pdserve generate` as a user runs it: a real subprocess, text on stdout, clean errors."""

import subprocess
import sys

import pytest


def pdserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_prints_the_engines_greedy_text():
    from pdserve.config import EngineConfig, ModelConfig
    from pdserve.engine.engine import Engine
    from pdserve.protocol import SamplingParams

    r = pdserve("generate", "--model", "tiny-moe", "--max-tokens", "12", "--temperature", "0", "Hello there")
    assert r.returncode == 0, r.stderr
    engine = Engine(EngineConfig(model=ModelConfig(path="tiny-moe"), num_kv_blocks=64))
    expected = engine.generate(["Hello there"], SamplingParams(max_tokens=12, temperature=0))[0]
    assert r.stdout == expected.text + "\n"
    assert "finish reason" in r.stderr


@pytest.mark.parametrize("args, needle", [
    (["--max-tokens", "0"], "max_tokens"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "1.5"], "top_p"),
    (["--model", "no-such-preset"], "no-such-preset"),
])
def test_bad_input_exits_nonzero_without_traceback(args, needle):
    r = pdserve("generate", *args, "hi")
    assert r.returncode == 2
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


def test_prompt_over_context_is_a_clean_error():
    r = pdserve("generate", "--max-tokens", "1", "x" * 5000)
    assert r.returncode == 2 and "prompt" in r.stderr and "Traceback" not in r.stderr
