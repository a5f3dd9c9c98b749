"""`pdserve serve MODEL` with vLLM's flags, as a vLLM user runs it: a real process, the `openai`
client, the flags in effect; Ray's own console lines kept out of the terminal (in their log file),
the dashboard's address printed by `serve` and `status`. And `pdserve up FILE`'s flags as overrides
of the file's keys, bad values and vLLM flags pdserve lacks refused naming the key or the flag."""

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
import yaml

from pdserve.benchmarks.up_process import ClusterStartError, UpProcess
from pdserve.config import ConfigError
from pdserve.control import serve_flags

KEY = "sk-serve-test-0123456789"
ADMIN_KEY = "sk-serve-admin-0123456789"  # PDSERVE_ADMIN_KEY: with a key on, /dashboard is an admin's
# Ray's console formats: its Python loggers' ("2026-11-28 16:41:07,161\tWARNING x.py:85 -- ...") and
# its C++ core's glog lines ("[2026-11-28 16:46:53,462 W 19538 19538] gcs_client.cc:210: ...").
RAY_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+(DEBUG|INFO|WARNING|ERROR)\s|"
                      r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [IWEF] \d+ \d+\]|RAY_AUTH_MODE|8\.8\.8\.8")


def ray_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if RAY_LINE.search(line)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    ray_log = tmp / "ray-console.log"
    # A new local Ray with RAY_AUTH_MODE unset always says "Token authentication is enabled ...":
    # one line of Ray's own that must land in the log file, not on the console.
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"} | {"PDSERVE_RAY_LOG": str(ray_log),
                                                                          "PDSERVE_ADMIN_KEY": ADMIN_KEY}
    up = UpProcess(None, tmp / "pdserve-serve.log", [
        "serve", "tiny-moe", "--host", "127.0.0.1", "--port", "0", "--grpc-port", "none", "--max-model-len", "96",
        "--served-model-name", "tiny-served", "--api-key", KEY, "--max-num-seqs", "8"], env=env)
    try:
        url = up.wait_healthy(None, 240)
    except ClusterStartError as e:
        up.stop(60)
        raise RuntimeError(f"{e}:\n{up.output()}") from e
    yield up, url, ray_log
    assert up.stop(60)[0] == 0, up.tail()


def test_serve_takes_vllms_flags_and_answers_the_openai_client(served):
    up, url, _ = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    [model] = client.models.list().data
    assert model.id == "tiny-served"  # --served-model-name
    assert model.model_extra["max_model_len"] == 96  # --max-model-len
    out = client.completions.create(model="tiny-served", prompt="Hello", max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError, match="max_tokens"):  # over --max-model-len
        client.completions.create(model="tiny-served", prompt="Hello", max_tokens=200)
    with pytest.raises(openai.AuthenticationError):  # --api-key: a request without it
        openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong-0123456789", max_retries=0).models.list()
    assert "grpc" not in up.endpoints()  # --grpc-port none
    assert "--max-num-seqs -> decode.max_num_seqs: 8, colocated.max_num_seqs: 8" in up.output()


def test_serve_and_status_print_the_dashboard_and_none_of_rays_lines(served):
    up, url, ray_log = served
    out = up.output()
    assert f"[pdserve] dashboard: {url}/dashboard" in out
    assert httpx.get(f"{url}/dashboard", timeout=10).status_code == 401  # --api-key on: an admin's page
    assert httpx.get(f"{url}/dashboard", headers={"authorization": f"Bearer {KEY}"}, timeout=10).status_code == 403
    assert httpx.get(f"{url}/dashboard", headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=10).status_code == 200
    assert not ray_lines(out), out
    logged = ray_log.read_text()
    assert "Token authentication is enabled" in logged and ray_lines(logged), logged  # Ray's, where they belong
    env = {**os.environ, "PDSERVE_RAY_LOG": str(ray_log)}
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "status", "--address", up.ray_address()],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert f"dashboard: {url}/dashboard" in r.stdout.splitlines()
    assert not ray_lines(r.stdout + r.stderr), r.stdout + r.stderr


def test_up_flags_override_the_files_keys(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"router": {"http_port": 9000, "policy": "round-robin"},
                                    "decode": {"max_num_seqs": 64}}))
    given = serve_flags.overrides(serve_flags_namespace("--port", "0", "--kv-cache-dtype", "fp8",
                                                        "--colocated-replicas", "2", "--prefill-replicas", "0",
                                                        "--decode-replicas", "0", "--no-enable-prefix-caching",
                                                        "--device", "cuda"))
    cfg = serve_flags.load(str(path), given)
    assert cfg.router.http_port == 0 and cfg.router.policy == "round-robin"  # the flag's key, the file's other
    assert cfg.decode.max_num_seqs == 64 and cfg.model.kv_cache_dtype == "fp8_e4m3"  # vLLM's "fp8"
    assert cfg.topology == "colocated" and cfg.colocated.replicas == 2 and not cfg.colocated.prefix_cache
    assert cfg.colocated.gpus == 1 and cfg.decode.gpus == 1  # --device cuda: a GPU per replica
    with pytest.raises(ConfigError, match=r"(?s)router\.http_port: '70000' is not allowed.*set by --port"):
        serve_flags.load(str(path), {"router.http_port": "70000"})


def test_vllms_speculative_config_sets_the_replicas_speculation(tmp_path):
    given = serve_flags.overrides(serve_flags_namespace(
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}'))
    cfg = serve_flags.load(None, given)
    for spec in (cfg.decode.speculative, cfg.colocated.speculative):
        assert (spec.method, spec.num_tokens, spec.prompt_lookup_max) == ("ngram", 3, 5)
    with pytest.raises(ConfigError, match=r"(?s)decode\.speculative.*set by --speculative-config"):
        serve_flags.load(None, serve_flags.overrides(serve_flags_namespace("--speculative-config", '{"method": "eagle"}')))


def serve_flags_namespace(*argv: str):
    import argparse

    p = argparse.ArgumentParser()
    serve_flags.add_flags(p)
    return p.parse_args(argv)


@pytest.mark.parametrize("args, needle", [
    (["serve", "--max-num-seqs", "0"], "decode.max_num_seqs: '0' is not allowed"),
    (["serve", "--max-num-seqs", "0"], "decode.max_num_seqs was set by --max-num-seqs '0'"),
    (["serve", "--gpu-memory-utilization", "1.5"], "prefill.gpu_memory_utilization: '1.5' is not allowed"),
    (["up", "--port", "x"], "router.http_port: 'x' is not allowed"),
    (["serve", "--prefill-replicas", "0", "--decode-replicas", "0"], "colocated.replicas is --colocated-replicas"),
    (["serve", "--pipeline-parallel-size", "2"], "vLLM's --pipeline-parallel-size has no equivalent in pdserve"),
    (["serve", "--enable-lora"], "pdserve serves no LoRA adapters"),
])
def test_bad_flags_fail_before_anything_starts_naming_the_key(args, needle):
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "starting Ray" not in r.stderr


def test_rays_message_of_a_dead_worker_goes_to_the_log_not_the_console(served):
    """Ray's GCS tells the driver "A worker died or was killed ..." (printed as "(raylet) ..."); pdserve
    says what it does about it (the replica down, replaced), and Ray's line goes to its log file. Last
    in this file: it kills a replica of the shared cluster."""
    up, url, ray_log = served
    status = subprocess.run([sys.executable, "-m", "pdserve.cli", "status", "--address", up.ray_address()],
                            capture_output=True, text=True, timeout=120).stdout
    pid = int(status.split("pdserve-decode-0 (pid ", 1)[1].split(")", 1)[0])
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 180
    while "pdserve-decode-0 replaced" not in up.output():
        assert time.monotonic() < deadline, f"pdserve-decode-0 was not replaced in 180 s:\n{up.tail()}"
        time.sleep(0.5)
    deadline = time.monotonic() + 30  # (Ray's message comes through a thread of its own)
    while "A worker died" not in ray_log.read_text():
        assert time.monotonic() < deadline, f"Ray said nothing of the dead worker:\n{ray_log.read_text()[-2000:]}"
        time.sleep(0.5)
    assert "(raylet)" not in up.output() and not ray_lines(up.output()), up.output()
