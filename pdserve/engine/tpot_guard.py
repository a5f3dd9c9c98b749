"""The TPOT guard: a step that carries decoding sequences takes prompt tokens (a local prefill's
chunks, a colocated replica's prompts, a preempted sequence's recompute) only up to the budget that
keeps the step within the cluster's TPOT SLO (slo.tpot_ms), so that computing prompts beside
decoding never breaks the decoders' SLO.

The budget comes from the engine's own step costs, fitted as the planner and the routers fit them
(pdserve/step_cost.py): decode steps by batch, prompt steps by tokens. It is refitted every
REFIT_STEPS steps from the engine's cumulative step profile; until both phases have been measured
there is no budget (nothing to forecast from). A step of prompts alone (no decoders) is unbounded
here: its chunks are sized by chunk_size and max_num_batched_tokens as before.

The routers compute the same budget from the same profile (on the replica's stats) to forecast a
local prefill's time to first token (router/prefill_site.py)."""

from pdserve.engine.step_profile import StepProfile
from pdserve.step_cost import StepCost, fit_phases, prompt_budget

REFIT_STEPS = 64  # steps between two fits (a fit walks a few dozen buckets: cheap, but not per step)


class TPOTGuard:
    def __init__(self, profile: StepProfile, target_s: float, floor: int):
        self.profile = profile
        self.target_s = target_s
        self.floor = floor  # the fewest prompt tokens a step takes (a block: a prompt always moves on)
        self.decode: StepCost | None = None
        self.prefill: StepCost | None = None
        self.refit_steps = REFIT_STEPS  # (a test that sets its own costs keeps them with a larger one)
        self._steps = 0

    def fitted(self, decode: StepCost | None, prefill: StepCost | None) -> None:
        """Use these costs (a refit's, or a test's)."""
        self.decode, self.prefill = decode, prefill

    def budget(self, decoders: int) -> int | None:
        """The most prompt tokens the next step may take beside `decoders` decoding sequences; None:
        no bound (no decoders to protect, or no costs measured yet)."""
        self._steps += 1
        if self._steps >= self.refit_steps:
            self._steps = 0
            self.fitted(*fit_phases(self.profile.snapshot()))
        if decoders == 0 or self.decode is None or self.prefill is None:
            return None
        return prompt_budget(self.decode, self.prefill, decoders, self.target_s, self.floor)
