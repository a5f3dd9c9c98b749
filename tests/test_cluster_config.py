"""cluster.yaml topologies: disaggregated (prefill + decode replicas), colocated (colocated
replicas only) or mixed (all three); a wrong mix (prefill without decode, or decode without
prefill) fails on load, naming the keys and what is allowed."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdserve.config import ClusterConfig, ConfigError, load_cluster_config

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def load(tmp_path, raw: dict) -> ClusterConfig:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_cluster_config(str(path))


def test_the_default_is_one_prefill_and_one_decode_replica(tmp_path):
    for cfg in (load_cluster_config(None), load(tmp_path, {})):
        assert (cfg.prefill.replicas, cfg.decode.replicas, cfg.colocated.replicas) == (1, 1, 0)
    with pytest.raises(ConfigError, match=r"prefill\.replicas: 0 is not allowed — a disaggregated cluster"):
        load(tmp_path, {"prefill": {"replicas": 0}})


@pytest.mark.parametrize("named", [{}, {"prefill": {"replicas": 0}, "decode": {"replicas": 0, "max_num_seqs": 8}}])
def test_colocated_replicas_leave_no_prefill_or_decode_replicas(tmp_path, named):
    cfg = load(tmp_path, {"colocated": {"replicas": 2, "max_num_seqs": 32, "chunk_size": 64}, **named})
    assert (cfg.prefill.replicas, cfg.decode.replicas, cfg.colocated.replicas) == (0, 0, 2)
    engine = cfg.engine_config("colocated")  # both phases' settings
    assert (engine.role, engine.max_num_seqs, engine.chunk_size) == ("colocated", 32, 64)


def test_a_mixed_cluster_has_prefill_decode_and_colocated_replicas(tmp_path):
    cfg = load(tmp_path, {"colocated": {"replicas": 1}, "prefill": {"replicas": 1}, "decode": {"replicas": 2}})
    assert (cfg.prefill.replicas, cfg.decode.replicas, cfg.colocated.replicas) == (1, 2, 1)
    assert cfg.topology == "mixed"
    assert load(tmp_path, {"colocated": {"replicas": 1}}).topology == "colocated"
    assert load(tmp_path, {}).topology == "disaggregated"
    # Its prefill and decode replicas move KV: cuda_ipc still needs them on GPUs.
    with pytest.raises(ConfigError, match=r"kv_transfer\.backend: 'cuda_ipc' is not allowed"):
        load(tmp_path, {"colocated": {"replicas": 1}, "prefill": {"replicas": 1}, "decode": {"replicas": 1},
                        "kv_transfer": {"backend": "cuda_ipc"}})


@pytest.mark.parametrize("half", [{"prefill": {"replicas": 1}}, {"decode": {"replicas": 2}},
                                  {"prefill": {"replicas": 1}, "decode": {"replicas": 0}}])
def test_colocated_with_prefill_or_decode_alone_names_the_key(tmp_path, half):
    with pytest.raises(ConfigError) as e:
        load(tmp_path, {"colocated": {"replicas": 1}, **half})
    msg = str(e.value)
    key, n = next((f"{s}.replicas", v["replicas"]) for s, v in half.items() if v["replicas"])
    assert f"{key}: {n} is not allowed" in msg
    assert "colocated.replicas: 1" in msg and "prefill and decode replicas come together" in msg


def test_colocated_gpus_are_0_or_1(tmp_path):
    with pytest.raises(ConfigError, match=r"colocated\.gpus: 2 is not allowed"):
        load(tmp_path, {"colocated": {"replicas": 1, "gpus": 2}})


def test_pdserve_up_refuses_a_mixed_topology_before_starting(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("colocated: {replicas: 2}\ndecode: {replicas: 1}\n")
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "up", str(path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    assert "decode.replicas: 1 is not allowed" in r.stderr
    assert "Traceback" not in r.stderr and "starting Ray" not in r.stderr


def test_cuda_ipc_needs_gpu_replicas(tmp_path):
    with pytest.raises(ConfigError, match=r"kv_transfer\.backend: 'cuda_ipc' is not allowed — cuda_ipc moves KV "
                                          r"between GPUs of one host, and prefill\.gpus and decode\.gpus are 0"):
        load(tmp_path, {"kv_transfer": {"backend": "cuda_ipc"}})
    with pytest.raises(ConfigError, match=r"and decode\.gpus is 0; set them to 1, or use nixl or tcp"):
        load(tmp_path, {"kv_transfer": {"backend": "cuda_ipc"}, "prefill": {"gpus": 1}})
    cfg = load(tmp_path, {"kv_transfer": {"backend": "cuda_ipc"}, "prefill": {"gpus": 1}, "decode": {"gpus": 1}})
    assert cfg.kv_transfer.backend == "cuda_ipc"


def test_router_replicas_is_at_least_one(tmp_path):
    assert load(tmp_path, {"router": {"replicas": 3}}).router.replicas == 3
    with pytest.raises(ConfigError, match=r"router\.replicas: 0 is not allowed"):
        load(tmp_path, {"router": {"replicas": 0}})


def test_prefix_cache_is_on_by_default_and_off_per_role(tmp_path):
    cfg = load(tmp_path, {"decode": {"prefix_cache": False}})
    assert cfg.engine_config("prefill").enable_prefix_cache and not cfg.engine_config("decode").enable_prefix_cache
    cfg = load(tmp_path, {"colocated": {"replicas": 1, "prefix_cache": False}})
    assert not cfg.engine_config("colocated").enable_prefix_cache
    with pytest.raises(ConfigError, match=r"prefill\.prefix_cache"):
        load(tmp_path, {"prefill": {"prefix_cache": "sometimes"}})


def test_adaptive_is_the_default_and_a_decode_replicas_local_prefill_takes_its_own_sizes(tmp_path):
    from pdserve.router.prefill_site import PrefillSite

    cfg = load_cluster_config(None)
    assert cfg.router.prefill_site == "adaptive" and PrefillSite.of(cfg).mode == "adaptive"
    cfg = load(tmp_path, {"decode": {"chunk_size": 4096, "max_batch_tokens": 16384}})
    e = cfg.engine_config("decode")
    assert (e.chunk_size, e.max_num_batched_tokens) == (4096, 16384)
    site = PrefillSite.of(cfg)  # the routers forecast a local prefill in the decode replicas' chunks
    assert (site.chunk_tokens, site.step_tokens) == (4096, 16384)
    with pytest.raises(ConfigError, match=r"decode\.chunk_size"):
        load(tmp_path, {"decode": {"chunk_size": 0}})


@pytest.mark.parametrize("path", sorted(p.relative_to(DEPLOY).as_posix() for p in DEPLOY.rglob("*.yaml")
                                        if "kuberay" not in p.parts))
def test_every_cluster_file_in_deploy_loads(path):
    load_cluster_config(str(DEPLOY / path))  # raises ConfigError naming the key


def test_the_channels_transport_is_auto_or_tcp_and_a_wrong_one_is_named(tmp_path):
    assert load_cluster_config(None).router.channel_transport == "auto"
    assert load(tmp_path, {"router": {"channel_transport": "tcp"}}).router.channel_transport == "tcp"
    with pytest.raises(ConfigError, match=r"router\.channel_transport: 'udp'"):
        load(tmp_path, {"router": {"channel_transport": "udp"}})
