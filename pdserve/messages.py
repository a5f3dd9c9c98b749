"""Typed messages between the router and the workers (Ray actor calls; no tensors, no torch: the
router imports them).

Request is what the front ends build and what each attempt hands a worker (NewRequest wraps it
with the role's extras: the KV handle, the prefill worker); Refusal and Unpaired say why a worker
will not take one, ReserveResult answers a reservation; RequestDelta (a NamedTuple: cheap to
unpickle, one per request per step) carries new tokens back; ReplicaStats is a worker's answer to
the stats poll and the heartbeat; ReplicaChange is the controller's word to routers that a
replica started, was replaced, drains or is gone; WorkerStartup says what a worker's start took."""

from dataclasses import dataclass, field
from typing import NamedTuple

from pdserve.protocol import InvalidRequestError, SamplingParams


@dataclass
class Refusal:
    """A worker refused a request that is unacceptable in itself (e.g. too long for its KV cache).
    A return value rather than a raised error: the router answers it with a 400 naming `param`."""

    param: str
    message: str

    @classmethod
    def of(cls, e: InvalidRequestError) -> "Refusal":
        return cls(e.param, str(e).removeprefix(f"{e.param}: "))

    def error(self) -> InvalidRequestError:
        return InvalidRequestError(self.param, self.message)


@dataclass
class Request:
    """A request, as every process that serves it knows it: the router's front ends make it, each
    attempt at serving it hands it to workers (with the attempt's id and the tokens streamed so
    far), a worker's inbox carries it, the engine queues it."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    # Tokens this request generated already elsewhere (a moved request): they follow the prompt,
    # and generation goes on after them.
    output_ids: list[int] = field(default_factory=list)
    priority: int = 0  # lower is admitted, scheduled first and preempted last (vLLM's `priority`)
    session: str | None = None  # a conversation's key (x-session-id, or OpenAI's `user`): the router's routing affinity


@dataclass
class NewRequest:
    """A request handed to a worker, with what its role needs besides. Calls carry lists of them: a
    router sends everything that arrived in one turn of its event loop as one message."""

    request: Request
    handle: bytes | None = None  # to a prefill worker: where its KV goes (a packed kvtransfer.ReserveHandle)
    prefill_id: str = ""  # to a decode worker: the prefill worker that will send the KV


@dataclass
class Unpaired:
    """A worker cannot take a request over a KV pair it has no handshake with (yet): the prefill
    worker that would send the KV, or the decode worker it would go to, is not its peer. Not the
    request's fault and not a dead replica: the router places it over another pair at once."""

    worker: str  # the worker that answered
    peer: str  # the one it is not paired with

    def __str__(self) -> str:
        return f"{self.worker} is not paired with {self.peer}"


@dataclass
class ReserveResult:
    """A decode replica's answer to a reservation: the handle, or why not."""

    handle: bytes | None  # kvtransfer.ReserveHandle, packed; None when the replica is full
    refused: Refusal | None = None
    unpaired: Unpaired | None = None  # this rank has no KV pair with the request's prefill worker


# A RequestDelta's finish_reason when the replica serving the request was lost (its process died, a
# KV transfer from a dead prefill replica never came): the request is not over, the router moves it.
LOST = "lost"
# A RequestDelta's finish_reason when the request's KV transfer failed while both replicas live (the
# prefill end gave up, or the lease ran out): not a lost replica, but the request moves all the same.
# `error` says why.
KV_FAILED = "kv_failed"


class RequestDelta(NamedTuple):
    """New output of one request: one decode step's, or those of the steps a router had not taken
    yet, joined — from a worker to its router, and from the router's core to its front ends. A tuple:
    a router takes thousands a second, and a dataclass cost it several times as much to unpickle (an
    instance dict each, more for its garbage collector to walk)."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | LOST | KV_FAILED
    error: str | None = None  # why it failed, when finish_reason == "error"
    logprobs: list | tuple = ()  # TokenLogprob per token when asked for; () pickles as one byte, builds nothing
    # (Router core -> front end.) The core holds the request's next delta already: a front end may
    # hold this one's output back and write both in one send, one write per wake of a stream, not
    # one per token. Workers leave it False.
    more: bool = False
    stop_reason: int | str | None = None  # on the last delta: the stop token id or stop string that ended it


class KVEvents(NamedTuple):
    """What a replica's prefix cache stored and removed since a router's cursor
    (engine/kv_events.py), or, with `reset`, everything it holds now."""

    epoch: str  # the log's identity: a cursor is only meaningful in the log that gave it
    cursor: int  # the sequence number of the latest event this answer covers
    reset: bool  # replace what you knew of this replica by `events` (all stored)
    events: list[tuple[bool, bytes]]  # (stored?, block hash), oldest first


@dataclass
class ReplicaStats:
    name: str
    role: str
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    aborted: int  # requests aborted on this replica since it started
    # Prefill: (KV bytes, seconds) of the latest deliveries to decode replicas, and how many
    # there have been in all (a reader remembers the count it has seen; nothing is drained).
    transfers: list[tuple[int, float]] = field(default_factory=list)
    transfers_total: int = 0
    # Expert-parallel decode: tokens routed to each expert, summed over MoE layers (since start,
    # and in the latest step); empty when the replica's experts are not sharded.
    expert_tokens: list[int] = field(default_factory=list)
    expert_tokens_step: list[int] = field(default_factory=list)
    ranks: int = 1  # processes of the replica (an expert-parallel group has ep_size)
    pid: int = 0  # the worker's process (rank 0's for an expert-parallel group)
    held: int = 0  # requests the worker holds anything for (queued, running, streaming, KV in flight): 0 = drained
    # What its steps cost by size, its prefix-cache lookups and the tokens it computed
    # (engine/step_profile.py; cumulative).
    profile: dict = field(default_factory=dict)
    # Decode: of the requests whose KV arrived (cumulative), the blocks found in this replica's own
    # prefix cache (their KV did not move) and the KV bytes prefill replicas wrote into the others.
    kv_blocks_reused: int = 0
    kv_bytes_received: int = 0
    # Sequence slots (the engine's max_num_seqs, summed over ranks) and, on a decode replica, those
    # reserved for KV still on its way: what the router's admission control counts room by.
    max_num_seqs: int = 0
    reserved: int = 0
    # The workers of the other KV role this worker has a handshake with (its KV pairs): a router
    # sends a request only over a pair both of whose ends list each other.
    kv_peers: list[str] = field(default_factory=list)
    # What its internal endpoints refused or dropped since it started (pdserve/refusals.py): endpoint
    # (router_channel, kv_notices, kv_tcp, kv_ipc_inbox, kv_nixl) -> reason -> how many.
    refusals: dict[str, dict[str, int]] = field(default_factory=dict)

    @classmethod
    def combine(cls, name: str, ranks: list["ReplicaStats"]) -> "ReplicaStats":
        """One replica's figures from its ranks' (an expert-parallel group): sums."""
        def total(f):
            return sum(getattr(r, f) for r in ranks)

        def per_expert(f):
            return [sum(c) for c in zip(*(getattr(r, f) for r in ranks))]

        refusals: dict[str, dict[str, int]] = {}
        for r in ranks:
            for endpoint, reasons in r.refusals.items():
                into = refusals.setdefault(endpoint, {})
                for reason, n in reasons.items():
                    into[reason] = into.get(reason, 0) + n

        return cls(name, ranks[0].role, total("running"), total("waiting"), total("free_blocks"),
                   total("total_blocks"), total("aborted"), held=total("held"), expert_tokens=per_expert("expert_tokens"),
                   expert_tokens_step=per_expert("expert_tokens_step"), ranks=len(ranks), pid=ranks[0].pid,
                   # The ranks step in lockstep (rank 0's step costs are the group's), each
                   # computing its own requests' tokens.
                   profile={**ranks[0].profile, "tokens_computed": sum(r.profile.get("tokens_computed", 0)
                                                                       for r in ranks)},
                   kv_blocks_reused=total("kv_blocks_reused"),
                   kv_bytes_received=total("kv_bytes_received"),
                   max_num_seqs=total("max_num_seqs"), reserved=total("reserved"),
                   kv_peers=sorted(set.intersection(*(set(r.kv_peers) for r in ranks))),  # peers of every rank
                   refusals=refusals)


@dataclass
class ReplicaChange:
    """The controller tells the routers what a replica is now: `serving` (started, or replaced by
    a fresh incarnation: new workers, new KV handshakes), `draining` (finishes what it holds, takes
    nothing new), `gone` (removed by a scale-down; its workers are stopped next). A router starts
    from the list of every replica's latest change and applies each later one."""

    role: str  # "prefill" | "decode" | "colocated"
    replica: str  # the replica's name, the same in every incarnation (pdserve-decode-0)
    ranks: dict[str, object]  # its workers now: actor name (unique per incarnation) -> actor handle
    state: str = "serving"  # "serving" | "draining" | "gone"
    restarts: int = 0  # incarnations replaced since the cluster started


@dataclass
class WorkerStartup:
    """What one worker's start took, in seconds (its answer to the controller once ready, for
    `pdserve up`'s progress and the cold-start benchmark)."""

    name: str
    began: float  # time.time() as its __init__ began: its process started and imported what it runs
    weights: str  # "safetensors" or "dummy"
    weight_files: int
    weight_bytes: int
    weights_s: float  # reading the weights into the device (drawing them, for dummy)
    model_s: float  # the model built, allocated and loaded (weights_s included)
    graphs_s: float | None  # capturing the CUDA graphs (decode steps, fresh-prompt steps); None where none are captured
    ready_s: float  # from __init__ to ready: the model, KV cache, graphs, KV connector, warm-up
    warm_up_s: float | None = None  # the warm-up's steps (engine/warm_up.py); None where none ran

    def describe(self) -> str:
        gb = self.weight_bytes / 1e9
        source = f"from {self.weight_files} files" if self.weights == "safetensors" else "dummy"
        graphs = "" if self.graphs_s is None else f", CUDA graphs {self.graphs_s:.2f} s"
        warm = "" if self.warm_up_s is None else f", warm-up {self.warm_up_s:.2f} s"
        return (f"weights {gb:.2f} GB {source} in {self.weights_s:.2f} s ({gb / max(self.weights_s, 1e-9):.2f} GB/s), "
                f"model {self.model_s:.2f} s{graphs}{warm}, engine ready in {self.ready_s:.2f} s")
