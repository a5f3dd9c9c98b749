"""Who gets into the cluster: Ray's token authentication as the README's multi-node recipe starts it,
`pdserve up`'s refusal of a cluster without it, and the secrets a Ray worker does not inherit.

Two Ray clusters of two nodes on this host (tests/ray_nodes.py: `ray start` processes), one per
module: one started as the recipe says (token mode, the token in a secret file) — a driver without
the token, or with another, is refused; with it, let in — and one without authentication:
`pdserve up` refuses it naming `ray.allow_unauthenticated`, and serves on it when that is set.
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import grpc
import openai
import psutil
import pytest
import yaml
from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

from pdserve.control.ray_auth import probe
from ray_nodes import LocalRayCluster, Node
from serving_cluster import Cluster

README = Path(__file__).resolve().parents[1] / "README.md"
DRIVER = "import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); print(len(ray.nodes()), 'nodes')"
DRIVER_S = 180  # a refused driver gives up by itself well within it
SECRETS = {"PDSERVE_API_KEYS": "ops:sk-ops-secret", "PDSERVE_ADMIN_KEY": "sk-admin-secret",
           "PDSERVE_CLUSTER_TOKEN": "cluster-token-secret"}


def two_nodes(token: bool) -> LocalRayCluster:
    return LocalRayCluster([Node("head", "127.0.0.1", {"pd_head": 1}), Node("n2", "127.0.0.2", {"pd_n2": 1})],
                           token=token)


@pytest.fixture(scope="class")  # its class's tests only: gone before the other cluster's start
def guarded():
    c = two_nodes(token=True)
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.fixture(scope="module")  # set up after the tests above: no other cluster runs beside it
def open_nodes():
    c = two_nodes(token=False)
    try:
        yield c.start()
    finally:
        c.stop()


def recipe_exports() -> dict[str, str]:
    """The variables the README's multi-node recipe exports before `ray start`."""
    text = README.read_text()
    block = next(b for b in text.split("```bash")[1:] if "ray start --head" in b).split("```")[0]
    out = {}
    for line in block.splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["export"]:
            out |= dict(w.split("=", 1) for w in words[1:])
    return out


def driver(address: str, env: dict[str, str], home: Path) -> subprocess.CompletedProcess:
    """A Ray driver joining `address` in `env`, with a home of its own (no ~/.ray/auth_token there)."""
    return subprocess.run([sys.executable, "-c", DRIVER, address], env=dict(env, HOME=str(home)),
                          capture_output=True, text=True, timeout=DRIVER_S)


def gcs_nodes(address: str, token: str) -> grpc.StatusCode:
    """How the GCS answers a call for its nodes carrying `token` as Ray's clients send it."""
    with grpc.insecure_channel(address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetAllNodeInfo(gcs_service_pb2.GetAllNodeInfoRequest(), timeout=30,
                                metadata=(("authorization", f"Bearer {token}"),))
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def stranger_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}


class TestTheReadmeRecipe:
    """A two-node cluster started as the README says."""

    def test_the_readme_recipe_starts_ray_with_a_token_from_a_secret_file(self, guarded):
        exports = recipe_exports()
        assert exports.get("RAY_AUTH_MODE") == "token", exports
        assert "RAY_AUTH_TOKEN_PATH" in exports and "RAY_AUTH_TOKEN" not in exports, exports  # a file, not a literal
        env = guarded.env()  # how the test nodes were started: the same variables
        assert {k: env[k] for k in exports} == {"RAY_AUTH_MODE": "token",
                                                "RAY_AUTH_TOKEN_PATH": str(guarded.token_path())}
        assert guarded.token_path().stat().st_mode & 0o077 == 0

    def test_a_driver_without_the_token_is_refused_and_one_with_it_let_in(self, guarded, tmp_path):
        refused = driver(guarded.address, stranger_env(), tmp_path)
        assert refused.returncode != 0, refused.stdout
        assert "Authentication token is missing or incorrect" in refused.stderr, refused.stderr[-2000:]
        assert probe(guarded.address).open is False  # the GCS itself, asked with no token
        assert gcs_nodes(guarded.address, "not-the-token") == grpc.StatusCode.UNAUTHENTICATED  # and with another
        assert gcs_nodes(guarded.address, guarded.token_path().read_text().strip()) == grpc.StatusCode.OK
        let_in = driver(guarded.address, guarded.env(), tmp_path)
        assert let_in.returncode == 0, let_in.stderr[-2000:]
        assert "2 nodes" in let_in.stdout


def test_a_local_cluster_started_by_pdserve_up_gives_its_workers_no_secrets(tmp_path, monkeypatch):
    """`ray.address: local`: Ray's processes are `pdserve up`'s children, and would inherit its environment."""
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    cluster = Cluster(tmp_path, colocated={"replicas": 1, "num_kv_blocks": 256}, router={"grpc_port": None})
    try:
        cluster.wait_ready()
        ray_processes = psutil.Process(cluster.proc.pid).children(recursive=True)
        assert any("raylet" in " ".join(_cmdline(p)) for p in ray_processes)
        assert any(_cmdline(p)[:1] == ["ray::FlipWorker"] or "ColocatedWorker" in " ".join(_cmdline(p))
                   for p in ray_processes), [_cmdline(p)[:2] for p in ray_processes]
        assert_no_process_holds_the_secrets(ray_processes)
    finally:
        assert cluster.stop() == 0


def test_pdserve_up_refuses_a_cluster_without_authentication(open_nodes, tmp_path):
    assert probe(open_nodes.address).open is True
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"ray": {"address": open_nodes.address},
                                    "colocated": {"replicas": 1, "num_kv_blocks": 256},
                                    "router": {"host": "127.0.0.1", "http_port": 0, "grpc_port": None}}))
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "up", str(path)], env=open_nodes.env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:  # it went on: the refusal is missing
            proc.kill()
            proc.communicate()
    assert proc.returncode == 2, out[-3000:]
    message = out[out.index("pdserve: error: "):]
    assert "ray.address: " in message and "no token authentication" in message
    assert "RAY_AUTH_MODE=token" in message and "ray.allow_unauthenticated: true" in message


def test_told_so_pdserve_up_serves_there_and_no_worker_holds_the_secrets(open_nodes, tmp_path, monkeypatch):
    """With the opt-out it serves, saying the risk; the API keys and the cluster token given to
    `pdserve up` reach no process Ray runs (they stay in `pdserve up`'s own)."""
    for k, v in (open_nodes.env() | SECRETS).items():
        monkeypatch.setenv(k, v)
    cluster = Cluster(tmp_path, ray={"address": open_nodes.address, "allow_unauthenticated": True},
                      colocated={"replicas": 1, "num_kv_blocks": 256})
    try:
        cluster.wait_ready()
        assert "Going on, as ray.allow_unauthenticated: true says" in cluster.output()
        client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="sk-ops-secret", max_retries=0, timeout=120)
        r = client.completions.create(model="tiny-moe", prompt="Hello", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3
        assert_no_process_holds_the_secrets(open_nodes.processes())
    finally:
        assert cluster.stop() == 0


def assert_no_process_holds_the_secrets(processes: list[psutil.Process]) -> None:
    seen = 0
    for p in processes:
        try:
            env = p.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        seen += 1
        held = [k for k, v in SECRETS.items() if k in env or any(v in x for x in env.values())]
        assert not held, f"{_cmdline(p)[:3]} (pid {p.pid}) holds {held}"
    assert seen, "no process of the cluster was read"


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []
