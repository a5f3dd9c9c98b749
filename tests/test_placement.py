"""Placement (cluster.yaml's <role>.placement): config errors naming the key, which nodes qualify,
spread and pack among them, and a role no node can hold refused before anything starts."""

import pytest
import yaml

from pdserve.config import ClusterConfig, ConfigError, load_cluster_config
from pdserve.control.placement import Demand, NodeInfo, check_placement, choose_node


def load(tmp_path, raw: dict) -> ClusterConfig:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_cluster_config(str(path))


def node(name: str, ip: str, **resources) -> NodeInfo:
    return NodeInfo(f"{name}-id-0123456789", ip, {"pd-node": name, "ray.io/node-id": f"{name}-id"},
                    {"CPU": 1.0, **resources})


NODES = [node("head", "10.0.0.1"), node("n2", "10.0.0.2", pd_prefill=2.0), node("n3", "10.0.0.3", pd_prefill=2.0, GPU=2.0)]


@pytest.mark.parametrize("raw, says", [
    ({"prefill": {"placement": {"strategy": "scatter"}}}, r"prefill\.placement\.strategy: 'scatter' is not allowed"),
    ({"decode": {"placement": {"resources": {"GPU": 1}}}}, r"decode\.placement\.resources: .*GPU is Ray's own"),
    ({"prefill": {"placement": {"resources": {"pd_prefill": 0}}}}, r"prefill\.placement\.resources: .*above 0"),
    ({"colocated": {"replicas": 1, "placement": {"labels": {"ray.io/node-id": "x"}}}},
     r"colocated\.placement\.labels: .*not Ray's own"),
    ({"prefill": {"placement": {"nodes": ["a"]}}}, r"prefill\.placement\.nodes: unknown key \(allowed here: labels, resources, strategy\)"),
    ({"kv_transfer": {"backend": "rdma"}}, r"kv_transfer\.backend: 'rdma' is not allowed"),
])
def test_bad_placement_keys_are_named(tmp_path, raw, says):
    with pytest.raises(ConfigError, match=says):
        load(tmp_path, raw)


def test_a_role_no_node_can_hold_is_refused_naming_the_key_and_the_nodes(tmp_path):
    cfg = load(tmp_path, {"prefill": {"placement": {"labels": {"pd-node": "n9"}}},
                          "decode": {"placement": {"resources": {"pd_decode": 1}}}})
    with pytest.raises(ConfigError) as e:
        check_placement(cfg, NODES)
    text = str(e.value)
    assert "prefill.placement: no node of the Ray cluster qualifies — it asks labels {'pd-node': 'n9'}" in text
    assert "decode.placement: no node" in text and "'pd_decode': 1.0" in text
    assert "10.0.0.2 (n2-id-01; labels {'pd-node': 'n2'}; resources {'CPU': 1.0, 'pd_prefill': 2.0})" in text
    # GPUs: one GPU replica fits n3; an EP = 4 group of GPU ranks fits no node unless it may spread.
    ok = load(tmp_path, {"decode": {"gpus": 1, "ep_size": 2}})
    check_placement(ok, NODES)
    with pytest.raises(ConfigError, match=r"decode\.gpus \(with decode\.ep_size: 4 on one node"):
        check_placement(load(tmp_path, {"decode": {"gpus": 1, "ep_size": 4}}), NODES)
    check_placement(load(tmp_path, {"decode": {"gpus": 1, "ep_size": 4, "ep_across_nodes": True}}),
                    NODES + [node("n4", "10.0.0.4", GPU=2.0)])


def test_spread_and_pack_pick_nodes_with_room(tmp_path):
    cfg = load(tmp_path, {"prefill": {"replicas": 4, "placement": {"resources": {"pd_prefill": 1},
                                                                     "strategy": "spread"}}})
    d = Demand.of(cfg, "prefill")
    placed = []
    for _ in range(4):
        n = choose_node(d, NODES, placed)
        placed.append(("prefill", n, {"pd_prefill": 1.0, "CPU": 0.001}))
    # Spread alternates over the two nodes offering pd_prefill; each holds two (its pd_prefill: 2).
    assert [p[1] for p in placed] == ["n2-id-0123456789", "n3-id-0123456789"] * 2
    assert choose_node(d, NODES, placed) is None  # no room left: Ray queues it (the start's deadline names it)
    pack = Demand.of(load(tmp_path, {"prefill": {"placement": {"resources": {"pd_prefill": 1}, "strategy": "pack"}}}),
                     "prefill")
    first = choose_node(pack, NODES, [])
    assert choose_node(pack, NODES, [("prefill", first, {"pd_prefill": 1.0})]) == first  # same node while it has room
    assert choose_node(Demand.of(load(tmp_path, {}), "prefill"), NODES, []) is None  # "any": Ray's choice


def test_ep_ranks_share_a_node_unless_told():
    cfg = ClusterConfig.model_validate({"decode": {"ep_size": 2, "gpus": 1}})
    d = Demand.of(cfg, "decode")
    assert d.one_node and d.per_node() == {"CPU": 0.002, "GPU": 2.0}
    across = Demand.of(ClusterConfig.model_validate({"decode": {"ep_size": 2, "gpus": 1, "ep_across_nodes": True}}),
                       "decode")
    assert not across.one_node and across.per_node() == {"CPU": 0.001, "GPU": 1.0}
