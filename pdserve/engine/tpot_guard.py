"""The TPOT guard: a step that carries decoding sequences takes prompt tokens (a local prefill's
chunks, a colocated replica's prompts, a preempted sequence's recompute) only as the decoders'
time per token can pay for them within the cluster's TPOT SLO (slo.tpot_ms), so that computing
prompts beside decoding does not break the decoders' SLO.

The cost comes from the engine's own steps (pdserve/step_cost.py MixedCost): its decode steps by
batch, and what its mixed steps took beyond their decoders' step — an overhead (a mixed step runs
eagerly where decoders alone replay a CUDA graph) and a cost per prompt token. It is refitted
every REFIT_STEPS steps from the engine's cumulative step profile. Until a mixed step has been
measured there is no bound: the first mixed steps take chunk_size and teach the fit.

Pacing. A client's TPOT is the mean of its gaps, so the guard keeps the decoders' mean step
within HEADROOM x the target rather than every step: while a prompt waits, each step banks what its
decoders leave of it (its slack; at most BANK_TARGETS steps' worth banked; a step of decoders
alone, with no prompt waiting, asks the guard nothing), and a step takes prompt tokens once the
bank pays for the mixing overhead and the next prompt's whole chunk (`want`), or, where a full bank
buys less, as much as it buys; it spends the bank on as many tokens as it buys. Small chunks pay the
overhead each time: adding a few tokens to every step made each local 4k prompt crawl through ~250
mixed steps beside 96 decoders on an H200, every one 12 ms slower than the decoders alone, and a
bank of one target still cut a 4k prompt into chunks of a few hundred tokens beside decoders at
20 ms (docs/benchmarks.md, adaptive disaggregation). Where the decoders alone fill the target, a
least chunk goes every STARVE_STEPS steps: prompts move on, slowly, rather than never.

The routers forecast a local prefill's pace with the same model (MixedCost.paced_s,
router/prefill_site.py). A step of prompts alone (no decoders) is unbounded here: its chunks are
sized by chunk_size and max_num_batched_tokens as before."""

from pdserve.engine.step_profile import StepProfile
from pdserve.step_cost import HEADROOM, STARVE_STEPS, MixedCost, fit_mixed, fit_phases

REFIT_STEPS = 64  # steps between two fits (a fit walks a few dozen buckets: cheap, but not per step)


class TPOTGuard:
    def __init__(self, profile: StepProfile, target_s: float, floor: int):
        self.profile = profile
        self.target_s = target_s
        self.floor = floor  # the fewest prompt tokens a mixed step takes (a block)
        self.mixed: MixedCost | None = None
        self.refit_steps = REFIT_STEPS  # (a test that sets its own costs keeps them with a larger one)
        self.bank = 0.0  # seconds of slack the decoders' steps have banked (negative: owed)
        self._slack: float | None = None  # the step being scheduled's own slack (None: not guarded)
        self._starved = 0  # steps since prompt tokens last went, where the decoders fill the target
        self._steps = 0

    def fitted(self, mixed: MixedCost | None) -> None:
        """Use this cost (a refit's, or a test's)."""
        self.mixed = mixed

    def budget(self, decoders: int, want: int) -> int | None:
        """The most prompt tokens the next step may take beside `decoders` decoding sequences (0:
        none this step), `want` being the next prompt's chunk (what it would take unguarded); None:
        no bound (no decoders to protect, or no costs measured yet). The scheduler then says what it
        took (`took`)."""
        self._steps += 1
        # (Sooner while none is fitted: the unbounded mixed steps until then are the costly ones.)
        if self._steps >= (self.refit_steps if self.mixed is not None else min(8, self.refit_steps)):
            self._steps = 0
            snap = self.profile.snapshot()
            self.fitted(fit_mixed(snap, fit_phases(snap)[0]))
        m = self._slack = None
        if decoders == 0 or (m := self.mixed) is None:
            self.bank = 0.0  # (no decoders: nothing owed, nothing banked for the next ones)
            return None
        self._slack = slack = m.slack(decoders, self.target_s)
        least = m.least_chunk(self.floor)
        if slack <= 0:
            return least if self._starved >= STARVE_STEPS else 0
        tokens = m.buys(self.bank + slack)
        if tokens >= max(1, want):
            return tokens
        full = self.bank >= m.bank_cap(self.target_s) - 1e-12  # (it banks no more: spend it)
        return max(tokens, least) if full else 0

    def took(self, tokens: int) -> None:
        """The step just scheduled takes `tokens` prompt tokens: the bank pays for them."""
        if self._slack is None:
            return
        m = self.mixed
        spent = m.overhead + m.per_token * tokens if tokens else 0.0
        # (Owed, at most one target: a trickle past a full target is not paid back for long.)
        self.bank = max(-HEADROOM * self.target_s, min(m.bank_cap(self.target_s), self.bank + self._slack - spent))
        self._starved = 0 if tokens or self._slack > 0 else self._starved + 1
        self._slack = None
