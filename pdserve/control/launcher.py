"""Starting and stopping one replica's workers: a prefill, colocated or decode worker, or the ranks
of an expert-parallel decode replica (and the group's rendezvous store, held here for the group's
life). Every replica is a placement group, one bundle per worker, on the node placement.py picks.

Each incarnation of a replica has workers of its own names (`pdserve-decode-0`, then
`pdserve-decode-0@1`, ...): a replacement never shares a name with the worker it replaces, so a
KV peer, a router's handle or a worker's list of dead routers can never mistake one for the other.
"""

import time
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.actors import NAMESPACE
from pdserve.config import ClusterConfig
from pdserve.control.placement import Demand, choose_node, cluster_nodes, placement_group_for
from pdserve.messages import ReplicaChange

# Threads of a worker actor. Calls that bring work return at once; a reservation waits for the next
# step boundary, so a burst of them holds a thread each until then: many, not the 8 that capped
# hand-offs at 8 per step.
WORKER_CONCURRENCY = 256
PLACE_S = 120  # a replica's placement group is placed within this, or its start fails naming what it asked
PLACE_CHECK_S = 1.0  # meanwhile, this often: is the node chosen for it still in the cluster?
# Each role's module holding its worker class. A process that receives an actor's handle has Ray
# load the actor's class to read its methods, which imports its module: so every worker's actor is a
# pdserve/worker/flip.py FlipWorker (no torch), holding the role's worker, and a router, which holds
# every worker's handle, imports none of these (torch, the engine: seconds and ~250k objects).
WORKER_MODULES = {"prefill": "pdserve.prefill.worker", "decode": "pdserve.decode.worker",
                  "colocated": "pdserve.worker.colocated"}


@dataclass
class Incarnation:
    """One replica's workers as started once."""

    role: str
    replica: str
    generation: int  # 0 for the first start, +1 for each replacement
    ranks: dict[str, ray.actor.ActorHandle]  # worker (actor) name -> handle
    placement_group: object = None
    store: object = None  # an expert-parallel or tensor-parallel group's rendezvous TCPStore
    # A tensor-parallel replica's ranks > 0 (pdserve/worker/tp_follower.py): not workers the
    # routers know (rank 0 in `ranks` is the replica), but stopped with it.
    followers: dict[str, ray.actor.ActorHandle] = field(default_factory=dict)
    restarts: int = 0
    state: str = "serving"  # as the routers were last told (ReplicaChange.state)
    chosen_node: str | None = None  # the node placement chose (None: Ray's choice)
    held: dict = field(default_factory=dict)  # resources the replica holds on its node (all its bundles)
    nodes: dict[str, dict] = field(default_factory=dict)  # worker -> {node_id, ip}, once ready
    # A flipped replica's worker: the Ray actor (and placement group) name it was started under, as
    # another replica (pdserve-prefill-1 serving as pdserve-decode-2). No new replica takes that name.
    born_as: str | None = None
    flipped: str = ""  # how it came to be, for `pdserve status`: "flipped from pdserve-prefill-1 in 1.30 s"

    def change(self) -> ReplicaChange:
        return ReplicaChange(self.role, self.replica, dict(self.ranks), self.state, self.restarts)

    def node_ids(self) -> list[str]:
        """The nodes it runs on (known once ready; before, the one chosen for it)."""
        return sorted({n["node_id"] for n in self.nodes.values()}) or ([self.chosen_node] if self.chosen_node else [])


def _wait_placed(pg, node: str | None) -> str | None:
    """None once `pg` is placed; else why not: PLACE_S passed, or its node left the cluster. A node
    that dies between its choice and the placement (a replacement for a replica of that very node,
    chosen before Ray marked it dead) can never take it: the start fails at once, and the
    controller's retry chooses among the live nodes, where it waited out PLACE_S before (120 s)."""
    deadline = time.monotonic() + PLACE_S
    while True:
        left = deadline - time.monotonic()
        if pg.wait(timeout_seconds=max(0.0, min(PLACE_CHECK_S, left))):
            return None
        if node is not None and node not in {n.node_id for n in cluster_nodes()}:
            return "(that node left the Ray cluster)"
        if left <= PLACE_CHECK_S:
            return f"within {PLACE_S} s"


def worker_name(replica: str, generation: int) -> str:
    return replica if generation == 0 else f"{replica}@{generation}"


def taken_names(incs) -> set[str]:
    """Replica names in use: the replicas', and those their flipped workers were started under (a Ray
    actor's and placement group's name; `@generation` apart, which a replacement would take)."""
    return {i.replica for i in incs} | {i.born_as.split("@")[0] for i in incs if i.born_as}


class Launcher:
    def __init__(self, config: ClusterConfig, cpu_threads: int, cluster_token: str | None = None):
        self.config = config
        self.cpu_threads = cpu_threads
        self.cluster_token = cluster_token

    def start(self, role: str, replica: str, generation: int, others: list[Incarnation] = ()) -> Incarnation:
        """Create the replica's workers (not yet ready: `wait_ready`) in a placement group of their
        own, on the node placement picks among those `others` (the other live replicas) leave room on."""
        from pdserve.prefill.worker import PrefillWorker
        from pdserve.worker.colocated import ColocatedWorker
        from pdserve.worker.flip import FlipWorker

        cfg, name = self.config, worker_name(replica, generation)
        demand = Demand.of(cfg, role)
        placed = [(o.role, node, o.held) for o in others for node in o.node_ids()[:1]]
        node = choose_node(demand, cluster_nodes(), placed)
        pg = placement_group_for(demand, node, name)
        if (why := _wait_placed(pg, node)) is not None:
            remove_placement_group(pg)
            where = f"node {node[:8]}" if node else "any node"
            raise RuntimeError(f"{replica}: no room for {demand.ranks} x {demand.bundle} "
                               f"(labels {demand.labels or '{}'}) on {where} {why}")
        custom = dict(getattr(cfg, role).placement.resources)
        # Detached: Ray would otherwise end a replica with the controller that started it; a
        # controller that dies is restarted and takes the running replicas back (controller.py).
        opts = dict(num_cpus=0, num_gpus=getattr(cfg, role).gpus, resources=custom,
                    max_concurrency=WORKER_CONCURRENCY, lifetime="detached")
        held = {k: v * demand.ranks for k, v in demand.bundle.items()}
        inc = Incarnation(role, replica, generation, {}, placement_group=pg, chosen_node=node, held=held)
        in_pg = PlacementGroupSchedulingStrategy(pg, 0)
        if role in ("prefill", "decode") and self.flippable() is None:
            inc.ranks[name] = ray.remote(FlipWorker).options(
                name=name, scheduling_strategy=in_pg, **opts, **self._kv_env()).remote(role, name, self.roles())
            return inc
        if role == "decode":
            return self._start_decode(inc, name, opts)
        if role == "prefill":
            tp = self._start_followers(inc, name, opts, cfg.engine_config("prefill"), cfg.prefill.tp_size)
            inc.ranks[name] = ray.remote(FlipWorker).options(
                name=name, scheduling_strategy=in_pg, **opts, **self._kv_env()).remote(
                role, name, {role: (PrefillWorker, dict(engine_config=cfg.engine_config("prefill"),
                                                        kv_backend=cfg.kv_transfer.backend, cpu_threads=self.cpu_threads,
                                                        cluster_token=self.cluster_token, tp=tp))})
        else:
            tp = self._start_followers(inc, name, opts, cfg.engine_config("colocated"), cfg.colocated.tp_size)
            inc.ranks[name] = ray.remote(FlipWorker).options(name=name, scheduling_strategy=in_pg, **opts).remote(
                role, name, {role: (ColocatedWorker, dict(engine_config=cfg.engine_config("colocated"),
                                                          namespace=NAMESPACE, cpu_threads=self.cpu_threads, tp=tp,
                                                          cluster_token=self.cluster_token))})
        return inc

    def flippable(self) -> str | None:
        """None when this cluster's prefill and decode replicas are one worker each, started as
        FlipWorkers that can change role in place (a flip); else why not."""
        cfg = self.config
        if cfg.prefill.tp_size > 1:
            return f"prefill.tp_size is {cfg.prefill.tp_size}: a flip needs a replica of one worker"
        if cfg.decode.ep_size > 1:
            return f"decode.ep_size is {cfg.decode.ep_size}: a flip needs a replica of one worker"
        if cfg.prefill.gpus != cfg.decode.gpus:
            return (f"prefill.gpus is {cfg.prefill.gpus:g} and decode.gpus {cfg.decode.gpus:g}: a flipped replica "
                    f"keeps its device")
        return None

    def roles(self) -> dict[str, tuple[type, dict]]:
        """What a FlipWorker builds for each role: the role's worker class and its arguments."""
        from pdserve.decode.worker import DecodeWorker
        from pdserve.prefill.worker import PrefillWorker

        cfg, common = self.config, dict(kv_backend=self.config.kv_transfer.backend, cpu_threads=self.cpu_threads,
                                        cluster_token=self.cluster_token)
        return {"prefill": (PrefillWorker, dict(engine_config=cfg.engine_config("prefill"), **common)),
                "decode": (DecodeWorker, dict(engine_config=cfg.engine_config("decode"), lease_s=cfg.kv_transfer.lease_s,
                                              namespace=NAMESPACE, **common))}

    def _start_followers(self, inc: Incarnation, name: str, opts: dict, engine_config, tp_size: int):
        """A tensor-parallel replica's ranks 1 .. tp_size-1, in bundles 1 .. of its placement group,
        and rank 0's TPRank (None for tp_size 1). The rendezvous store is served from here, held
        for the group's life, as an expert-parallel group's."""
        if tp_size == 1:
            return None
        from pdserve.worker.rendezvous import new_group_id, rendezvous_store
        from pdserve.worker.tp_follower import TPFollower
        from pdserve.worker.tp_group import TPRank

        inc.store = store = rendezvous_store()
        group = dict(group_id=new_group_id(), token=self.cluster_token)
        for r in range(1, tp_size):
            follower = f"{name}-tp{r}"
            inc.followers[follower] = ray.remote(TPFollower).options(
                name=follower, scheduling_strategy=PlacementGroupSchedulingStrategy(inc.placement_group, r),
                **opts).remote(follower, engine_config, TPRank(r, tp_size, store.host, store.port, **group),
                               self.cpu_threads)
        return TPRank(0, tp_size, store.host, store.port, **group)

    def _kv_env(self) -> dict:
        """Actor options for a KV worker. cuda_ipc opens the peer's GPU memory in the prefill worker,
        which must therefore see that GPU: Ray is told to leave CUDA_VISIBLE_DEVICES alone, and the
        worker takes the GPU Ray assigned it by index (EngineWorker). `auto` may pick cuda_ipc for a pair."""
        if self.config.kv_transfer.backend not in ("cuda_ipc", "auto"):
            return {}
        if self.config.kv_transfer.backend == "auto" and not (self.config.prefill.gpus and self.config.decode.gpus):
            return {}
        from pdserve.worker.engine_worker import ALL_GPUS_VISIBLE

        return {"runtime_env": {"env_vars": {ALL_GPUS_VISIBLE: "1"}}}

    def _start_decode(self, inc: Incarnation, name: str, opts: dict) -> Incarnation:
        """One decode replica: its worker, or the ranks of its expert-parallel group."""
        from pdserve.decode.ep_group import EPRank
        from pdserve.worker.rendezvous import new_group_id, rendezvous_store
        from pdserve.decode.worker import DecodeWorker

        from pdserve.worker.flip import FlipWorker

        cfg, d = self.config, self.config.decode
        kw = dict(engine_config=cfg.engine_config("decode"), kv_backend=cfg.kv_transfer.backend,
                  lease_s=cfg.kv_transfer.lease_s, namespace=NAMESPACE, cpu_threads=self.cpu_threads,
                  cluster_token=self.cluster_token)
        opts = dict(opts, **self._kv_env())
        if d.ep_size == 1:
            inc.ranks[name] = ray.remote(FlipWorker).options(
                name=name, scheduling_strategy=PlacementGroupSchedulingStrategy(inc.placement_group, 0), **opts
            ).remote("decode", name, {"decode": (DecodeWorker, kw)})
            return inc
        # The rendezvous is a store served from here (loopback on one node, else this node's IP; a
        # port bound now and never let go), held for the group's life; every rank joins it as a
        # client and proves the cluster's token to the others (pdserve/worker/rendezvous.py).
        inc.store = store = rendezvous_store()
        group_id = new_group_id()
        for r in range(d.ep_size):
            rank = EPRank(r, d.ep_size, store.host, store.port, d.ep_threshold, list(d.ep_replicated_experts),
                          group_id, self.cluster_token)
            inc.ranks[f"{name}-rank{r}"] = ray.remote(FlipWorker).options(
                name=f"{name}-rank{r}", scheduling_strategy=PlacementGroupSchedulingStrategy(inc.placement_group, r),
                **opts).remote("decode", f"{name}-rank{r}", {"decode": (DecodeWorker, dict(kw, ep=rank))})
        return inc

    @staticmethod
    def stop(inc: Incarnation) -> None:
        """Kill the incarnation's workers (what they held is gone) and free their placement."""
        for h in [*inc.ranks.values(), *inc.followers.values()]:
            try:
                ray.kill(h, no_restart=True)
            except Exception:  # already gone
                pass
        if inc.placement_group is not None:
            try:
                remove_placement_group(inc.placement_group)
            except Exception:  # removed already
                pass
        inc.store = None  # closes the rendezvous port
