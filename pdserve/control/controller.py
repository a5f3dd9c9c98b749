"""The controller: a named, detached Ray actor that owns the cluster's desired state and every
replica's life.

It starts the replicas and the routers (router.replicas of them, sharing one port), introduces
every prefill replica to every decode rank (the KV handshake), and then watches them all
(`health.py`): a replica or router that died, whose engine loop stopped or that stopped answering
is replaced by a fresh incarnation (new workers, new KV handshakes with its peers), and the routers
are told (`ReplicaChange`). `scale` starts replicas or drains them (no new work; they finish what
they hold, then stop); `shutdown(grace)` drains the routers first. A decode replica is one
DecodeWorker, or with `decode.ep_size` N > 1 an expert-parallel group of N (one dead rank takes
its group down with it: the group is replaced whole). A colocated cluster has ColocatedWorkers
only, and no handshake: no KV moves between them. A mixed cluster has all three; its colocated
replicas take no part in KV pairing.

Four of its parts are files of their own, mixed into the one actor class (Ray calls every method
on it, whichever file holds it): the KV handshake (handshake.py), scaling and draining
(scaling.py), a replica's flip between prefill and decode (flipping.py), and taking the cluster
back after Ray restarted the actor (recovery.py).
"""

import os
import threading
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pdserve.actors import NAMESPACE
from pdserve.config import ClusterConfig
from pdserve.control.flipping import Flipping
from pdserve.control.handshake import Handshake
from pdserve.control.health import PROBE_INTERVAL_S, Heartbeats
from pdserve.control.launcher import Incarnation, Launcher, worker_name
from pdserve.control.kv_pairs import PairBook
from pdserve.control.load import LoadWindow
from pdserve.control.planner import Limits, Measured
from pdserve.control.recovery import Recovery, _cause, restarted
from pdserve.control.scaling import DRAIN_POLL_S, Scaling
from pdserve.messages import ReplicaChange, ReplicaStats

ROUTER_START_S = 120  # a router binds its ports and loads the tokenizer: seconds, never minutes
REPLICA_START_S = 900  # loading a model onto a GPU: minutes at most
TELL_S = 10  # a router takes a ReplicaChange at once; one that does not is dead or hung (the watch sees it)
RETRY_S = (2.0, 60.0)  # a replacement that failed to start is tried again after this, doubling to the max

__all__ = ["Controller"]


class Controller(Recovery, Handshake, Scaling, Flipping):
    def __init__(self, config: ClusterConfig, cluster_token: str | None = None, api_keys: list | None = None):
        """api_keys: the routers' API keys (router/tenants.py ApiKey: names, hashes, limits); none: open."""
        self.config = config
        self.api_keys = api_keys or []
        self.state = "starting"
        self.progress: list[str] = []
        self.endpoints: dict[str, str] = {}
        self.replicas: dict[str, Incarnation] = {}  # replica name -> its live incarnation
        self.routers: dict[str, dict] = {}  # router slot (pdserve-router-i) -> {generation, name, handle, ends}
        self._spawned: dict[str, object] = {}  # router slot -> its actor, made while the workers load, not started
        self._restarting: dict[str, str] = {}  # replica or router -> why it is being replaced
        self._retry_at: dict[str, tuple[float, float]] = {}  # -> (when to try again, backoff)
        self._life = threading.RLock()  # one change of the replica set at a time (watch, scale, shutdown)
        self._scaling = threading.RLock()  # one scale or flip at a time (their waits hold no _life)
        self._beats = Heartbeats()
        self._watching = threading.Event()
        self._load = LoadWindow()  # the heartbeats' answers, for the planner (`pdserve tune`)
        cfg = config
        n = cfg.prefill.replicas + cfg.decode.replicas * cfg.decode.ep_size + cfg.colocated.replicas  # processes
        self.launcher = Launcher(config, max(1, (os.cpu_count() or 1) // max(1, n)), cluster_token)
        # The KV pairs: each handshake's record (the backend the pair chose, and why), failed ones.
        self.pairs = PairBook()
        self._metas: dict[str, bytes] = {}  # worker -> its KV handshake metadata, as packed for the pairing under way
        self._ports: dict[str, int] = {}
        if restarted():  # Ray restarted this actor (its process died): the cluster runs on without it
            self._recover()

    # -- starting --------------------------------------------------------------------------------

    def start(self) -> dict[str, str]:
        """Start replicas and routers; returns the endpoints once every replica is ready."""
        cfg = self.config
        wanted = [("prefill", i) for i in range(cfg.prefill.replicas)] + \
                 [("decode", i) for i in range(cfg.decode.replicas)] + \
                 [("colocated", i) for i in range(cfg.colocated.replicas)]
        incs = []
        t0, launched = time.monotonic(), time.time()
        for role, i in wanted:  # in the set at once: a start that fails midway still stops them all
            incs.append(self.launcher.start(role, f"pdserve-{role}-{i}", 0, list(self.replicas.values())))
            self.replicas[incs[-1].replica] = incs[-1]
        n = sum(len(inc.ranks) + len(inc.followers) for inc in incs)
        self._note(f"loading {cfg.model.path} on {n} workers")
        # The routers' processes start (Ray's worker, their imports: seconds) while the workers load.
        self._spawned = {slot: self._spawn_router(slot, 0) for slot in self._router_slots()}
        self._wait_ready(incs, show=True, launched=launched)
        self._note(f"workers ready in {time.monotonic() - t0:.2f} s")
        if cfg.prefill.replicas:
            t0 = time.monotonic()
            self._handshake([i for i in incs if i.role != "colocated"])
            used = sorted({r["backend"] for r in self.pairs.records.values()})
            self._note(f"KV handshake done ({cfg.kv_transfer.backend}: {', '.join(used)}) "
                       f"in {time.monotonic() - t0:.2f} s")
        t0 = time.monotonic()
        self._start_routers()
        self._note(f"routers ready in {time.monotonic() - t0:.2f} s")
        self.state = "running"
        self._watching.set()
        threading.Thread(target=self._watch, name="pdserve-watch", daemon=True).start()
        return self.endpoints

    def _wait_ready(self, incs: list[Incarnation], show: bool = False, launched: float = 0.0) -> None:
        """Until every worker of `incs` is ready; raises the first one's own error (bad model, out of
        memory), or after REPLICA_START_S. `show`: a line per worker with what its start took
        (since `launched`, a time.time())."""
        # A tensor-parallel replica's followers too: each rank loads its own slice of the weights.
        handles = {name: w for inc in incs for name, w in [*inc.ranks.items(), *inc.followers.items()]}
        pending = {w.ready.remote(): name for name, w in handles.items()}
        total, deadline = len(pending), time.monotonic() + REPLICA_START_S
        while pending:
            if self.state in ("stopping", "stopped"):
                raise RuntimeError("the cluster is stopping")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{', '.join(pending.values())} not ready within {REPLICA_START_S} s")
            done, _ = ray.wait(list(pending), timeout=1.0)
            for ref in done:
                name = pending.pop(ref)
                ray.get(ref)
                if show:
                    self._note(f"{name} ready ({total - len(pending)}/{total}) in {time.time() - launched:.2f} s"
                               f"{_took(handles[name], launched)}")
        for inc in incs:  # where each worker landed (status shows it; placement counts it)
            inc.nodes = dict(zip(inc.ranks, ray.get([w.node.remote() for w in inc.ranks.values()], timeout=60)))
            if show:
                self._note(f"{inc.replica} on node {_where(inc)}")

    def _router_slots(self) -> list[str]:
        return [f"pdserve-router-{i}" for i in range(self.config.router.replicas)]

    def _start_routers(self) -> None:
        """router.replicas routers on this node, serving one HTTP and one gRPC port. The first
        claims the configured ports (0: any), the others bind the ports it got (SO_REUSEPORT)."""
        slots = self._router_slots()
        first = self._start_router(slots[0], 0, self._spawned.pop(slots[0], None))
        self._ports = {k: int(first[k].rsplit(":", 1)[1]) for k in ("http", "grpc") if k in first}
        for slot in slots[1:]:
            self._start_router(slot, 0, self._spawned.pop(slot, None))
        self.endpoints = {k: v for k, v in first.items() if k != "own"}
        self._note("router listening: " + ", ".join(f"{k} {v}" for k, v in self.endpoints.items()))
        if len(slots) > 1:
            for slot in slots:
                r = self.routers[slot]
                self._note(f"{r['name']}: own http {r['ends']['own']} (its /metrics and /health)")

    def _spawn_router(self, slot: str, generation: int):
        """A router's actor (on this node: processes share a port only on one host, and `pdserve
        up` checked the ports free here), not yet serving: `_start_router` starts it."""
        from pdserve.router.server import Router

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        cfg = self.config
        # (No preload: every worker's actor is a torch-free FlipWorker, launcher.WORKER_MODULES.)
        return ray.remote(Router).options(name=worker_name(slot, generation), num_cpus=0, lifetime="detached",
                                          scheduling_strategy=here).remote(
            worker_name(slot, generation), cfg, [], NAMESPACE, self.api_keys, cluster_token=self.launcher.cluster_token)

    def _start_router(self, slot: str, generation: int, handle=None) -> dict[str, str]:
        """Start one router (spawned now, or `handle`, spawned before) with every replica as it is
        now; returns its endpoints."""
        shared = self.config.router.replicas > 1
        name = worker_name(slot, generation)
        handle = handle or self._spawn_router(slot, generation)
        replicas = [inc.change() for inc in self.replicas.values()]
        try:
            ends = ray.get(handle.start.remote(shared, self._ports.get("http"), self._ports.get("grpc"), replicas),
                           timeout=ROUTER_START_S)
        except ray.exceptions.GetTimeoutError:
            ray.kill(handle)
            raise RuntimeError(f"{name} did not listen within {ROUTER_START_S} s; its log (Ray's session "
                               f"logs, worker-*.err) says why") from None
        self.routers[slot] = {"generation": generation, "name": name, "handle": handle, "ends": ends}
        if self.pairs.failures:
            handle.pairing_failures.remote(dict(self.pairs.failures))  # (its /metrics counts from here)
        return ends

    # -- watching and replacing ------------------------------------------------------------------

    def _watch(self) -> None:
        """Heartbeats to every worker and router; the dead are replaced."""
        while self._watching.is_set():
            t0 = time.monotonic()
            with self._life:
                targets = {r: [w.stats.remote() for w in inc.ranks.values()] for r, inc in self.replicas.items()}
                targets |= {slot: [r["handle"].info.remote()] for slot, r in self.routers.items()}
            answers, dead = self._beats.probe(targets)
            self._load.add(time.monotonic(), {n: a for n, a in answers.items() if n in self.replicas},
                           {n: a[0] for n, a in answers.items() if n in self.routers})
            for name, why in dead.items():
                self._restarting.setdefault(name, why)
            now = time.monotonic()
            due = {n: why for n, why in list(self._restarting.items()) if now >= self._retry_at.get(n, (0.0, 0.0))[0]}
            for name in [n for n in due if n in self.routers]:
                if not self._watching.is_set():
                    return
                self._replace_router(name, due.pop(name))
            self._replace_replicas(due)
            with self._life:
                if self._watching.is_set():
                    self._repair()
            time.sleep(max(0.0, PROBE_INTERVAL_S - (time.monotonic() - t0)))

    def _replace_router(self, slot: str, why: str) -> None:
        """A fresh incarnation of a dead router; on failure, tried again later."""
        with self._life:
            if not self._watching.is_set():
                return
            try:
                self._restart_router(slot, why)
            except Exception as e:
                self._retry_later(slot, e)
                return
            self._replaced(slot)

    def _replace_replicas(self, due: dict[str, str]) -> None:
        """Fresh incarnations of the dead replicas `due` (-> why), started together and each put to
        serve once it is ready and paired: a node's death takes every replica there, and one started
        only after the one before it served came back a whole start later (a decode replica 13 s after
        its node's prefill replica, on a loaded 2-core host). A start that fails is tried again later."""
        if not due:
            return
        with self._life:
            if not self._watching.is_set():
                return
            launched: dict[str, Incarnation] = {}
            for replica, why in due.items():
                old = self.replicas.get(replica)
                if old is None:  # removed meanwhile (a scale-down): nothing to replace
                    self._replaced(replica)
                    continue
                if old.state == "draining":  # it was leaving anyway: what it held migrates (the routers' job)
                    self._note(f"{replica} ({why}) was draining: removed")
                    self._remove(old)
                    self._replaced(replica)
                    continue
                self._note(f"{replica} is down ({why}); starting a replacement")
                Launcher.stop(old)
                self._forget_pairs(old)
                # Placed beside the live replicas and the replacements started before it here.
                others = [i for i in self.replicas.values() if i.replica not in due] + list(launched.values())
                try:
                    new = self.launcher.start(old.role, replica, old.generation + 1, others)
                except Exception as e:
                    self._retry_later(replica, e)
                    continue
                new.restarts = old.restarts + 1
                launched[replica] = new
            for replica, new in launched.items():  # (starting together: the first wait covers the others')
                try:
                    self._wait_ready([new])
                    if new.role != "colocated":  # (with the live and the replacements serving already)
                        self._handshake([new])
                except Exception as e:
                    Launcher.stop(new)
                    self._retry_later(replica, e)
                    continue
                self.replicas[replica] = new
                self._tell(new.change())
                self._note(f"{replica} replaced ({', '.join(new.ranks)}); serving again")
                self._replaced(replica)

    def _retry_later(self, name: str, e: Exception) -> None:
        """A replacement failed: the watch tries again after a backoff that doubles each time."""
        _, backoff = self._retry_at.get(name, (0.0, RETRY_S[0] / 2))
        backoff = min(RETRY_S[1], backoff * 2)
        self._retry_at[name] = (time.monotonic() + backoff, backoff)
        self._note(f"{name}: its replacement failed ({_cause(e)}); trying again in {backoff:.0f} s")

    def _replaced(self, name: str) -> None:
        self._restarting.pop(name, None)
        self._retry_at.pop(name, None)
        self._beats.forget(name)

    def _restart_router(self, slot: str, why: str) -> None:
        old = self.routers[slot]
        self._note(f"{old['name']} is down ({why}); starting a replacement")
        try:
            ray.kill(old["handle"], no_restart=True)
        except Exception:
            pass
        ends = self._start_router(slot, old["generation"] + 1)
        self.routers[slot]["restarts"] = old.get("restarts", 0) + 1
        restarts = {s: r.get("restarts", 0) for s, r in self.routers.items()}  # for every router's /metrics
        refs = [r["handle"].routers_restarted.remote(restarts) for r in self.routers.values()]
        ray.wait(refs, num_returns=len(refs), timeout=TELL_S)
        own = f" (own http {ends['own']})" if "own" in ends else ""
        self._note(f"{self.routers[slot]['name']} replaced{own}; serving again")

    def _tell(self, change: ReplicaChange) -> None:
        """Every router applies the change (a dead one is the watch's: its replacement starts from
        the replica set as it is)."""
        refs = [r["handle"].apply.remote(change) for r in self.routers.values()]
        ray.wait(refs, num_returns=len(refs), timeout=TELL_S)

    def _tell_pairing(self) -> None:
        """Every router's /metrics counts the failed pairings (not awaited past TELL_S)."""
        refs = [r["handle"].pairing_failures.remote(dict(self.pairs.failures)) for r in self.routers.values()]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=TELL_S)

    # -- status and shutdown ---------------------------------------------------------------------

    def status(self) -> dict:
        """state ("starting", "running", "degraded": some replica or router is down, "draining",
        "stopping", "stopped"), progress lines, endpoints, each replica's stats or why it is down
        ("down: ..."), each router's info, restarts per replica and router, and the config's slo
        targets (ttft_ms, tpot_ms: what `pdserve status --watch` shows the latencies against)."""
        from pdserve.actors import down_reason

        replicas: dict[str, ReplicaStats | str] = {}
        restarts: dict[str, int] = {}
        for name, inc in list(self.replicas.items()):
            restarts[name] = inc.restarts
            if name in self._restarting:
                replicas[name] = f"down: {self._restarting[name]}; a replacement is starting"
                continue
            try:
                parts = ray.get([w.stats.remote() for w in inc.ranks.values()], timeout=5)
                s = parts[0] if len(parts) == 1 else ReplicaStats.combine(name, parts)
                replicas[name] = "draining" if inc.state == "draining" else s
            except Exception as e:
                replicas[name] = f"down: {down_reason(e) or 'no answer in 5 s'}"
        routers: dict[str, dict | str] = {}
        for slot, r in list(self.routers.items()):  # by slot, as replicas by replica: the same in every incarnation
            restarts[slot] = r.get("restarts", 0)
            if slot in self._restarting:
                routers[slot] = f"down: {self._restarting[slot]}; a replacement is starting"
                continue
            try:
                routers[slot] = ray.get(r["handle"].info.remote(), timeout=5)
            except Exception as e:
                routers[slot] = f"down: {down_reason(e) or 'no answer in 5 s'}"
        state = self.state
        if state == "running" and any(isinstance(r, str) and r.startswith("down")
                                      for r in [*replicas.values(), *routers.values()]):
            state = "degraded"
        live = {w for inc in list(self.replicas.values()) for w in inc.ranks}
        pairs = self.pairs.status(live)
        return {"state": state, "progress": list(self.progress), "endpoints": self.endpoints, "pid": os.getpid(),
                "replicas": replicas, "routers": routers, "restarts": restarts,
                "slo": self.config.slo.model_dump(),
                # Where each replica's workers run, and what each KV pair moves over (and why).
                "nodes": {name: {w: dict(n) for w, n in inc.nodes.items()} for name, inc in list(self.replicas.items())},
                "kv_pairs": pairs,
                "flips": {name: inc.flipped for name, inc in list(self.replicas.items()) if inc.flipped}}

    def load(self, window_s: float) -> Measured:
        """What the cluster measured (load.py): traffic over the last window_s, step costs over
        everything kept; the budget is the GPUs the cluster has (on CPU: the workers running now)."""
        cfg = self.config
        serving = [inc for inc in self.replicas.values() if inc.state == "serving"]
        replicas = {role: sum(1 for inc in serving if inc.role == role) for role in ("prefill", "decode", "colocated")}
        on_gpus = bool(cfg.prefill.gpus or cfg.decode.gpus or cfg.colocated.gpus)
        ep = cfg.decode.ep_size
        budget = int(ray.cluster_resources().get("GPU", 0)) if on_gpus else \
            replicas["prefill"] + replicas["decode"] * ep + replicas["colocated"]
        limits = Limits(cfg.prefill.max_batch_tokens, cfg.prefill.chunk_size, cfg.decode.max_num_seqs,
                        self._load.decode_kv_blocks(), cfg.kv_transfer.block_size, ep)
        m = self._load.measured(window_s, limits, cfg.slo.model_dump(), replicas, "cuda" if on_gpus else "cpu")
        m.budget, m.unit = budget, "GPU" if on_gpus else "worker"
        return m

    def shutdown(self, grace_s: float = 0.0) -> None:
        """Stop everything. With grace_s: the routers first take no new requests (503, /health 503)
        and the requests in flight finish, for at most grace_s."""
        self._watching.clear()
        if grace_s <= 0:
            self.state = "stopping"  # a replacement or scale-up waiting for a model gives up now
        with self._life:
            if grace_s > 0 and self.routers:
                self.state = "draining"
                self._note(f"draining: no new requests; waiting up to {grace_s:g} s for those in flight")
                handles = [r["handle"] for r in self.routers.values()]
                ray.wait([h.drain.remote() for h in handles], num_returns=len(handles), timeout=TELL_S)
                deadline = time.monotonic() + grace_s
                while time.monotonic() < deadline:
                    try:
                        if not any(i["in_flight"] for i in ray.get([h.info.remote() for h in handles], timeout=5)):
                            break
                    except Exception:  # a dead router streams nothing; ask the rest again
                        handles = [h for h in handles if _alive(h)]
                    time.sleep(DRAIN_POLL_S)
            self.state = "stopping"
            stops = [r["handle"].stop.remote() for r in self.routers.values()]
            ray.wait(stops, num_returns=len(stops), timeout=10)  # a dead router's fails at once; killed below
            for handle in [r["handle"] for r in self.routers.values()] + list(self._spawned.values()):
                ray.kill(handle)  # (and a router spawned for a start that failed before it served)
            for inc in self.replicas.values():
                Launcher.stop(inc)
            self.state = "stopped"

    def note(self, replica: str, line: str) -> None:
        """A line of a replica's own progress while it starts (its warm-up), into `pdserve up`'s."""
        self._note(f"{replica}: {line}")

    def _note(self, line: str) -> None:
        self.progress.append(f"{time.strftime('%H:%M:%S')} {line}")


def _took(worker, launched: float) -> str:
    """What a ready worker's start took (WorkerStartup), as a progress line's tail."""
    try:
        s = ray.get(worker.startup.remote(), timeout=10)
    except Exception:  # (a line of progress is not worth failing a start over)
        return ""
    return f": process up in {s.began - launched:.2f} s, {s.describe()}"


def _where(inc: Incarnation) -> str:
    nodes = {(n["ip"], n["node_id"][:8]) for n in inc.nodes.values()}
    return ", ".join(f"{ip} ({nid})" for ip, nid in sorted(nodes))


def _alive(handle) -> bool:
    try:
        ray.get(handle.info.remote(), timeout=5)
        return True
    except Exception:
        return False
