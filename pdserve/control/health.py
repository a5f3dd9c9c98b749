"""How the controller tells a live replica or router from a dead one: a heartbeat (the worker's
`stats`, a router's `info`) every PROBE_INTERVAL_S. Dead: its process died (Ray says so), its
engine loop stopped (its stats raise), or it left MISSED_LIMIT heartbeats in a row unanswered (hung:
it is killed and replaced like a dead one)."""

import ray

from pdserve.actors import down_reason

PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 5.0
MISSED_LIMIT = 3


class Heartbeats:
    def __init__(self):
        self._missed: dict[str, int] = {}

    def probe(self, targets: dict[str, list]) -> tuple[dict[str, object], dict[str, str]]:
        """targets: name -> the calls (ObjectRefs) that answer for it, one per worker. Returns
        (name -> its answers, for those that answered; name -> why it is dead)."""
        refs = {ref: name for name, calls in targets.items() for ref in calls}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=PROBE_TIMEOUT_S) if refs else ([], [])
        ready = set(ready)
        answers: dict[str, list] = {}
        dead: dict[str, str] = {}
        for name, calls in targets.items():
            if not all(ref in ready for ref in calls):
                self._missed[name] = self._missed.get(name, 0) + 1
                if self._missed[name] >= MISSED_LIMIT:
                    dead[name] = f"no answer to {MISSED_LIMIT} heartbeats in a row"
                # A worker that died answers at once with an error: look at those that did answer.
                for ref in calls:
                    if ref in ready and (why := _failure(ref)):
                        dead[name] = why
                continue
            try:
                answers[name] = ray.get(calls)
                self._missed[name] = 0
            except Exception as e:
                dead[name] = down_reason(e) or f"its heartbeat failed: {type(e).__name__}"
        for name in dead:
            self._missed.pop(name, None)
        return answers, dead

    def forget(self, name: str) -> None:
        self._missed.pop(name, None)


def _failure(ref) -> str | None:
    try:
        ray.get(ref, timeout=0)
    except Exception as e:
        return down_reason(e) or f"its heartbeat failed: {type(e).__name__}"
    return None
