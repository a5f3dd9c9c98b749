"""A Ray node dies under a steady load: a two-node Ray cluster on this host (tests/ray_nodes.py), one
prefill and one decode replica on each node, and every process of the second node SIGKILLed (its
raylet, its workers). Its replicas come back on the head, their requests move to the survivors,
and what the load saw is checked as every chaos case's (tests/chaos.py), over nixl and over tcp."""

import pytest

from chaos import change, steady
from ray_nodes import LocalRayCluster, Node
from serving_cluster import Cluster
from test_multinode import placed


@pytest.fixture(params=["nixl", "tcp"])
def backend(request):
    return request.param


def test_a_node_dies_under_load_and_its_replicas_come_back_on_the_other(tmp_path, monkeypatch, backend):
    # The head gives up a node 0.6 s after its heartbeats stop (Ray's default is 15 s): until Ray
    # says so, a call to an actor there waits unanswered, and the requests on it with it — their
    # TTFT is this detection time plus their prefill again elsewhere.
    nodes = LocalRayCluster([Node("head", "127.0.0.1", {"pd_prefill": 2, "pd_decode": 2}),
                             Node("n2", "127.0.0.2", {"pd_prefill": 1, "pd_decode": 1})],
                            health_check_period_ms=200, health_check_failure_threshold=3).start()
    try:
        for k, v in nodes.env().items():
            monkeypatch.setenv(k, v)
        c = Cluster(tmp_path, ray={"address": nodes.address}, router={"replicas": 2},
                    kv_transfer={"backend": backend, "lease_s": 60},
                    prefill={"replicas": 2, "placement": {"resources": {"pd_prefill": 1}, "strategy": "spread"}},
                    decode={"replicas": 2, "placement": {"resources": {"pd_decode": 1}, "strategy": "spread"}})
        c.backend = backend
        try:
            c.wait_ready()
            where = placed(c.status())
            assert list(where.values()).count("127.0.0.2") == 2, where  # spread: one of each role there
            steady(c)
            change(c, lambda: nodes.kill_node("127.0.0.2"), 2, 2, "a Ray node's processes SIGKILLed",
                   after=lambda: c.output().count("serving again") >= 2)  # its prefill and decode replaced
            assert "127.0.0.2" not in placed(c.status()).values()  # the lost ones came back on the head
        finally:
            if getattr(c, "load", None) is not None:
                c.load.stop()
            assert c.stop() == 0, c.output()
    finally:
        nodes.stop()
