"""Where each replica runs on a Ray cluster of several nodes (cluster.yaml's `<role>.placement`).

Every replica is a placement group: one bundle per worker (an EP rank each) holding its GPUs (whole
ones), the role's custom resources and a sliver of CPU (a bundle may not be empty). Its bundles
carry a label selector: the role's `labels`, and — where the strategy picked a node — that node's
`ray.io/node-id`, so that Ray itself holds the replica to it. The ranks of one EP replica share a
node (STRICT_PACK) unless `decode.ep_across_nodes`.

"spread" and "pack" are decided here, not by Ray (which spreads tasks, not one role's replicas
apart from each other): among the live nodes that qualify and still have room for the replica
(their totals less what this cluster's replicas hold there), "spread" takes the one with the
fewest workers of the role, "pack" the one with the most; ties go to the node with the fewest
workers of any role, then to the lower address. A replacement is placed the same way among the
nodes alive then, so a dead node's replicas come back elsewhere.
"""

from dataclasses import dataclass

from pdserve.config import ClusterConfig, ConfigError

NODE_ID = "ray.io/node-id"  # the label Ray gives every node: its id
CPU_SLIVER = 0.001


@dataclass
class NodeInfo:
    node_id: str
    ip: str
    labels: dict[str, str]
    resources: dict[str, float]  # totals

    def describe(self) -> str:
        labels = {k: v for k, v in self.labels.items() if not k.startswith("ray.io/")}
        res = {k: v for k, v in self.resources.items() if k not in ("memory", "object_store_memory")
               and not k.startswith("node:")}
        return f"{self.ip} ({self.node_id[:8]}; labels {labels or '{}'}; resources {res})"


def cluster_nodes() -> list[NodeInfo]:
    """The Ray cluster's live nodes."""
    import ray

    return sorted((NodeInfo(n["NodeID"], n["NodeManagerAddress"], dict(n.get("Labels") or {}), dict(n["Resources"]))
                   for n in ray.nodes() if n["Alive"]), key=lambda n: (n.ip, n.node_id))


@dataclass(frozen=True)
class Demand:
    """What one replica of a role asks for."""

    role: str
    ranks: int
    bundle: dict[str, float]  # per worker
    labels: dict[str, str]
    strategy: str  # any | spread | pack
    one_node: bool  # every rank on one node

    @classmethod
    def of(cls, cfg: ClusterConfig, role: str) -> "Demand":
        section = getattr(cfg, role)
        p = section.placement
        ranks = cfg.decode.ep_size if role == "decode" else getattr(section, "tp_size", 1)
        bundle = {"CPU": CPU_SLIVER, **({"GPU": float(section.gpus)} if section.gpus else {}), **p.resources}
        one_node = not (role == "decode" and cfg.decode.ep_across_nodes)
        return cls(role, ranks, bundle, dict(p.labels), p.strategy, one_node)

    def per_node(self) -> dict[str, float]:
        """What a node must offer to hold the replica (all its ranks, or one where they may spread)."""
        n = self.ranks if self.one_node else 1
        return {k: v * n for k, v in self.bundle.items()}

    def qualifies(self, node: NodeInfo, held: dict[str, float] | None = None) -> bool:
        """The node has the labels, and room for the replica (past what `held` takes there already)."""
        if any(node.labels.get(k) != v for k, v in self.labels.items()):
            return False
        held = held or {}
        return all(node.resources.get(k, 0.0) - held.get(k, 0.0) >= v - 1e-9 for k, v in self.per_node().items())


def check_placement(cfg: ClusterConfig, nodes: list[NodeInfo]) -> None:
    """Every role with replicas has a node that can hold one of them; else ConfigError naming the key."""
    problems = []
    for role in ("prefill", "decode", "colocated"):
        if not getattr(cfg, role).replicas:
            continue
        d = Demand.of(cfg, role)
        if any(d.qualifies(n) for n in nodes):
            continue
        key = f"{role}.placement" if (d.labels or getattr(cfg, role).placement.resources) else f"{role}.gpus"
        if role == "decode" and d.ranks > 1 and d.one_node:
            key += " (with decode.ep_size: %d on one node; decode.ep_across_nodes: true lets ranks spread)" % d.ranks
        asks = f"labels {d.labels or '{}'}, per node {d.per_node()}"
        problems.append(f"{key}: no node of the Ray cluster qualifies — it asks {asks}; the nodes: "
                        + "; ".join(n.describe() for n in nodes))
    if problems:
        raise ConfigError("\n".join(problems))


def choose_node(d: Demand, nodes: list[NodeInfo], placed: list[tuple[str, str, dict[str, float]]]) -> str | None:
    """The node for one more replica of d.role, or None where Ray may choose (strategy any, or ranks
    allowed across nodes). `placed`: (role, node id, resources held) of every other live replica."""
    if d.strategy == "any" or not d.one_node:
        return None
    held: dict[str, dict[str, float]] = {}
    mine: dict[str, int] = {}
    total: dict[str, int] = {}
    for role, node_id, res in placed:
        h = held.setdefault(node_id, {})
        for k, v in res.items():
            h[k] = h.get(k, 0.0) + v
        total[node_id] = total.get(node_id, 0) + 1
        if role == d.role:
            mine[node_id] = mine.get(node_id, 0) + 1
    fits = [n for n in nodes if d.qualifies(n, held.get(n.node_id))]
    if not fits:
        return None  # no room now: Ray queues it (and the start's deadline names what it waited for)
    sign = 1 if d.strategy == "spread" else -1
    best = min(fits, key=lambda n: (sign * mine.get(n.node_id, 0), total.get(n.node_id, 0), n.ip, n.node_id))
    return best.node_id


def placement_group_for(d: Demand, node_id: str | None, name: str):
    """The replica's placement group (not yet placed: `.wait`)."""
    from ray.util.placement_group import placement_group

    selector = dict(d.labels) | ({NODE_ID: node_id} if node_id else {})
    kw = {"bundle_label_selector": [selector] * d.ranks} if selector else {}
    # Detached, as the workers in it: a replica outlives a controller that dies (and is restarted).
    return placement_group([dict(d.bundle)] * d.ranks, strategy="STRICT_PACK" if d.one_node else "PACK",
                           name=name, lifetime="detached", **kw)
