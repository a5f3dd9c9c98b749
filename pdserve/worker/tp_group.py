"""The ranks of a tensor-parallel replica and what passes between them each step.

Rank 0 is the worker the routers know (colocated or prefill): it schedules, samples and answers.
Before each forward it broadcasts the step's batch (`StepBatch`: token ids, positions, slots, block
tables, lengths); every other rank (pdserve/worker/tp_follower.py) runs the same forward over its
own heads' KV cache, and the layers' all-reduces pair up. Block ids are rank 0's: every rank's
cache has the same blocks, and only rank 0's pool hands them out. The followers skip the logits
(replicated: rank 0 has them whole).

A prefill replica's KV leaves from rank 0 alone, as a single-rank replica's would: rank 0 keeps a
staging cache of every KV head (the layout an unsharded engine has), and after each layer's KV is
written every rank gathers its heads of the step's slots there (`stage_kv`). Its KV connector
registers and posts the staging cache, so a decode replica of any layout (one rank, expert
parallel) pairs with it through the ordinary handshake. MLA's latent cache is whole on every rank:
nothing to gather, rank 0 posts its own.

An idle rank 0 broadcasts an empty step now and then (`KEEPALIVE_S`), so that a follower's wait has
a deadline (`TIMEOUT_S`) and a follower whose rank 0 died exits instead of waiting for ever.

The step's host description crosses as typed bytes (msgpack: `pack_control`), never a pickle: a
rank unpickling what arrives on the group's sockets would run whatever a peer on them sent.

Backends: on the CPU one gloo group carries everything. On GPUs the model's all-reduces (and the
KV gathers) run over NCCL, the default group, which CUDA graphs can capture; the step's host
description (`StepBatch`) goes over a gloo group on the same store, so that a follower waits for it
on the host, never behind kernels. The step's token ids go over the model's group as a tensor:
with overlap scheduling rank 0's ids are still being sampled on its GPU when the step is sent
(model_runner.PENDING), and a device broadcast queues behind that sampling instead of making the
host wait for it.
"""

import dataclasses
import time
from dataclasses import dataclass, field
from datetime import timedelta

import msgpack
import torch
import torch.distributed as dist

from pdserve.forward.forward_batch import ForwardBatch
from pdserve.forward.kv_cache import allocate_kv_cache
from pdserve.models.tensor_parallel import TensorParallel
from pdserve.worker.rendezvous import prove_members

MAX_CONTROL_BYTES = 256 * 1024 * 1024  # one step's host description: a length past it is no rank 0's
KEEPALIVE_S = 1.0  # an idle rank 0 broadcasts an empty step at least this often
TIMEOUT_S = 600.0  # any collective of the group, a follower's wait for the next step included


@dataclass(frozen=True)
class TPRank:
    """Where a rank stands in its replica's group, and the group's rendezvous (a TCPStore)."""

    rank: int
    size: int
    store_host: str
    store_port: int
    group_id: str = ""  # the group's name in its ranks' proofs (rendezvous.new_group_id)
    token: str | None = field(default=None, repr=False)  # the cluster's, proven to the other ranks


# What rank 0 broadcasts to end its followers' loops (a benchmark's or a test's replica; a served
# replica's followers end with their process).
STOP = "stop"


@dataclass
class StepBatch:
    """What a follower needs to run rank 0's forward besides the token ids (a tensor broadcast after
    it): the host's int64 arrays as bytes (cheap to pickle, rebuilt without a Python list), and
    the host lists the attention backends read. (Packed into the group's control frames by
    `pack_control`.)"""

    positions: bytes
    slot_mapping: bytes
    block_tables: bytes  # [num_seqs, width] row-major
    query_start: list[int]
    context_lens: list[int]

    @classmethod
    def of(cls, b: ForwardBatch) -> "StepBatch":
        host = b.host if b.host is not None else (b.positions.cpu(), b.slot_mapping.cpu(), b.block_tables.cpu())
        return cls(*(t.contiguous().numpy().tobytes() for t in host), list(b.query_start), list(b.context_lens))

    @property
    def num_tokens(self) -> int:
        return self.query_start[-1]

    def forward_batch(self, input_ids: torch.Tensor, kv_cache: torch.Tensor, kv_scales=()) -> ForwardBatch:
        dev = kv_cache.device

        def tensor(raw: bytes) -> torch.Tensor:
            t = torch.frombuffer(bytearray(raw), dtype=torch.long) if raw else torch.empty(0, dtype=torch.long)
            return t.to(dev, non_blocking=True)

        n = len(self.context_lens)
        # The int32 device copies the GPU kernels read (and DecodeGraphs.fits asks for), as
        # ModelRunner.prepare makes them: one copy for both.
        lens = torch.tensor(self.context_lens + self.query_start, dtype=torch.int32).to(dev, non_blocking=True)
        return ForwardBatch(
            input_ids=input_ids, positions=tensor(self.positions), slot_mapping=tensor(self.slot_mapping),
            block_tables=tensor(self.block_tables).view(n, -1), query_start=self.query_start,
            context_lens=self.context_lens, logits_indices=torch.empty(0, dtype=torch.long, device=dev),
            kv_cache=kv_cache, kv_scales=kv_scales, context_lens_t=lens[:n], query_start_t=lens[n:])


# What rank 0 sends its followers: an empty step (None), a word (STOP; tp_local's own), a step, or a
# tuple of plain data (tp_local's requests of its followers).
Control = StepBatch | str | tuple | None


def pack_control(msg: Control) -> bytes:
    """One control message as msgpack: [kind, fields...]."""
    match msg:
        case None:
            return msgpack.packb(["idle"])
        case str():
            return msgpack.packb(["word", msg])
        case StepBatch():
            return msgpack.packb(["step", msg.positions, msg.slot_mapping, msg.block_tables, msg.query_start,
                                  msg.context_lens])
        case tuple():
            return msgpack.packb(["tuple", list(msg)])
    raise TypeError(f"no control encoding for {type(msg).__name__}")


def unpack_control(data: bytes) -> Control:
    """pack_control's message; raises ValueError for bytes that are none of its."""
    try:
        kind, *fields = msgpack.unpackb(data)
        match kind:
            case "idle":
                return None
            case "word":
                (word,) = fields
                if isinstance(word, str):
                    return word
            case "step":
                step = StepBatch(*fields)
                if all(isinstance(b, bytes) for b in fields[:3]) and all(
                        isinstance(v, list) and all(type(i) is int for i in v) for v in fields[3:]):
                    return step
            case "tuple":
                (items,) = fields
                return tuple(items)
    except Exception:
        pass
    raise ValueError("a tensor-parallel control message that is none of rank 0's")


def join_tp_group(me: TPRank, device: str | torch.device = "cpu", timeout_s: float = TIMEOUT_S) -> "TPGroup":
    """Join the replica's group: returns once every rank has joined. Gloo on the CPU; on a GPU
    (`device`, this rank's) NCCL for the model and a gloo group for the steps' host data."""
    device = torch.device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":  # NCCL binds the current device: ours, where a process sees several GPUs
        torch.cuda.set_device(device)
    store = dist.TCPStore(me.store_host, me.store_port, is_master=False, timeout=timedelta(seconds=timeout_s))
    dist.init_process_group(backend, store=store, rank=me.rank, world_size=me.size,
                            timeout=timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo") if backend == "nccl" else None
    prove_members(me.rank, me.size, me.token, me.group_id, control)  # (the store takes anyone)
    return TPGroup(TensorParallel(me.rank, me.size), control, device)


class TPGroup:
    def __init__(self, tp: TensorParallel, control=None, device: str | torch.device = "cpu"):
        """Over the default process group, joined (join_tp_group): the model's collectives. `control`:
        the gloo group the steps' host data goes over (None: the default group, gloo on the CPU)."""
        self.rank, self.size = tp.rank, tp.size
        self.tp = tp
        self.control = control
        self.device = torch.device(device)
        self._sent = time.monotonic()
        self.gathers = False  # every layer's KV of every step goes to rank 0's staging cache
        self._kv_cache = self._staging = None
        self._heads: list[range] = []  # the KV heads of each rank

    def stage_kv(self, engine) -> tuple[torch.Tensor, object]:
        """A prefill replica (every rank calls it): the cache and layout its KV leaves from — on rank
        0 a staging cache of every KV head that each step fills (None elsewhere), or, for a latent
        cache (whole on every rank), the engine's own."""
        if engine.layout.kind != "kv":
            return engine.kv_cache, engine.layout
        args = engine.args
        self.gathers, self._kv_cache = True, engine.kv_cache
        self._heads = [TensorParallel(r, self.size).kv_heads(args.num_heads, args.num_kv_heads)
                       for r in range(self.size)]
        full = dataclasses.replace(engine.layout, num_kv_heads=args.num_kv_heads)
        if self.rank == 0:
            self._staging = allocate_kv_cache(full, engine.kv_cache.device)
        return self._staging, full

    def send(self, batch: ForwardBatch) -> None:
        """Rank 0, before its forward: the followers run the same one. The ids go as a tensor over
        the model's group, queued on this GPU behind the sampling that may still be writing them."""
        self._broadcast(StepBatch.of(batch))
        ids = batch.input_ids if batch.input_ids.is_contiguous() else batch.input_ids.contiguous()
        dist.broadcast(ids, src=0, group=self.tp.group)
        self.follow(batch)

    def follow(self, batch: ForwardBatch) -> None:
        """Every rank, before the forward: where KV is staged, each layer's is gathered once
        written, before the layer's hook (rank 0's KV streaming) reads it."""
        if not self.gathers:
            return
        inner, slots = batch.layer_done, batch.slot_mapping

        def layer_done(layer: int) -> None:
            self._gather(layer, slots)
            if inner is not None:
                inner(layer)

        batch.layer_done = layer_done

    def _gather(self, layer: int, slots: torch.Tensor) -> None:
        # [planes, T, local heads, dim]: this rank's heads of the step's slots, as bytes (gloo
        # moves no FP8; the staging cache takes the bytes as they are).
        mine = self._kv_cache[layer].flatten(1, 2)[:, slots].contiguous().view(torch.uint8)
        if self.rank != 0:
            dist.gather(mine, None, dst=0)
            return
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        dist.gather(mine, parts, dst=0)
        staged = self._staging[layer].flatten(1, 2).view(torch.uint8)  # a view: [planes, slots, heads, dim bytes]
        for heads, part in zip(self._heads, parts):
            staged[:, slots, heads.start:heads.stop] = part

    def keepalive(self) -> None:
        """Rank 0, every loop turn: an empty step if none went out for KEEPALIVE_S, so that the
        followers' waits end."""
        if time.monotonic() - self._sent >= KEEPALIVE_S:
            self._broadcast(None)

    def stop(self) -> None:
        """Rank 0: end the followers' loops (TPFollower returns from its thread)."""
        self._broadcast(STOP)

    def receive(self, kv_cache: torch.Tensor, kv_scales=()) -> ForwardBatch | str | None:
        """A follower: the next step's batch over `kv_cache` (None: rank 0 is idle; STOP: it is done).
        Raises past TIMEOUT_S."""
        size = torch.empty(1, dtype=torch.long)
        dist.broadcast(size, src=0, group=self.control)
        if not 0 < size.item() <= MAX_CONTROL_BYTES:
            raise ValueError(f"a tensor-parallel control message of {size.item()} bytes")
        data = torch.empty(size.item(), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.control)
        step = unpack_control(data.numpy().tobytes())
        if not isinstance(step, StepBatch):
            return step
        ids = torch.empty(step.num_tokens, dtype=torch.long, device=kv_cache.device)
        dist.broadcast(ids, src=0, group=self.tp.group)
        batch = step.forward_batch(ids, kv_cache, kv_scales)
        self.follow(batch)
        return batch

    def _broadcast(self, msg: Control) -> None:
        """Rank 0: its length, then its bytes (host tensors: the control group is gloo)."""
        data = pack_control(msg)
        dist.broadcast(torch.tensor([len(data)], dtype=torch.long), src=0, group=self.control)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=self.control)
        self._sent = time.monotonic()
