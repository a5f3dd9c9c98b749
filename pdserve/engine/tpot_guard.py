"""The TPOT guard: a step that carries decoding sequences takes prompt tokens (a local prefill's
chunks, a colocated replica's prompts, a preempted sequence's recompute) only up to the budget that
keeps the step within the cluster's TPOT SLO (slo.tpot_ms), so that computing prompts beside
decoding never breaks the decoders' SLO.

The budget comes from the engine's own step costs (pdserve/step_cost.py): its decode steps by
batch, and what its mixed steps took beyond their decoders' step (an overhead, for the mixed step
runs eagerly where decoders alone replay a graph, and a cost per prompt token). It is refitted every
REFIT_STEPS steps from the engine's cumulative step profile. Until a mixed step has been measured
there is no budget: the first mixed steps take chunk_size and teach the fit (a smaller budget
then adds the second size the fit needs to split overhead from per-token cost). A step of prompts
alone (no decoders) is unbounded here: its chunks are sized by chunk_size and
max_num_batched_tokens as before.

The routers compute the same budget from the same profile (on the replica's stats) to forecast a
local prefill's time to first token (router/prefill_site.py)."""

from pdserve.engine.step_profile import StepProfile
from pdserve.step_cost import MixedCost, fit_mixed, fit_phases

REFIT_STEPS = 64  # steps between two fits (a fit walks a few dozen buckets: cheap, but not per step)


class TPOTGuard:
    def __init__(self, profile: StepProfile, target_s: float, floor: int):
        self.profile = profile
        self.target_s = target_s
        self.floor = floor  # the fewest prompt tokens a step takes (a block: a prompt always moves on)
        self.mixed: MixedCost | None = None
        self.refit_steps = REFIT_STEPS  # (a test that sets its own costs keeps them with a larger one)
        self._steps = 0

    def fitted(self, mixed: MixedCost | None) -> None:
        """Use this cost (a refit's, or a test's)."""
        self.mixed = mixed

    def budget(self, decoders: int) -> int | None:
        """The most prompt tokens the next step may take beside `decoders` decoding sequences; None:
        no bound (no decoders to protect, or no costs measured yet)."""
        self._steps += 1
        # (Sooner while none is fitted: the unbounded mixed steps until then are the costly ones.)
        if self._steps >= (self.refit_steps if self.mixed is not None else min(8, self.refit_steps)):
            self._steps = 0
            snap = self.profile.snapshot()
            self.fitted(fit_mixed(snap, fit_phases(snap)[0]))
        if decoders == 0 or self.mixed is None:
            return None
        return self.mixed.budget(decoders, self.target_s, self.floor)
