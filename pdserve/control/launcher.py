"""Starting and stopping one replica's workers: a prefill, colocated or decode worker, or the ranks
of an expert-parallel decode replica (a placement group, one bundle per rank, and the group's
rendezvous store, held here for the group's life).

Each incarnation of a replica has workers of its own names (`pdserve-decode-0`, then
`pdserve-decode-0@1`, ...): a replacement never shares a name with the worker it replaces, so a
KV peer, a router's handle or a worker's list of dead routers can never mistake one for the other.
"""

from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.config import ClusterConfig
from pdserve.messages import ReplicaChange

# Threads of a worker actor. Calls that bring work return at once; a reservation waits for the next
# step boundary, so a burst of them holds a thread each until then: many, not the 8 that capped
# hand-offs at 8 per step.
WORKER_CONCURRENCY = 256
NAMESPACE = "pdserve"


@dataclass
class Incarnation:
    """One replica's workers as started once."""

    role: str
    replica: str
    generation: int  # 0 for the first start, +1 for each replacement
    ranks: dict[str, ray.actor.ActorHandle]  # worker (actor) name -> handle
    placement_group: object = None
    store: object = None  # an expert-parallel group's rendezvous TCPStore
    restarts: int = 0
    state: str = "serving"  # as the routers were last told (ReplicaChange.state)

    def change(self) -> ReplicaChange:
        return ReplicaChange(self.role, self.replica, dict(self.ranks), self.state, self.restarts)


def worker_name(replica: str, generation: int) -> str:
    return replica if generation == 0 else f"{replica}@{generation}"


class Launcher:
    def __init__(self, config: ClusterConfig, cpu_threads: int):
        self.config = config
        self.cpu_threads = cpu_threads

    def start(self, role: str, replica: str, generation: int) -> Incarnation:
        """Create the replica's worker actors (not yet ready: `wait_ready`)."""
        from pdserve.prefill.worker import PrefillWorker
        from pdserve.worker.colocated import ColocatedWorker

        cfg, name = self.config, worker_name(replica, generation)
        if role == "decode":
            return self._start_decode(replica, generation)
        if role == "prefill":
            handle = ray.remote(PrefillWorker).options(
                name=name, num_cpus=0, num_gpus=cfg.prefill.gpus, max_concurrency=WORKER_CONCURRENCY,
                **self._kv_env()).remote(name, cfg.engine_config("prefill"), cfg.kv_transfer.backend,
                                         self.cpu_threads)
        else:
            handle = ray.remote(ColocatedWorker).options(
                name=name, num_cpus=0, num_gpus=cfg.colocated.gpus, max_concurrency=WORKER_CONCURRENCY).remote(
                name, cfg.engine_config("colocated"), NAMESPACE, self.cpu_threads)
        return Incarnation(role, replica, generation, {name: handle})

    def _kv_env(self) -> dict:
        """Actor options for a KV worker. cuda_ipc opens the peer's GPU memory in the prefill worker,
        which must therefore see that GPU: Ray is told to leave CUDA_VISIBLE_DEVICES alone, and the
        worker takes the GPU Ray assigned it by index (Replica)."""
        if self.config.kv_transfer.backend != "cuda_ipc":
            return {}
        from pdserve.worker.replica import ALL_GPUS_VISIBLE

        return {"runtime_env": {"env_vars": {ALL_GPUS_VISIBLE: "1"}}}

    def _start_decode(self, replica: str, generation: int) -> Incarnation:
        """One decode replica: its worker, or the ranks of its expert-parallel group."""
        from pdserve.decode.ep_group import EPRank, rendezvous_store
        from pdserve.decode.worker import DecodeWorker

        cfg, d = self.config, self.config.decode
        name = worker_name(replica, generation)
        args = (cfg.engine_config("decode"), cfg.kv_transfer.backend, cfg.kv_transfer.lease_s, NAMESPACE,
                self.cpu_threads)
        opts = dict(num_cpus=0, num_gpus=d.gpus, max_concurrency=WORKER_CONCURRENCY, **self._kv_env())
        if d.ep_size == 1:
            return Incarnation("decode", replica, generation,
                               {name: ray.remote(DecodeWorker).options(name=name, **opts).remote(name, *args)})
        # One node, one bundle per rank. A bundle may not be empty: on CPU it holds a sliver of a core.
        bundle = {"CPU": 0.001, **({"GPU": d.gpus} if d.gpus else {})}
        pg = placement_group([bundle] * d.ep_size, strategy="STRICT_PACK", name=name)
        if not pg.wait(timeout_seconds=120):
            remove_placement_group(pg)
            raise RuntimeError(f"{replica}: decode.ep_size {d.ep_size} needs {d.ep_size} x {bundle} on one node; "
                               f"the Ray cluster could not place them")
        # The rendezvous is a store served from here (this node's IP, a port bound now and never let
        # go), held for the group's life; every rank, wherever it runs, joins it as a client.
        store = rendezvous_store()
        ranks = {}
        for r in range(d.ep_size):
            rank = EPRank(r, d.ep_size, store.host, store.port, d.ep_threshold, list(d.ep_replicated_experts))
            ranks[f"{name}-rank{r}"] = ray.remote(DecodeWorker).options(
                name=f"{name}-rank{r}", scheduling_strategy=PlacementGroupSchedulingStrategy(pg, r), **opts
            ).remote(f"{name}-rank{r}", *args, ep=rank)
        return Incarnation("decode", replica, generation, ranks, placement_group=pg, store=store)

    @staticmethod
    def stop(inc: Incarnation) -> None:
        """Kill the incarnation's workers (what they held is gone) and free their placement."""
        for h in inc.ranks.values():
            try:
                ray.kill(h, no_restart=True)
            except Exception:  # already gone
                pass
        if inc.placement_group is not None:
            remove_placement_group(inc.placement_group)
        inc.store = None  # closes the rendezvous port
