"""The cluster's Ray actors as every process sees them: the namespace they are named in, the
controller's name, and what a failed call to one says about it. The router, the workers and the
control plane all need these; they live here, below all three, and import Ray only (no torch)."""

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

NAMESPACE = "pdserve"  # every actor of a cluster: the controller, the routers, the workers
CONTROLLER = "pdserve-controller"  # the controller's name in NAMESPACE


def down_reason(error: BaseException) -> str | None:
    """Why a failed call to a replica means it is down, or None when it may only be slow."""
    if isinstance(error, ActorDiedError):
        return "its process died"
    if isinstance(error, ActorUnavailableError):  # its node died (Ray has not said so yet) or is cut off
        return "it is unreachable (its node died or is cut off)"
    if isinstance(error, ConnectionError):  # the direct channel to it closed (pdserve/channel/): it died or is cut off
        return f"its channel closed ({error})"
    if isinstance(error, RayTaskError):  # a worker's stats() raises only when its engine loop stopped
        return "its engine loop stopped"
    return None
