"""The request lifecycle across replicas (DESIGN §3): reserve on a decode replica, prefill on a
prefill replica that streams the KV there, then relay the decode replica's per-step deltas."""

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator

from pdserve.engine.sampling_params import InvalidRequestError
from pdserve.messages import ReplicaStats, RequestDelta

from router.decode_replica import DecodeReplica
from router.types import Delta, GenerateRequest, NoCapacityError, ServingError

log = logging.getLogger(__name__)


class RayCore:
    def __init__(self, name: str, model_name: str, max_model_len: int, tokenizer,
                 prefill: dict[str, object], decode: dict[str, DecodeReplica], policy: str, metrics=None):
        self.name = name  # this router's actor name: where decode replicas send deltas
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.prefill = prefill  # replica name -> actor handle
        self.decode = decode  # replica name -> its rank(s)
        self.policy = policy
        self.metrics = metrics
        self.stats: dict[str, ReplicaStats] = {}
        self._rr = itertools.count()
        self._queues: dict[str, asyncio.Queue] = {}
        self._loads: dict[str, int] = {n: 0 for n in [*prefill, *decode]}  # requests we placed there

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages)

    def ready(self) -> bool:
        live = {s.role for s in self.stats.values()}
        return {"prefill", "decode"} <= live

    def deliver(self, deltas: list[RequestDelta]) -> None:
        """A decode replica's output of one step, for the requests this router streams."""
        for d in deltas:
            q = self._queues.get(d.request_id)
            if q is not None:
                q.put_nowait(d)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Delta]:
        rid = request.request_id
        if len(request.prompt_ids) >= self.max_model_len:
            raise InvalidRequestError("prompt", f"is {len(request.prompt_ids)} tokens; the model's context is "
                                                f"{self.max_model_len} tokens")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        d_name = p_name = d_rank = None
        finished = False
        try:
            p_name = self._pick(self.prefill)
            self._loads[p_name] += 1
            d_name, d_rank, handle = await self._reserve(request, p_name)
            await self.prefill[p_name].prefill.remote(rid, request.prompt_ids, request.params, handle)
            while not finished:
                d: RequestDelta = await queue.get()
                if d.finish_reason == "error":
                    finished = True
                    raise ServingError(d.error or "the request failed")
                finished = d.finish_reason is not None
                yield Delta(d.text, d.token_ids, d.finish_reason, d.logprobs)
        finally:
            self._queues.pop(rid, None)
            for name in (p_name, d_name):
                if name is not None:
                    self._loads[name] -= 1
            if not finished and d_name is not None:  # the client left: stop it everywhere
                self.decode[d_name].ranks[d_rank].abort.remote(rid)
                self.prefill[p_name].abort.remote(rid)  # (the front end counts the router's abort)

    async def _reserve(self, request: GenerateRequest, p_name: str) -> tuple[str, str, bytes]:
        """Reserve KV blocks on a decode replica's rank, best candidates first -> (replica, rank,
        handle); raises when all are full. The handle names the rank: the KV goes there."""
        for d_name in self._decode_order():
            replica = self.decode[d_name]
            for rank in replica.rank_order():
                res = await replica.ranks[rank].reserve.remote(request.request_id, request.prompt_ids,
                                                               request.params, p_name, self.name)
                if res.error:
                    raise InvalidRequestError(res.param or "prompt", res.error.split(": ", 1)[-1])
                if res.handle is not None:
                    self._loads[d_name] += 1
                    return d_name, rank, res.handle
        raise NoCapacityError("every decode replica is full; retry later")

    def _pick(self, replicas: dict) -> str:
        names = list(replicas)
        if self.policy == "round-robin":
            return names[next(self._rr) % len(names)]
        return min(names, key=lambda n: self._loads[n])  # fewest requests in flight from us

    def _decode_order(self) -> list[str]:
        names = list(self.decode)
        if self.policy == "round-robin":
            k = next(self._rr) % len(names)
            return names[k:] + names[:k]
        # kv-aware: most free KV blocks first (as last reported), then fewest requests from us.
        return sorted(names, key=lambda n: (-getattr(self.stats.get(n), "free_blocks", 0), self._loads[n]))

    async def refresh_stats(self, interval_s: float = 0.5) -> None:
        """Keep replica stats (routing, /health, /metrics) fresh; runs for the router's life."""
        while True:
            for name in [*self.prefill, *self.decode]:
                try:
                    if name in self.prefill:
                        s: ReplicaStats = await asyncio.wait_for(self.prefill[name].stats.remote(), timeout=5)
                    else:
                        s = await self.decode[name].fetch_stats(timeout_s=5)
                    before = self.stats.get(name)
                    self.stats[name] = s
                    if self.metrics:
                        self.metrics.set_replica_stats(s.role, s.name, s.running + s.waiting,
                                                       s.total_blocks - s.free_blocks, s.total_blocks)
                        for _ in range(s.aborted - (before.aborted if before else 0)):
                            self.metrics.count_abort(s.role)
                        new = s.transfers_total - (before.transfers_total if before else 0)
                        for nbytes, seconds in s.transfers[len(s.transfers) - min(new, len(s.transfers)):]:
                            self.metrics.observe_transfer(nbytes, seconds)
                        seen = before.expert_tokens if before else []
                        self.metrics.count_expert_tokens(s.name, [n - (seen[e] if e < len(seen) else 0)
                                                                  for e, n in enumerate(s.expert_tokens)])
                except Exception:
                    self.stats.pop(name, None)  # unreachable: not live
            await asyncio.sleep(interval_s)
