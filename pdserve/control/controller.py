"""The controller: a named, detached Ray actor that owns the cluster's desired state.

It starts the replicas and the routers (router.replicas of them, sharing one port), introduces
every prefill replica to every decode rank (the KV handshake), reports status, and stops everything on `shutdown`. A decode replica is one
DecodeWorker, or with `decode.ep_size` N > 1 an expert-parallel group of N, placed together in a
placement group (one bundle, i.e. one GPU, per rank). A colocated cluster has ColocatedWorkers
only (one engine doing both phases), and no handshake: no KV moves between them.
"""

import os
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from pdserve.config import ClusterConfig
from pdserve.messages import ReplicaStats

NAMESPACE = "pdserve"
CONTROLLER = "pdserve-controller"
# Threads of a worker actor. Calls that bring work return at once; a reservation waits for the next
# step boundary, so a burst of them holds a thread each until then: many, not the 8 that capped
# hand-offs at 8 per step.
WORKER_CONCURRENCY = 256
ROUTER_START_S = 120  # a router binds its ports and loads the tokenizer: seconds, never minutes


class Controller:
    def __init__(self, config: ClusterConfig):
        self.config = config
        self.state = "starting"
        self.progress: list[str] = []
        self.endpoints: dict[str, str] = {}
        self.prefill: dict[str, ray.actor.ActorHandle] = {}
        self.decode: dict[str, dict[str, ray.actor.ActorHandle]] = {}  # replica -> its ranks
        self.colocated: dict[str, ray.actor.ActorHandle] = {}
        self._placement_groups: list = []
        self._ep_stores: dict = {}  # decode replica -> its expert-parallel group's rendezvous TCPStore, held for its life
        self.routers: dict[str, ray.actor.ActorHandle] = {}  # router.replicas of them, one port

    def start(self) -> dict[str, str]:
        """Start replicas and routers; returns the endpoints once every replica is ready."""
        from pdserve.worker.colocated import ColocatedWorker
        from pdserve.prefill.worker import PrefillWorker

        cfg = self.config
        n = cfg.prefill.replicas + cfg.decode.replicas * cfg.decode.ep_size + cfg.colocated.replicas  # processes
        threads = max(1, (os.cpu_count() or 1) // n)
        for i in range(cfg.prefill.replicas):
            name = f"pdserve-prefill-{i}"
            self.prefill[name] = ray.remote(PrefillWorker).options(
                name=name, num_cpus=0, num_gpus=cfg.prefill.gpus, max_concurrency=WORKER_CONCURRENCY,
                **self._kv_env()).remote(
                name, cfg.engine_config("prefill"), cfg.kv_transfer.backend, threads)
        for i in range(cfg.decode.replicas):
            self.decode[f"pdserve-decode-{i}"] = self._start_decode(f"pdserve-decode-{i}", threads)
        for i in range(cfg.colocated.replicas):
            name = f"pdserve-colocated-{i}"
            self.colocated[name] = ray.remote(ColocatedWorker).options(
                name=name, num_cpus=0, num_gpus=cfg.colocated.gpus, max_concurrency=WORKER_CONCURRENCY).remote(
                name, cfg.engine_config("colocated"), NAMESPACE, threads)
        self._note(f"loading {cfg.model.path} on {n} workers")
        pending = {w.ready.remote(): name for name, w in self._workers().items()}
        while pending:
            done, _ = ray.wait(list(pending), timeout=1.0)
            for ref in done:
                ray.get(ref)  # raises the replica's own error (bad model, out of memory, ...)
                self._note(f"{pending.pop(ref)} ready ({n - len(pending)}/{n})")
        if self.prefill:
            self._handshake()
        self._start_routers()
        self.state = "running"
        return self.endpoints

    def _start_routers(self) -> None:
        """router.replicas routers on this node, serving one HTTP and one gRPC port. The first
        claims the configured ports (0: any), the others bind the ports it got (SO_REUSEPORT)."""
        from pdserve.router.server import Router

        cfg = self.config
        # On this node: processes can share a port only on one host (and `pdserve up` checked
        # the ports free here when it started Ray).
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        names = [f"pdserve-router-{i}" for i in range(cfg.router.replicas)]
        shared = len(names) > 1
        for name in names:
            self.routers[name] = ray.remote(Router).options(name=name, num_cpus=0, scheduling_strategy=here).remote(
                name, cfg, list(self.prefill), {d: list(r) for d, r in self.decode.items()},
                list(self.colocated), NAMESPACE)
        try:
            first = ray.get(self.routers[names[0]].start.remote(shared), timeout=ROUTER_START_S)
            ports = {k: int(first[k].rsplit(":", 1)[1]) for k in ("http", "grpc") if k in first}
            rest = ray.get([self.routers[n].start.remote(shared, ports["http"], ports.get("grpc"))
                            for n in names[1:]], timeout=ROUTER_START_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"a router did not listen within {ROUTER_START_S} s; its log (Ray's session "
                               f"logs, worker-*.err) says why") from None
        self.endpoints = {k: v for k, v in first.items() if k != "own"}
        self._note("router listening: " + ", ".join(f"{k} {v}" for k, v in self.endpoints.items()))
        if shared:
            for name, ends in zip(names, [first, *rest]):
                self._note(f"{name}: own http {ends['own']} (its /metrics and /health)")

    def _kv_env(self) -> dict:
        """Actor options for a KV worker. cuda_ipc opens the peer's GPU memory in the prefill worker,
        which must therefore see that GPU: Ray is told to leave CUDA_VISIBLE_DEVICES alone, and the
        worker takes the GPU Ray assigned it by index (Replica)."""
        if self.config.kv_transfer.backend != "cuda_ipc":
            return {}
        from pdserve.worker.replica import ALL_GPUS_VISIBLE

        return {"runtime_env": {"env_vars": {ALL_GPUS_VISIBLE: "1"}}}

    def _handshake(self) -> None:
        """Introduce every prefill replica to every decode rank, and back."""
        ranks = self._decode_ranks()
        metas = {name: ray.get(w.metadata.remote()) for name, w in {**self.prefill, **ranks}.items()}
        # Each decode rank has a KV connector of its own: a request's KV goes to the rank owning it.
        for p, pw in self.prefill.items():
            for d, dw in ranks.items():
                ray.get([pw.add_peer.remote(metas[d]), dw.add_peer.remote(metas[p])])
        self._note(f"KV handshake done ({self.config.kv_transfer.backend})")

    def _start_decode(self, name: str, threads: int) -> dict[str, ray.actor.ActorHandle]:
        """One decode replica: its worker, or the ranks of its expert-parallel group (by name)."""
        from pdserve.decode.ep_group import EPRank, rendezvous_store
        from pdserve.decode.worker import DecodeWorker

        cfg, d = self.config, self.config.decode
        args = (cfg.engine_config("decode"), cfg.kv_transfer.backend, cfg.kv_transfer.lease_s, NAMESPACE, threads)
        opts = dict(num_cpus=0, num_gpus=d.gpus, max_concurrency=WORKER_CONCURRENCY, **self._kv_env())
        if d.ep_size == 1:
            return {name: ray.remote(DecodeWorker).options(name=name, **opts).remote(name, *args)}
        # One node, one bundle per rank. A bundle may not be empty: on CPU it holds a sliver of a core.
        bundle = {"CPU": 0.001, **({"GPU": d.gpus} if d.gpus else {})}
        pg = placement_group([bundle] * d.ep_size, strategy="STRICT_PACK", name=name)
        self._placement_groups.append(pg)
        if not pg.wait(timeout_seconds=120):
            raise RuntimeError(f"{name}: decode.ep_size {d.ep_size} needs {d.ep_size} x {bundle} on one node; "
                               f"the Ray cluster could not place them")
        # The rendezvous is a store served from here (this node's IP, a port bound now and never let
        # go), held for the group's life; every rank, wherever it runs, joins it as a client.
        store = rendezvous_store()
        self._ep_stores[name] = store
        ranks = {}
        for r in range(d.ep_size):
            rank = EPRank(r, d.ep_size, store.host, store.port, d.ep_threshold, list(d.ep_replicated_experts))
            ranks[f"{name}-rank{r}"] = ray.remote(DecodeWorker).options(
                name=f"{name}-rank{r}", scheduling_strategy=PlacementGroupSchedulingStrategy(pg, r), **opts
            ).remote(f"{name}-rank{r}", *args, ep=rank)
        return ranks

    def _decode_ranks(self) -> dict[str, ray.actor.ActorHandle]:
        return {r: h for ranks in self.decode.values() for r, h in ranks.items()}

    def _workers(self) -> dict[str, ray.actor.ActorHandle]:
        return {**self.prefill, **self._decode_ranks(), **self.colocated}

    def status(self) -> dict:
        """state ("starting", "running", "degraded": some replica is down, "stopping", "stopped"),
        progress lines, endpoints, and each replica's stats or why it is down ("down: ...")."""
        from pdserve.router.replica_health import down_reason

        replicas: dict[str, ReplicaStats | str] = {}
        single = {**self.prefill, **self.colocated}  # replicas of one worker each
        for name, ranks in [*((n, {n: w}) for n, w in single.items()), *self.decode.items()]:
            try:
                parts = ray.get([w.stats.remote() for w in ranks.values()], timeout=5)
                replicas[name] = parts[0] if len(parts) == 1 else ReplicaStats.combine(name, parts)
            except Exception as e:
                replicas[name] = f"down: {down_reason(e) or 'no answer in 5 s'}"
        routers: dict[str, dict | str] = {}
        for name, h in self.routers.items():
            try:
                routers[name] = ray.get(h.info.remote(), timeout=5)
            except Exception as e:
                routers[name] = f"down: {down_reason(e) or 'no answer in 5 s'}"
        state = self.state
        if state == "running" and any(isinstance(r, str) for r in [*replicas.values(), *routers.values()]):
            state = "degraded"
        return {"state": state, "progress": list(self.progress), "endpoints": self.endpoints,
                "replicas": replicas, "routers": routers}

    def shutdown(self) -> None:
        self.state = "stopping"
        stops = [h.stop.remote() for h in self.routers.values()]
        ray.wait(stops, num_returns=len(stops), timeout=10)  # a dead router's fails at once; killed below
        for h in [*self.routers.values(), *self._workers().values()]:
            ray.kill(h)
        for pg in self._placement_groups:
            remove_placement_group(pg)
        self._ep_stores.clear()  # closes the rendezvous ports
        self.state = "stopped"

    def _note(self, line: str) -> None:
        self.progress.append(f"{time.strftime('%H:%M:%S')} {line}")
