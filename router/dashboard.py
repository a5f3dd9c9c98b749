"""/dashboard: the live picture `pdserve status --watch` draws, as a page of charts, on every router's
HTTP port; /dashboard/data is its JSON.

The page (static/dashboard.html and .js, with uPlot vendored beside them: it works offline) polls
/dashboard/data every 2 s and keeps the history itself. The router keeps only the scrapes of the last
minute that the figures are computed over — cluster_view.py's Window, the same functions the terminal
view uses. The cluster's status comes from the controller (the named detached actor), as `pdserve status`
gets it. Without one — an app built in a test, or a controller that does not answer — the router
answers with what it knows itself: the replicas it polls and its own /metrics.
"""

import asyncio
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles

from pdserve import cluster_view
from pdserve.router.metrics import Metrics
from pdserve.router.types import ServingCore

STATIC = Path(__file__).parent / "static"
# One sample a second at most, however many pages poll: each asks the controller for its status (which
# asks every worker) and scrapes every router's /metrics.
SAMPLE_S = 1.0
STATUS_TIMEOUT_S = 10.0  # the controller's status waits up to 5 s for a replica that does not answer
LOOKUP_RETRY_S = 10.0  # no controller found: look again after this, not on every poll


@dataclass
class DashboardData:
    """One sample, as /dashboard/data answers it (times in seconds; the page shows ms)."""

    time: float  # Unix seconds: the page's x axis
    router: str  # the router that answered ("" in an app with no name)
    source: str  # "controller": the cluster's status; "router": this router's own view
    state: str  # the cluster's state ("running", "degraded", "draining", ...)
    replicas: list[cluster_view.ReplicaRow]
    routers: list[cluster_view.RouterRow]
    latency: cluster_view.Latency | None  # over the last minute; None until two samples were taken
    slo: dict = field(default_factory=dict)  # ttft_ms, tpot_ms (the config's slo:; {} without the controller)


class Dashboard:
    def __init__(self, core: ServingCore, metrics: Metrics):
        self.core, self.metrics = core, metrics
        self.window = cluster_view.Window()
        self.source = ""
        self._controller = None
        self._look_again_at = 0.0
        self._lock = asyncio.Lock()  # concurrent polls share one sample
        self._last: DashboardData | None = None

    async def data(self) -> DashboardData:
        async with self._lock:
            if self._last is None or time.time() - self._last.time >= SAMPLE_S:
                self._last = await self._sample()
            return self._last

    async def _sample(self) -> DashboardData:
        status = await self._cluster_status()
        source = "router" if status is None else "controller"
        if status is None:
            status = self._own_status()
            scrapes = {"": cluster_view.parse_metrics(self.metrics.render().decode())}
        else:  # every router's own /metrics (this one's too: over HTTP, which its loop answers meanwhile)
            scrapes = await asyncio.to_thread(cluster_view.scrape, cluster_view.router_urls(status))
        if source != self.source:  # the scrapes' keys change with the source: difference nothing across it
            self.window, self.source = cluster_view.Window(), source
        self.window.add(time.monotonic(), scrapes | cluster_view.replica_snapshots(status))
        return DashboardData(time.time(), self.metrics.router, source, status["state"],
                             cluster_view.replica_rows(status), cluster_view.router_rows(status),
                             self.window.latency(), status.get("slo") or {})

    async def _cluster_status(self) -> dict | None:
        """The controller's status(), or None when there is no controller or it does not answer."""
        ray = sys.modules.get("ray")  # a Router actor has it; an app that never imported Ray has no controller
        if ray is None or not ray.is_initialized():
            return None
        if self._controller is None:
            if time.monotonic() < self._look_again_at:
                return None
            self._look_again_at = time.monotonic() + LOOKUP_RETRY_S
            try:
                self._controller = await asyncio.to_thread(_find_controller)
            except Exception:  # none in this Ray cluster (yet)
                return None
        try:
            return await asyncio.wait_for(self._controller.status.remote(), timeout=STATUS_TIMEOUT_S)
        except Exception:  # stopped, restarting or slow: the router's own view this time, and look it up again
            self._controller = None
            return None

    def _own_status(self) -> dict:
        """What this router knows, in the shape of the controller's status. A RouterCore has the replicas'
        latest stats, their restarts and its streams; a core without them (LocalCore) shows none."""
        core = self.core
        replicas: dict = dict(getattr(core, "stats", {}))
        replicas |= core.degraded()  # down ("down: why") or draining
        routers = {}
        if self.metrics.router:
            in_flight = getattr(core, "in_flight", lambda: 0)()
            routers[self.metrics.router] = {"pid": os.getpid(), "in_flight": in_flight, "endpoints": {}}
        if getattr(core, "draining", False):
            state = "draining"
        elif core.ready() and not any(str(r).startswith("down") for r in replicas.values()):
            state = "running"
        else:
            state = "degraded"
        restarts = core.restarts() if hasattr(core, "restarts") else {}
        return {"state": state, "replicas": replicas, "routers": routers, "restarts": restarts, "slo": {}}


def _find_controller():
    import ray

    from pdserve.actors import CONTROLLER, NAMESPACE

    return ray.get_actor(CONTROLLER, namespace=NAMESPACE)


def add_dashboard(app: FastAPI, core: ServingCore, metrics: Metrics) -> None:
    """GET /dashboard (the page), /dashboard/data (its JSON), /dashboard/static/* (its scripts)."""
    board = Dashboard(core, metrics)

    @app.get("/dashboard", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "dashboard.html", headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/data")
    async def data() -> dict:
        """The cluster as the dashboard shows it: replicas, routers, latency over the last minute, slo."""
        return asdict(await board.data())

    app.mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")
