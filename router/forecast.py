"""The router's forecast of a new request's time to first token, for admission control: refuse at
once (429) what would miss slo.ttft_ms rather than queue it into a miss.

Built from what the router knows without asking anyone:
- the replicas' measured step costs: each one's step profile (engine/step_profile.py, on its
  stats) fitted as the planner fits it (pdserve/step_cost.py `fit_phases`: fixed + per unit × size);
- their sequence slots and occupancy (stats, polled every 0.5 s);
- this router's own requests: which hold a slot, how far each has got, what each still awaits.

A request first needs a sequence slot (a decode replica's, or a colocated replica's). Slots free
as their holders finish; each freed slot goes to the next in line, in admission order. So the
forecast replays that: a heap of the times the pool's slots free up, each request ahead of the new
one (this router's requests waiting for a slot, then those in its queue that go first) popping the
earliest and holding it for its own expected time in the slot. The new request's slot wait is
then the earliest time left. Its first token follows its prefill (behind the prompt tokens queued
at the prefill replica when it gets a slot at once; alone otherwise), the KV transfer and a step.

Expected lengths: a request that ignores EOS runs to max_tokens; any other is expected to stop at
the mean length of the requests this router saw finish (within max_tokens). A holder of another
router (the stats count more than this router holds) is taken to be like this router's own."""

import heapq
import math
from dataclasses import dataclass

from pdserve.step_cost import MixedCost, StepCost, fit_mixed, fit_phases
from pdserve.messages import ReplicaStats
from pdserve.protocol import SamplingParams

MEAN_WEIGHT = 0.05  # weight of each finished request in the running mean of generated tokens


@dataclass
class SlotHolder:
    """One of this router's requests that holds (or is about to hold) a sequence slot."""

    params: SamplingParams
    prompt_tokens: int
    generated: int  # tokens it streamed so far
    first_token: bool  # its prefill is done


@dataclass
class Pool:
    """The sequence slots of the live decode (or colocated) replicas, as last reported."""

    slots: int  # their max_num_seqs, summed
    others: int  # slots held by requests this router does not know (other routers')
    step_s: float  # one decode step with the slots full (the slowest replica's)


class TTFTForecast:
    def __init__(self, prefill_step_tokens: int):
        self.prefill_step_tokens = prefill_step_tokens  # a prefill step's token budget (max_batch_tokens)
        self.decode_cost: dict[str, StepCost] = {}  # replica -> its decode steps' fit
        self.prefill_cost: dict[str, StepCost] = {}  # replica -> its prompt steps' fit
        self.mixed_cost: dict[str, MixedCost] = {}  # replica -> its steps of prompt tokens beside decoders
        self.transfer_s: dict[str, float] = {}  # prefill replica -> mean seconds of its latest KV transfers
        self.mean_generated: float | None = None  # running mean of tokens per finished request

    # -- what was measured --------------------------------------------------------------------------

    def refit(self, name: str, s: ReplicaStats) -> None:
        """A replica's fresh stats: fit its step costs again (cumulative profiles: a step's cost
        depends on the model and the hardware, so every step measured helps)."""
        fitted = fit_phases(s.profile) if s.profile else (None, None)
        fitted += (fit_mixed(s.profile, fitted[0]) if s.profile else None,)
        for cost, costs in zip(fitted, (self.decode_cost, self.prefill_cost, self.mixed_cost)):
            if cost is None:
                costs.pop(name, None)
            else:
                costs[name] = cost
        if s.transfers:
            self.transfer_s[name] = sum(sec for _, sec in s.transfers[-32:]) / len(s.transfers[-32:])

    def forget(self, name: str) -> None:
        for d in (self.decode_cost, self.prefill_cost, self.mixed_cost, self.transfer_s):
            d.pop(name, None)

    def finished(self, generated: int) -> None:
        """A request of this router finished having generated `generated` tokens."""
        m = self.mean_generated
        self.mean_generated = generated if m is None else m + MEAN_WEIGHT * (generated - m)

    # -- the forecast -------------------------------------------------------------------------------

    def pool(self, stats: list[ReplicaStats], held_here: int) -> Pool | None:
        """The slot pool of these replicas (decode or colocated), given that this router holds
        `held_here` slots of it; None before every one of them has measured a decode step."""
        slots = sum(s.max_num_seqs for s in stats)
        costs = [self.decode_cost.get(s.name) for s in stats]
        if not stats or not slots or any(c is None for c in costs):
            return None
        held = sum(_holding(s) for s in stats)
        # Each rank steps its own batch (an expert-parallel replica's slots are its ranks' together).
        step = max(c.time(max(1, s.max_num_seqs // max(1, s.ranks))) for c, s in zip(costs, stats))
        return Pool(slots, max(0, held - held_here), step)

    def expected_tokens(self, params: SamplingParams) -> float:
        """Tokens a request is expected to generate."""
        if params.ignore_eos or self.mean_generated is None:
            return params.max_tokens
        return min(params.max_tokens, max(1.0, self.mean_generated))

    def prefill_s(self, replica: str, tokens: int) -> float:
        """Seconds for `replica` to compute `tokens` prompt tokens queued at once (steps of its
        token budget); 0 before it has measured a prompt step."""
        cost = self.prefill_cost.get(replica)
        if cost is None or tokens <= 0:
            return 0.0
        return math.ceil(tokens / self.prefill_step_tokens) * cost.fixed + cost.per_unit * tokens

    def slot_wait(self, pool: Pool, holders: list[SlotHolder], line: list[tuple[SamplingParams, int]],
                  prefill: str, params: SamplingParams) -> float:
        """Seconds until a new request (of `params`) gets a slot: `holders` (this router's) hold slots
        now, `line` (params and prompt tokens of each request ahead of it, in order) takes the next ones."""
        if pool.others + len(holders) + len(line) < pool.slots:
            return 0.0  # a slot is free for it: nothing to replay
        step = pool.step_s
        left = [self._left(h, step, prefill) for h in holders]
        if pool.others:  # another router's requests: taken to be like ours (with none, like this one half-way)
            typical = sorted(left)[len(left) // 2] if left else self.expected_tokens(params) / 2 * step
            left += [typical] * pool.others
        left.sort()
        free = [0.0] * max(0, pool.slots - len(left)) + left[:pool.slots]
        heapq.heapify(free)
        for params, prompt in line:
            t = heapq.heappop(free)
            heapq.heappush(free, t + self.prefill_s(prefill, prompt) + self.expected_tokens(params) * step)
        return free[0]

    def _left(self, h: SlotHolder, step: float, prefill: str) -> float:
        """Seconds until a holder gives its slot back."""
        tokens = max(1.0, self.expected_tokens(h.params) - h.generated)
        return tokens * step + (0.0 if h.first_token else self.prefill_s(prefill, h.prompt_tokens))


def _holding(s: ReplicaStats) -> int:
    """Slots a replica's stats say are taken: a decode replica's running, preempted (waiting) and
    reserved sequences all count against max_num_seqs; a colocated replica's waiting ones are a
    queue, not slots."""
    return s.running + s.waiting + s.reserved if s.role == "decode" else s.running
