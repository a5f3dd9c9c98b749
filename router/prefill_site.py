"""Where an attempt's prompt is computed in a disaggregated cluster: on a prefill replica (remote:
its KV then moves to the decode replica), or on the decode replica that will decode it (local: that
replica's steps mix the prompt's chunks with its decoding sequences'; no KV moves).

The rule, with router.local_prefill_tokens N:
- local while no prefill replica can take the attempt — every one down, draining, or paired with
  no live decode worker — rather than waiting for one (why: "no_prefill");
- local when the prompt tokens it leaves to compute (a moved request's tokens so far included)
  are at most N: a short prompt costs a decode step little, and its KV's trip more (why: "short");
- remote otherwise.
Only a decode replica of one worker takes a local prefill (an expert-parallel group's ranks step in
lockstep; none is chosen there yet).
"""

from dataclasses import dataclass

REMOTE, LOCAL = "remote", "local"


@dataclass(frozen=True)
class PrefillSite:
    local_tokens: int = 0  # router.local_prefill_tokens

    def choose(self, tokens: int, prefill_can_take: bool) -> tuple[str, str]:
        """(site, why) for an attempt leaving `tokens` prompt tokens to compute."""
        if not prefill_can_take:
            return LOCAL, "no_prefill"
        if tokens <= self.local_tokens:
            return LOCAL, "short"
        return REMOTE, "long"
