"""The router (a Ray actor): HTTP and gRPC front ends over the request lifecycle in one asyncio loop."""

import asyncio
import importlib
import os
import sys
import threading

import uvicorn

from pdserve.config import ClusterConfig, RouterConfig
from pdserve.models import resolve_model_args
from pdserve.tokenizer import load_tokenizer
from pdserve.messages import ReplicaChange, RequestDelta

from pdserve import heap
from pdserve.priority import serve_now
from pdserve.router.admission import AdmissionPolicy
from pdserve.router.http_api import build_app
from pdserve.router.http_deadlines import deadlined_protocol
from pdserve.router import loop_lag
from pdserve.router.listen import bind_listener, claim_shared
from pdserve.router.metrics import Metrics
from pdserve.router.core import RouterCore
from pdserve.router.replica_set import Channel
from pdserve.router.prefill_site import PrefillSite
from pdserve.router.tenants import ApiKey, Tenants
from pdserve.router.tls import grpc_credentials, uvicorn_options
from pdserve.router.types import limit_tokenize_queue


MEET_S = 10.0  # the workers a router introduces itself to answer within this (RouterStreams.meet)


async def _quietly(ref) -> None:
    """Await a Ray call whose failure is no one's concern here (a worker that died: the watch's)."""
    try:
        await ref
    except Exception:
        pass


def _import_all(modules: list[str]) -> None:
    """Import each module; one that fails is left to fail where it is needed, with Ray's own error."""
    for m in modules:
        try:
            importlib.import_module(m)
        except Exception:
            pass


def http_config(app, tls: dict | None = None, router: RouterConfig | None = None,
                metrics: Metrics | None = None) -> uvicorn.Config:
    """How a router serves its HTTP app: uvicorn (with httptools, its C parser, under the slow
    clients' deadlines and the connection cap of `router`: http_deadlines.py), no lifespan, and no
    access log: at log level warning uvicorn writes none, but without this it still gathers each
    request's address and path for it. tls: uvicorn's ssl_* arguments (tls.uvicorn_options)."""
    router = router or RouterConfig()
    protocol = deadlined_protocol(router.header_timeout_s, router.body_timeout_s, router.sse_write_timeout_s,
                                  router.max_connections, metrics.count_connection_cut if metrics else None)
    return uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False, http=protocol,
                          timeout_keep_alive=router.http_keep_alive_s, **(tls or {}))


class Router:
    def __init__(self, name: str, config: ClusterConfig, replicas: list[ReplicaChange], namespace: str,
                 api_keys: list[ApiKey] | None = None, preload: list[str] = (), cluster_token: str | None = None):
        """replicas: every replica as it is now (prefill and decode ones, colocated ones, or all three);
        the controller sends each later change (`apply`). api_keys: the keys every request must
        carry (`pdserve up` read them); none: the service is open. preload: modules to import now on
        a thread of their own, before they are needed (the controller gives none: the workers'
        handles are of pdserve/worker/flip.py's torch-free actor). cluster_token: what the router
        proves to workers over the direct channel."""
        serve_now()  # Ray started this process at nice 15: its loop streams every token (pdserve/priority.py)
        self.preloaded = threading.Thread(target=_import_all, args=(list(preload),), name="pdserve-preload",
                                          daemon=True)
        self.preloaded.start()
        self.cluster_token = cluster_token
        self.name = name
        self.api_keys = api_keys or []
        self.config = config
        self.replicas = replicas
        self.namespace = namespace
        self.core: RouterCore | None = None
        self._router_restarts: dict[str, int] = {}
        self._tasks: list[asyncio.Task] = []
        self.endpoints: dict[str, str] = {}

    async def start(self, shared: bool = False, http_port: int | None = None,
                    grpc_port: int | None = None, replicas: list[ReplicaChange] | None = None) -> dict[str, str]:
        """Serve HTTP (and gRPC); returns the endpoints once both listen. `replicas`: every replica
        as it is now, where the router was made before they were ready (its process starts while
        the workers load).

        shared: one of several routers serving the same ports (router.replicas > 1). The first is
        started with no ports and claims the configured ones; the others (and any router that
        replaces one) are given the ports it got. Each shared router also listens on a port of its
        own ("own" endpoint): the same API, reached on this router only, which is how its /metrics
        and /health are read."""
        cfg = self.config
        host = cfg.router.host
        if replicas is not None:
            self.replicas = replicas
        # Bound first and here, not by uvicorn: a taken port raises at once, naming it (PortInUseError).
        if not shared:
            port = cfg.router.http_port if http_port is None else http_port
            sockets = [bind_listener(host, port, "router.http_port")]
        elif http_port is None:
            sockets = [claim_shared(host, cfg.router.http_port, "router.http_port")]
        else:
            sockets = [bind_listener(host, http_port, "router.http_port", shared=True)]
        if shared:
            sockets.append(bind_listener(host, 0, "router.http_port"))
        args = resolve_model_args(cfg.model.path)
        tokenizer = load_tokenizer(cfg.model.path, eos_token_ids=args.eos_token_ids)
        max_len = min(cfg.model.max_model_len or args.max_position_embeddings, args.max_position_embeddings)
        served = cfg.model.served_name or cfg.model.path
        self.metrics = Metrics(self.name, served)
        self.core = RouterCore(self.name, served, max_len, tokenizer, self.replicas, cfg.router.policy,
                            self.metrics, cfg.router.migration_limit, cfg.router.replica_wait_s,
                            AdmissionPolicy.of(cfg), cfg.kv_transfer.block_size, PrefillSite.of(cfg),
                            self._channel())
        await self._meet(self.replicas)  # (their empty deliver reaches the core: after it is built)
        self._tasks.append(asyncio.create_task(self.core.refresh_stats()))
        self._tasks.append(asyncio.create_task(loop_lag.watch(self.metrics.loop_lag.observe,
                                                              self.core.lifecycle.activity.until_busy)))
        # Each router enforces its share of a key's limits: the kernel spreads connections evenly over them.
        tenants = Tenants(self.api_keys, cfg.router.replicas, self.metrics) if self.api_keys else None
        tls = uvicorn_options(cfg.router.tls_certfile, cfg.router.tls_keyfile)
        limit_tokenize_queue(cfg.router.max_tokenize_queue)
        app = build_app(self.core, self.metrics, cfg.router.max_request_bytes, tenants, cfg.router.max_n,
                        cfg.router.openapi_docs, cfg.router.tool_call_parser)
        self.http = uvicorn.Server(http_config(app, tls, cfg.router, self.metrics))
        self._tasks.append(asyncio.create_task(self.http.serve(sockets=sockets)))
        while not self.http.started:
            if self._tasks[-1].done():
                self._tasks[-1].result()
                raise RuntimeError(f"the HTTP server on {host}:{sockets[0].getsockname()[1]} did not start")
            await asyncio.sleep(0.05)
        scheme = "https" if tls else "http"
        endpoints = {"http": f"{scheme}://{host}:{sockets[0].getsockname()[1]}"}
        if shared:
            endpoints["own"] = f"{scheme}://{host}:{sockets[1].getsockname()[1]}"
        self.grpc = None
        if cfg.router.grpc_port is not None:
            from pdserve.router.grpc_server import GrpcLimits, start_grpc_server  # the `grpc` extra: only where asked for

            port = cfg.router.grpc_port if grpc_port is None else grpc_port
            self.grpc = await start_grpc_server(self.core, port, host, shared=shared, first=grpc_port is None,
                                                tenants=tenants, credentials=grpc_credentials(
                                                    cfg.router.tls_certfile, cfg.router.tls_keyfile),
                                                max_n=cfg.router.max_n, limits=GrpcLimits.of(cfg.router, tenants))
            endpoints["grpc"] = f"{host}:{self.grpc.port}"
        self.endpoints = endpoints
        heap.settle()  # everything built: the collector leaves it be (heap.py)
        return endpoints

    def _channel(self) -> Channel | None:
        if self.config.router.channel != "direct":
            return None
        import ray  # (imported already: this is a Ray actor)

        tcp_only = self.config.router.channel_transport == "tcp"  # (no worker counts as on this host)
        return Channel(self.cluster_token, None if tcp_only else ray.util.get_node_ip_address())

    def imported(self, prefix: str) -> list[str]:
        """The modules this router's process has imported whose names start with `prefix` (a router
        imports no torch and no engine: tests ask)."""
        return sorted(m for m in sys.modules if m == prefix or m.startswith(prefix + "."))

    def info(self) -> dict:
        """This router's process and own endpoints, the requests it streams now, and its traffic so
        far (Metrics.traffic: what the planner reads)."""
        return {"name": self.name, "pid": os.getpid(), "endpoints": dict(self.endpoints),
                "in_flight": self.core.in_flight() if self.core else 0, "traffic": self.metrics.traffic()}

    async def apply(self, change: ReplicaChange) -> None:
        """A replica started, was replaced, drains or is gone (the controller's word)."""
        if self.core is None:  # not started yet: it starts from the set as changed
            self.replicas = [r for r in self.replicas if r.replica != change.replica] + [change]
        elif self.core.replicas.channel is not None:  # (its links are made by the change; calls wait for them)
            self.core.apply(change)
            if change.state == "serving":
                await self._meet([change])
        else:
            if change.state == "serving":
                await self._meet([change])  # before any request goes there
            self.core.apply(change)

    async def _meet(self, changes: list[ReplicaChange]) -> None:
        """Introduce this router to the workers that will stream tokens to it (decode and colocated
        ranks; RouterStreams.meet), and wait for them, at most MEET_S: else the first request's first
        token on each paid for Ray's lookup of this router and the first connection to it."""
        if self.core.replicas.channel is not None:  # the direct channel: connect to every worker now
            await self.core.replicas.connect([w for c in changes if c.state == "serving" for w in c.ranks], MEET_S)
            return
        refs = [w.meet_router.remote(self.name) for c in changes if c.role in ("decode", "colocated")
                and c.state == "serving" for w in c.ranks.values()]
        if refs:
            await asyncio.wait([asyncio.ensure_future(_quietly(r)) for r in refs], timeout=MEET_S)

    def routers_restarted(self, restarts: dict[str, int]) -> None:
        """Restarts of each router (by slot, pdserve-router-i) so far, for /metrics (the controller's count)."""
        for slot, n in restarts.items():
            seen = self._router_restarts.get(slot, 0)
            if n > seen:
                self.metrics.count_restarts("router", slot, n - seen)
                self._router_restarts[slot] = n

    def pairing_failures(self, counts: dict[str, int]) -> None:
        """The controller's count of failed KV pairings so far, by reason, for /metrics."""
        if self.core is not None:  # (a router starting now is told once it serves)
            self.metrics.set_pairing_failures(counts)

    def placed(self, replica: str) -> int:
        """This router's requests on the replica now (a drain waits for none)."""
        return self.core.placed(replica) if self.core else 0

    def drain(self) -> None:
        """The cluster shuts down: no new requests (503, /health 503); those in flight go on."""
        if self.core is not None:
            self.core.draining = True

    async def deliver(self, deltas: list[RequestDelta]) -> None:
        """One decode (or colocated) step's output for requests this router streams."""
        self.core.deliver(deltas)

    async def stop(self) -> None:
        if self.grpc is not None:
            await self.grpc.stop(grace=1)
        self.http.should_exit = True
        for t in self._tasks:
            t.cancel()

