"""What an engine step costs, as a line fitted to its measured step buckets: prefill `fixed +
per_token x tokens`, decode `fixed + per_seq x batch`, and a step that mixes prompt tokens with
decoders (MixedCost). The planner (control/planner.py) sizes the phases from it; each router
(router/forecast.py) forecasts a new request's time to first token from it; the TPOT guard
(engine/tpot_guard.py) and the adaptive prefill site (router/prefill_site.py) size prompt chunks
beside decoders from it. Plain data and arithmetic: no Ray, no torch."""

import math
from dataclasses import dataclass

# The share of a TPOT target a guarded step may fill: the fits are means, and steps scatter around
# them (a client's TPOT is a mean over its steps, its SLO a percentile over clients).
HEADROOM = 0.9

# The most slack a TPOT guard banks, in HEADROOM x target steps: enough for a whole long prompt
# in one mixed step where the decoders leave little per step (a 4k prompt's ~140 ms on an H200
# beside decoders at 20 ms), so that its overhead is paid once, not on each of many small chunks.
# A client's TPOT is the mean of its gaps: a bank spent in one step moves the mean of an N-token
# answer by at most ~BANK_TARGETS / N of the target (3 % at 256 tokens, 12 % at 64): the headroom
# (10 %) covers answers from ~80 tokens.
BANK_TARGETS = 8


@dataclass
class StepCost:
    """Seconds of a step of `size` (tokens for prefill, sequences for decode) = fixed + per_unit × size."""

    fixed: float
    per_unit: float
    steps: int  # steps it was fitted on
    largest: float  # the largest mean size of a bucket it saw

    def time(self, size: float) -> float:
        return self.fixed + self.per_unit * size


def fit(buckets: dict[int, list], phase: str, fixed_floor: float = 0.0) -> StepCost | None:
    """Weighted least squares over the buckets' mean (size, seconds). With one size only the split
    into fixed and per-unit cost is unknown: prefill is then taken as all per-token (it computes
    each token), decode as all fixed (a batch reads the same weights). None: no step measured.

    fixed_floor: what the fixed cost cannot be below (`plan` gives prefill decode's: every step of
    the model reads the same weights and launches the same kernels, whatever its size). Where the
    fit lands under it, the floor (or the mean step, if smaller) is the fixed cost and the rest of
    the mean step is per unit. It matters for short prompts: steps of 16-48 tokens cannot separate
    the two costs, and one noisy bucket used to put all of a step's time on its tokens, and a full
    step of max_batch_tokens was extrapolated at that per-token rate."""
    pts = [(row[1] / row[0], row[2] / row[0], row[0]) for row in buckets.values() if row[0] > 0]
    if not pts:
        return None
    w = sum(p[2] for p in pts)
    xm = sum(x * n for x, _, n in pts) / w
    ym = sum(y * n for _, y, n in pts) / w
    sxx = sum(n * (x - xm) ** 2 for x, _, n in pts)
    largest = max(p[0] for p in pts)
    if sxx <= 1e-12 * max(1.0, xm * xm):
        a, b = (0.0, ym / xm) if phase == "prefill" else (ym, 0.0)
    else:
        b = sum(n * (x - xm) * (y - ym) for x, y, n in pts) / sxx
        a = ym - b * xm
        if b < 0:  # bigger steps measured faster (noise): no per-unit cost
            a, b = ym, 0.0
        elif a < 0:  # through the origin instead
            a, b = 0.0, sum(n * x * y for x, y, n in pts) / sum(n * x * x for x, _, n in pts)
    if a < fixed_floor:
        a = min(fixed_floor, ym)
        b = (ym - a) / xm
    return StepCost(a, b, int(w), largest)


def fit_phases(profile: dict) -> tuple[StepCost | None, StepCost | None]:
    """(decode, prefill) step costs of a step profile (engine/step_profile.py's snapshot, or a
    replica's stats' `profile`): prefill's fixed cost floored at decode's (see `fit`)."""
    decode = fit(profile.get("decode", {}), "decode")
    return decode, fit(profile.get("prefill", {}), "prefill", decode.fixed if decode else 0.0)


@dataclass
class MixedCost:
    """A step of `decoders` decoding sequences and `tokens` prompt tokens: the decoders' step, plus
    an overhead once there are prompt tokens in it, plus each token's own cost. The overhead is
    real: a mixed step runs eagerly where the decoders alone replay a CUDA graph (an H200, 96
    decoders of 4k context: 28 ms alone, 46 ms with 16 prompt tokens beside them;
    docs/benchmarks.md, adaptive disaggregation). So a guard does not add a few prompt tokens to
    every step: it banks each step's slack and spends it on a chunk worth the overhead."""

    decode: StepCost
    overhead: float
    per_token: float

    def time(self, decoders: int, tokens: int) -> float:
        return self.decode.time(decoders) + (self.overhead + self.per_token * tokens if tokens else 0.0)

    def slack(self, decoders: int, target_s: float) -> float:
        """What a step of the decoders alone leaves of target_s (a TPOT SLO) less HEADROOM."""
        return HEADROOM * target_s - self.decode.time(decoders)

    def least_chunk(self, floor: int) -> int:
        """The fewest prompt tokens worth a mixed step: as many as cost what the mixing itself does
        (a smaller chunk pays more for the mixing than for its tokens), and at least `floor`."""
        return max(floor, int(self.overhead / self.per_token)) if self.per_token > 0 else floor

    def bank_cap(self, target_s: float) -> float:
        """The most slack a guard banks (BANK_TARGETS steps of HEADROOM x target_s)."""
        return BANK_TARGETS * HEADROOM * target_s

    def buys(self, seconds: float) -> int:
        """Prompt tokens `seconds` of banked slack pay for in one mixed step (its overhead first)."""
        if seconds < self.overhead:
            return 0
        return 1 << 30 if self.per_token <= 0 else int((seconds - self.overhead) / self.per_token)

    def paced_s(self, decoders: int, tokens: int, target_s: float, floor: int, chunk: int) -> float:
        """Seconds for a TPOT guard (engine/tpot_guard.py) to compute `tokens` prompt tokens beside
        `decoders` decoding sequences, in mixed steps of at most `chunk` tokens each, from an empty
        bank: every step banks its slack, a mixed step goes once the bank buys its chunk (or, where a
        full bank buys less, what a full bank buys). So over k steps, k x slack pays for the mixed
        steps' overheads and tokens, and the time is k decoders' steps plus what the mixing costs.
        Where the decoders alone fill the target: a least chunk every STARVE_STEPS steps."""
        step, slack = self.decode.time(decoders), self.slack(decoders, target_s)
        if slack <= 0:
            least = self.least_chunk(floor)
            return math.ceil(tokens / least) * (STARVE_STEPS * step + self.overhead) + self.per_token * tokens
        size = max(1, min(chunk, self.buys(self.bank_cap(target_s) + slack)))
        chunks = math.ceil(tokens / size)
        cost = chunks * self.overhead + self.per_token * tokens
        return max(chunks, math.ceil(cost / slack - 1e-9)) * step + cost


# Steps a prompt waits, beside decoders that alone fill the TPOT target, before it may take a
# least chunk anyway: it moves on, slowly, rather than never.
STARVE_STEPS = 32


def fit_mixed(profile: dict, decode: StepCost | None) -> MixedCost | None:
    """The mixed-step cost of a step profile's "mixed" rows (bucket of prompt tokens -> [steps,
    prompt tokens, decoders, seconds], summed): what each step took beyond its decoders' step (the
    decode fit, linear in the batch, so a row's sums give it exactly) fitted as prefill is, against
    its prompt tokens. None without a decode fit or a mixed step measured."""
    rows = profile.get("mixed", {})
    if decode is None or not rows:
        return None
    beyond = {b: [n, tokens, sec - n * decode.fixed - decode.per_unit * dec] for b, (n, tokens, dec, sec) in rows.items()}
    extra = fit(beyond, "prefill")
    if extra is None:
        return None
    return MixedCost(decode, max(0.0, extra.fixed), max(0.0, extra.per_unit))
