"""EngineWorker: what every worker process (prefill, decode, colocated) shares — one engine in a role, its KV
connector, its loop, its stats. A replica is one worker, or several (the ranks of an expert-parallel or
tensor-parallel group)."""

import logging
import os
import sys
import time
from collections.abc import Callable

import ray
import torch

from pdserve import heap
from pdserve.channel.worker_end import ChannelServer
from pdserve.kvtransfer import make_connector
from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.kv_events import KVEventLog
from pdserve.engine.warm_up import WarmUp, warm_up
from pdserve.hop_trace import hop
from pdserve.worker.engine_loop import EngineLoop
from pdserve.worker.inbox import Abort, Reserve
from pdserve.priority import back_to, yield_while_starting
from pdserve.messages import KVEvents, NewRequest, Refusal, ReplicaStats, ReserveResult, WorkerStartup
from pdserve.protocol import InvalidRequestError

log = logging.getLogger(__name__)

EARLY_ABORTS = 1024  # aborts remembered for requests not come yet, before old ones are forgotten
EARLY_ABORT_S = 60.0  # a request handed over arrives within seconds of its abort: older ones never will

# Set (by the controller, for cuda_ipc) in a worker's environment: Ray leaves every GPU visible.
ALL_GPUS_VISIBLE = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def assigned_device(device: str) -> str:
    """The worker's device, with its index: torch.cuda.set_device (NCCL's groups, a step on another
    thread) takes no bare "cuda". Ray normally shows a worker only its own GPU (index 0); with every
    GPU visible the worker must pick the one Ray assigned it."""
    if device != "cuda":
        return device
    if os.environ.get(ALL_GPUS_VISIBLE):
        return f"cuda:{int(ray.get_gpu_ids()[0])}"
    return "cuda:0"


def _in_actor() -> bool:
    """Whether this process is a worker's own (a Ray actor), not a test or benchmark holding an engine."""
    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def _progress(replica: str) -> Callable[[str], None]:
    """Where a starting worker's progress lines go: the log, and the controller's progress (what
    `pdserve up` prints) when there is one."""
    controller = None
    if _in_actor():
        from pdserve.actors import CONTROLLER

        try:
            controller = ray.get_actor(CONTROLLER)
        except ValueError:  # a worker started without a controller (a test's, a benchmark's)
            pass

    def say(line: str) -> None:
        log.info("%s: %s", replica, line)
        if controller is not None:
            controller.note.remote(replica, line)  # not awaited: progress, not a step of the start

    return say


class EngineWorker:
    role: str  # "prefill" | "decode" | "colocated", set by the subclass

    def __init__(self, name: str, engine_config: EngineConfig, kv_backend: str | None, cpu_threads: int,
                 ep=None, cluster_token: str | None = None, tp=None, engine: Engine | None = None):
        """`kv_backend` None: no KV connector. A colocated worker does both phases in its own
        engine, so its KV never leaves it; a connector would only register memory and open ports.
        `ep`: an EPExchange when this worker is one rank of an expert-parallel decode replica.
        `cluster_token`: the KV handshake and TCP connections take peers of this cluster only.
        `tp`: a TPRank (rank 0) when this worker leads a tensor-parallel replica: it joins the
        group (the followers, pdserve/worker/tp_follower.py, join it too) and hands each step's
        batch to them.
        `engine`: an engine built already, in another role (a flip, pdserve/worker/flip.py): it
        changes role, keeping its weights and KV cache; only the connector and the role's parts are
        made anew, and nothing is warmed up again."""
        self._began = (time.time(), time.perf_counter())  # for startup(): the process is up, its imports done
        self._flipped = engine is not None
        self._priority = None if self._flipped else yield_while_starting()  # back to it once ready (pdserve/priority.py)
        if engine_config.device == "cpu" and not self._flipped:
            torch.set_num_threads(cpu_threads)  # several workers share the host's cores
        engine_config = engine_config.model_copy(update={"device": assigned_device(engine_config.device)})
        self.name = name
        self.tp_group = None
        if tp is not None:
            from pdserve.worker.tp_group import join_tp_group

            assert tp.rank == 0, "a worker is rank 0 of its tensor-parallel replica; the others are followers"
            self.tp_group = join_tp_group(tp, engine_config.device)  # returns once every rank joined
        if self._flipped:
            assert tp is None and ep is None, "a flip needs a replica of one worker"
            engine.change_role(engine_config)
            self.engine = engine
        else:
            self.engine = Engine(engine_config, ep=ep, tp=self.tp_group.tp if self.tp_group else None)
        kv_cache, layout = self.engine.kv_cache, self.engine.layout
        if self.tp_group is not None:
            self.engine.runner.on_batch = self.tp_group.send
            if kv_backend is not None:  # a prefill replica's KV leaves whole from rank 0 (tp_group.py)
                kv_cache, layout = self.tp_group.stage_kv(self.engine)
        self.connector = None
        if kv_backend is not None:
            # The node's address, not loopback: socket backends listen there (peers may be on other
            # hosts), and the handshake learns from it which pairs share a host.
            self.connector = make_connector(self.role, kv_backend, name, kv_cache, layout,
                                            self.engine.fingerprint, host=ray.util.get_node_ip_address(),
                                            cluster_token=cluster_token)
        self.aborted = 0
        self._ep = ep
        self._cluster_token = cluster_token  # what routers prove over the direct channel
        self.warmed: WarmUp | None = None  # what the warm-up ran, where it ran

    def _start_loop(self) -> None:
        """Called by the role's __init__ once it has built everything; the loop starts serving."""
        self._warm_up()
        # Attached after the warm-up, which fills and empties the cache: routers hear of serving only.
        self.engine.pool.events = KVEventLog(self.engine.pool.cached)
        if _in_actor():  # (a worker built in a test's own process leaves that process's collector be)
            heap.settle()  # the engine, its KV cache and connector are built: no collection walks them (heap.py)
        self._early_aborts: dict[str, float] = {}  # request id -> when its abort came, before the request
        back_to(self._priority)  # every thread the start made; the loop's thread is made after
        self.loop = EngineLoop(self._step, self._receive, f"{self.name}-engine", on_death=self._engine_died)
        # Requests, aborts and deltas to and from routers, off Ray (pdserve/channel/).
        streams = getattr(self, "streams", None)  # (a prefill worker streams to no router)
        self.channel = ChannelServer(self.name, self._cluster_token, self._serve_channel, self._router_gone,
                                     host=ray.util.get_node_ip_address(),
                                     met=streams.router_back if streams is not None else lambda router: None)
        if streams is not None:
            streams.channel = self.channel
        self._ready_s = time.perf_counter() - self._began[1]

    def _warm_up(self) -> None:
        """Every kind of step once, before the loop starts and so before the worker is ready
        (engine/warm_up.py): by default where kernels compile on first use (a GPU). Not for an
        expert-parallel rank, whose steps are agreed with its group's."""
        cfg = self.engine.config
        want = cfg.warm_up if cfg.warm_up is not None else self.engine.device.type == "cuda"
        if want and self._ep is None and not self._flipped:  # a flip serves within seconds: no warm-up
            self.warmed = warm_up(self.engine, _progress(self.name))

    def _receive(self, item) -> None:
        """Take one inbox item. Ray runs a worker's calls on many threads, so a request's abort (its
        client left while the request was being handed over) may reach the inbox before the
        request: it is remembered a while, and the request is dropped when it comes, instead of
        holding KV blocks for a client that is gone."""
        rid = item.request_id
        if isinstance(item, Abort):
            if rid not in self.engine.seqs:
                now = time.monotonic()
                self._early_aborts[rid] = now
                if len(self._early_aborts) > EARLY_ABORTS:  # forget the oldest: their requests never came
                    for old in [r for r, t in self._early_aborts.items() if now - t > EARLY_ABORT_S]:
                        del self._early_aborts[old]
        elif self._early_aborts.pop(rid, None) is not None:
            if isinstance(item, Reserve):
                item.answer.set_result(ReserveResult(None, Refusal("request_id", "aborted before it was taken")))
            return
        self._take(item)

    def _serve_channel(self, kind: str, items: list, router: str) -> list | None:
        """A router's batched call over the direct channel: what the same Ray call would do."""
        match kind:
            case "prefill":
                return self.prefill(items)
            case "reserve":
                return self.reserve(items, router)
            case "generate":
                return self.generate(items, router)
            case "abort":
                self.abort(items)
                return None
        raise ValueError(f"no call {kind!r}")

    def _router_gone(self, router: str) -> None:
        """A router's channel closed (it died, or dropped this worker): its requests here stop, and
        their KV blocks go back to the pool (on the engine loop's thread, as any abort)."""
        if (streams := getattr(self, "streams", None)) is not None:
            streams.router_gone(router)

    def channel_address(self) -> dict:
        """Where routers reach this worker's direct channel (pdserve/channel/worker_end.py)."""
        return self.channel.address(ray.util.get_node_ip_address())

    def _engine_died(self, error: BaseException) -> None:
        """A worker whose engine loop died takes no more work: its process exits, so that every
        caller (routers, the controller) finds it dead at once, and the controller replaces it. (A
        worker built outside a Ray actor, in a test, keeps its process: stats() raises instead.)"""
        if _in_actor():
            sys.stderr.flush()
            os._exit(70)

    def _held(self) -> int:
        """Requests the role holds outside the engine (streams to routers, KV in flight)."""
        return 0

    def leave_role(self) -> Engine:
        """Stop serving in this role (a flip, pdserve/worker/flip.py): the loop stops after its step,
        what the role still holds is cut off (the drain's grace ran out, or work came as it ended:
        the routers move it, as from a lost replica), the connector closes (its ports, its memory
        registration: no KV write lands after this), and the blocks still held go back to the pool.
        Returns the engine, idle, for the role that follows."""
        left = self.loop.stop()
        if self.loop.alive():
            raise RuntimeError(f"{self.name}: the engine loop did not stop within 10 s")
        self._cut_off(left)
        self.channel.close()  # after the cut-off's last deltas: the new role's worker listens anew
        if self.connector is not None:
            self.connector.close()
        for rid in list(self.engine.seqs):  # after the close: a write in flight might still have landed
            self.engine.abort(rid)
        return self.engine

    def _cut_off(self, left: list) -> None:
        """End the role's requests (and the inbox's items `left` untaken) so that their routers move them."""
        raise NotImplementedError

    def _step(self) -> float | None:
        raise NotImplementedError

    def _take(self, item) -> None:
        """Apply one inbox item (pdserve/worker/inbox.py) on the loop's thread."""
        raise NotImplementedError

    def meet_router(self, router: str) -> None:
        """A router that this replica will stream tokens to introduced itself (a decode or colocated
        replica's `streams`: RouterStreams.meet)."""
        self.streams.meet(router)

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests here (their clients left, or they failed elsewhere); returns at once."""
        for rid in request_ids:
            self.loop.submit(Abort(rid))

    def _refusal(self, r: NewRequest) -> Refusal | None:
        """A request this replica can never run (its prompt, with a resumed request's output_ids),
        as the router's 400; checked on the caller's thread, so that a call that brings work can
        answer at once."""
        try:
            self.engine.check_request(r.request)
        except InvalidRequestError as e:
            return Refusal.of(e)
        return None

    def ready(self) -> bool:
        return self.loop.alive()

    def kv_events(self, epoch: str, cursor: int) -> KVEvents:
        """What this replica's prefix cache stored and removed after a router's cursor (or all of it:
        engine/kv_events.py); the router's prefix index follows it."""
        hop("kv_events")
        events = self.engine.pool.events.since(epoch, cursor)
        hop("kv_events_done")
        return events

    def startup(self) -> WorkerStartup:
        """What this worker's start took (weights, graphs, the whole engine), once ready."""
        w = self.engine.load_stats
        return WorkerStartup(self.name, self._began[0], w.source, w.files, w.bytes, w.weights_s, w.total_s,
                             self.engine.graphs_s, self._ready_s, self.warmed.seconds if self.warmed else None)

    def metadata(self) -> bytes:
        """The KV handshake this replica publishes."""
        return self.connector.metadata()

    def add_peer(self, meta: bytes) -> dict:
        """Handshake with a replica of the other role; raises HandshakeError on a mismatch. Returns
        the handshake's record: the peer, the backend the pair moves KV over, and why."""
        with self.loop.lock:  # the loop's step polls the connector, and NIXL's agent is not thread-safe
            peer = self.connector.add_peer(meta)
            return self.connector.pairs[peer]

    def kv_pairs(self) -> dict[str, dict]:
        """This worker's KV handshakes: peer -> its record (what a restarted controller takes back)."""
        return dict(self.connector.pairs) if self.connector is not None else {}

    def node(self) -> dict:
        """Where this worker runs: its Ray node's id and address."""
        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address()}

    def stats(self) -> ReplicaStats:
        hop("stats")
        if not self.loop.alive():  # the router then counts this replica as down (/health 503)
            raise RuntimeError(f"{self.name}: the engine loop stopped: {self.loop.error!r}")
        if self.connector is not None and self.connector.error is not None:  # down too: no KV moves
            raise RuntimeError(f"{self.name}: the KV connector failed: {self.connector.error!r}")
        e = self.engine
        return ReplicaStats(self.name, self.role, len(e.scheduler.running), len(e.scheduler.waiting),
                            e.pool.num_free_blocks, e.pool.num_blocks, self.aborted, pid=os.getpid(),
                            held=len(e.seqs) + self.loop.queued() + self._held(), profile=e.profile.snapshot(),
                            max_num_seqs=e.config.max_num_seqs, reserved=e.num_reserved,
                            kv_peers=sorted(self.connector.peers) if self.connector is not None else [],
                            refusals=self.refusals())

    def refusals(self) -> dict[str, dict[str, int]]:
        """What this worker's internal endpoints refused or dropped so far, by endpoint and why: the
        router channel's connections and frames, the KV notices' seal, the KV backend's own."""
        # Each counter copied whole (dict(), one C call under the GIL): the endpoints' threads count on.
        out = {"router_channel": {**self.channel.refused, **self.channel.dropped}}
        if self.connector is not None:
            out |= {"kv_notices": self.connector.dropped, **self.connector.backend.refusals()}
        return {endpoint: dict(counts) for endpoint, counts in out.items() if counts}
