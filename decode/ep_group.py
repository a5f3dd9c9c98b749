"""The expert-parallel group of one decode replica: N ranks, one process (and GPU) each.

Attention is data-parallel: each rank owns its requests and their KV. The experts are sharded
(ExpertPlacement) and each MoE layer exchanges tokens between the ranks (EPExchange), so the
ranks step in lockstep. Before each step they agree, in one all-reduce on the host, on the
largest batch any of them computes, on whether every batch is decode-only (then, with CUDA
graphs, all replay the same bucket) and on how busy the busiest is. If no rank has tokens none
runs a forward; otherwise every rank runs its step, one with nothing scheduled a forward over no
tokens (or the agreed graph, padding only), so that each joins every layer's exchange.
"""

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from pdserve.engine.engine import Engine
from pdserve.engine.outputs import RequestOutput
from pdserve.ops.ep_exchange import EPExchange
from pdserve.ops.expert_placement import ExpertPlacement
from pdserve.worker.rendezvous import prove_members

# How busy a rank is; the whole group acts on its busiest rank's state.
IDLE, WAITING_FOR_KV, RUNNING = 0, 1, 2


@dataclass
class EPRank:
    """What one rank needs to join its group (controller -> decode worker)."""

    rank: int
    size: int
    store_host: str  # the rendezvous: a TCPStore that its creator holds open at this host and port
    store_port: int
    threshold: int = 1024  # a step whose largest batch has this many tokens exchanges by all-to-all
    replicated: list[int] = field(default_factory=list)  # hot experts with a copy on every rank
    group_id: str = ""  # the group's name in its ranks' proofs (rendezvous.new_group_id)
    token: str | None = field(default=None, repr=False)  # the cluster's, proven to the other ranks


class EPGroup:
    def __init__(self, me: EPRank, num_experts: int, device: torch.device, timeout_s: float = 600):
        """Join the group: returns once every rank has joined. Gloo on CPU, NCCL on GPUs."""
        placement = ExpertPlacement(num_experts, me.size, me.rank, tuple(me.replicated))  # fails before joining
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":  # NCCL binds the current device: ours, where a worker sees several GPUs
            torch.cuda.set_device(device)
        # A client of the store rendezvous_store made (worker/rendezvous.py; rank 0 too): nobody here binds a port.
        store = dist.TCPStore(me.store_host, me.store_port, is_master=False, timeout=timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=store, rank=me.rank, world_size=me.size,
                                timeout=timedelta(seconds=timeout_s))
        # The step agreement is host data: on GPUs it goes over gloo, never queued behind kernels.
        self._control = dist.new_group(backend="gloo") if backend == "nccl" else None
        prove_members(me.rank, me.size, me.token, me.group_id, self._control)  # (the store takes anyone)
        self.rank, self.size = me.rank, me.size
        self.exchange = EPExchange(placement, device, me.threshold)

    def step(self, engine: Engine, busy: int) -> tuple[list[RequestOutput], int]:
        """One step of this rank in lockstep with the others -> (its outputs, the busiest rank's state).

        `busy` is this rank's state (IDLE, WAITING_FOR_KV, RUNNING) before the step."""
        scheduled = engine.scheduler.schedule()
        tokens = sum(s.num_new_tokens for s in scheduled)
        not_decode = int(tokens != len(scheduled))  # a prompt chunk here: this step runs eagerly everywhere
        agreed = torch.tensor([tokens, max(busy, RUNNING if scheduled else IDLE), not_decode])
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self._control)
        max_tokens, group_busy, any_not_decode = agreed.tolist()
        self.exchange.begin_step(max_tokens, decode_only=not any_not_decode)
        if max_tokens and not scheduled:
            if self.exchange.graphed:
                engine.runner.graphs.run_idle()
            else:
                engine.model.join_expert_exchanges()
        return engine.step(scheduled), group_busy

    def close(self) -> None:
        if self.exchange.graph_batch:
            # Seen on H200s (torch 2.11, NCCL 2.28): destroying a communicator whose collectives
            # live in captured CUDA graphs never returns. The process is on its way out: leave it.
            return
        dist.destroy_process_group()
