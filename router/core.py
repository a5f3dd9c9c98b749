"""What a router's front ends (router/http_api.py, router/grpc_server.py) serve from: the replica
set, the routing policy, admission and the request lifecycle, built together for one router process.

Each decision lives in one of them (see each module): which replicas exist and are live
(router/replica_set.py), where an attempt goes (router/policy.py), whether a new request enters
now (router/admission.py), and a request's life across replicas (router/lifecycle.py). This file
wires them and answers the front ends' other questions (tokenizing, readiness).
"""

from collections.abc import AsyncIterator

from pdserve.messages import ReplicaChange, Request, RequestDelta
from pdserve.router.admission import AdmissionGate, AdmissionPolicy
from pdserve.router.idle import IDLE_POLL_S
from pdserve.router.lifecycle import Lifecycle
from pdserve.router.policy import routing_policy
from pdserve.router.prefill_site import PrefillSite
from pdserve.router.replica_set import Channel, ReplicaSet
from pdserve.router.types import DirectWriter
from pdserve.structured_outputs import GrammarTokenizer


class RouterCore:
    def __init__(self, name: str, model_name: str, max_model_len: int, tokenizer, replicas: list[ReplicaChange],
                 policy: str, metrics=None, migration_limit: int = 3, replica_wait_s: float = 30.0,
                 admission: AdmissionPolicy | None = None, block_size: int = 16,
                 prefill_site: PrefillSite | None = None, channel: Channel | None = None):
        """name: this router's actor name (where decode replicas send deltas). replicas: every replica
        as the controller last described it; later changes come by `apply`. block_size: the engines'
        KV block (the prefix cache's unit, which its hashes cover). prefill_site: where a
        disaggregated attempt's prompt is computed (router/prefill_site.py). channel: how requests
        and deltas move (ReplicaSet); None: Ray calls."""
        self.name = name
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.grammar_tokenizer = GrammarTokenizer(tokenizer)  # what structured outputs are checked against
        self.replicas = ReplicaSet(name, metrics, channel)
        self.routing = routing_policy(policy, self.replicas, block_size)
        self.gate = AdmissionGate(admission or AdmissionPolicy(), self.replicas, metrics, replica_wait_s)
        self.replicas.follow(self.routing.index, self.gate.replica_stats, self.gate.forecast.forget)
        self.lifecycle = Lifecycle(self.replicas, self.routing, self.gate, max_model_len, block_size, metrics,
                                   migration_limit, replica_wait_s, prefill_site)
        self.replicas.deliver = self.lifecycle.deliver  # the channel's deltas
        for change in replicas:
            self.apply(change)

    # -- from the controller and the workers -------------------------------------------------------

    def apply(self, change: ReplicaChange) -> None:
        """A replica started, was replaced, drains or is gone (from the controller)."""
        self.replicas.apply(change)

    def deliver(self, deltas: list[RequestDelta]) -> None:
        self.lifecycle.deliver(deltas)

    async def refresh_stats(self, interval_s: float = 0.5, idle_s: float = IDLE_POLL_S) -> None:
        """Poll replica stats every interval_s while requests are in flight, every idle_s (or at the
        next request's start) while none are (router/idle.py)."""
        activity = self.lifecycle.activity
        await self.replicas.refresh_stats(interval_s, after=self.gate.wake,
                                          pause=lambda s: activity.pause(s, idle_s))

    # -- what the front ends ask -------------------------------------------------------------------

    def generate(self, request: Request, direct: DirectWriter | None = None) -> AsyncIterator[RequestDelta]:
        return self.lifecycle.generate(request, direct)

    @property
    def draining(self) -> bool:
        return self.gate.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.gate.draining = value

    def placed(self, replica: str) -> int:
        return self.replicas.placed(replica)

    def restarts(self) -> dict[str, int]:
        return self.replicas.restarts()

    @property
    def stats(self):
        return self.replicas.stats

    @property
    def direct_writes(self) -> int:
        return self.lifecycle.direct_writes

    def in_flight(self) -> int:
        return self.lifecycle.in_flight()

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            template_kwargs: dict | None = None, add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools,
                                                  generation_prompt=add_generation_prompt,
                                                  **(template_kwargs or {}))

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    @property
    def chat_template(self) -> str | None:
        return self.tokenizer.chat_template

    def ready(self) -> bool:
        return not self.draining and self.replicas.ready()

    def degraded(self) -> dict[str, str]:
        out = self.replicas.degraded()
        if self.draining:
            out["router"] = "draining: the service is shutting down"
        return out
