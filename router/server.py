"""The router (a Ray actor): HTTP and gRPC front ends over the request lifecycle in one asyncio loop."""

import asyncio
import os

import ray
import uvicorn

from pdserve.config import ClusterConfig
from pdserve.models import resolve_model_args
from pdserve.tokenizer import load_tokenizer
from pdserve.messages import RequestDelta

from pdserve.router.decode_replica import DecodeReplica
from pdserve.router.http_api import build_app
from pdserve.router.listen import bind_listener, claim_shared
from pdserve.router.metrics import Metrics
from pdserve.router.ray_core import RayCore


class Router:
    def __init__(self, name: str, config: ClusterConfig, prefill: list[str], decode: dict[str, list[str]],
                 colocated: list[str], namespace: str):
        """decode: each decode replica's ranks (actor names): itself, or its expert-parallel group.
        A cluster has prefill and decode replicas, or colocated ones only."""
        self.name = name
        self.config = config
        self.replica_names = (prefill, decode, colocated)
        self.namespace = namespace
        self.core: RayCore | None = None
        self._tasks: list[asyncio.Task] = []
        self.endpoints: dict[str, str] = {}

    async def start(self, shared: bool = False, http_port: int | None = None,
                    grpc_port: int | None = None) -> dict[str, str]:
        """Serve HTTP (and gRPC); returns the endpoints once both listen.

        shared: one of several routers serving the same ports (router.replicas > 1). The first is
        started with no ports and claims the configured ones; the others are given the ports it
        got. Each shared router also listens on a port of its own ("own" endpoint): the same API,
        reached on this router only, which is how its /metrics and /health are read."""
        cfg = self.config
        host = cfg.router.host
        # Bound first and here, not by uvicorn: a taken port raises at once, naming it (PortInUseError).
        if not shared:
            sockets = [bind_listener(host, cfg.router.http_port, "router.http_port")]
        elif http_port is None:
            sockets = [claim_shared(host, cfg.router.http_port, "router.http_port")]
        else:
            sockets = [bind_listener(host, http_port, "router.http_port", shared=True)]
        if shared:
            sockets.append(bind_listener(host, 0, "router.http_port"))
        args = resolve_model_args(cfg.model.path)
        tokenizer = load_tokenizer(cfg.model.path, eos_token_ids=args.eos_token_ids)
        max_len = min(cfg.model.max_model_len or args.max_position_embeddings, args.max_position_embeddings)
        prefill_names, ranks, colocated_names = self.replica_names
        prefill = {n: self._actor(n) for n in prefill_names}
        decode = {d: DecodeReplica(d, {r: self._actor(r) for r in rs}) for d, rs in ranks.items()}
        colocated = {n: self._actor(n) for n in colocated_names}
        self.metrics = Metrics(self.name)
        self.core = RayCore(self.name, cfg.model.path, max_len, tokenizer, prefill, decode, colocated,
                            cfg.router.policy, self.metrics)
        self._tasks.append(asyncio.create_task(self.core.refresh_stats()))
        http = uvicorn.Config(build_app(self.core, self.metrics, cfg.router.max_request_bytes), log_level="warning", lifespan="off")
        self.http = uvicorn.Server(http)
        self._tasks.append(asyncio.create_task(self.http.serve(sockets=sockets)))
        while not self.http.started:
            if self._tasks[-1].done():
                self._tasks[-1].result()
                raise RuntimeError(f"the HTTP server on {host}:{sockets[0].getsockname()[1]} did not start")
            await asyncio.sleep(0.05)
        endpoints = {"http": f"http://{host}:{sockets[0].getsockname()[1]}"}
        if shared:
            endpoints["own"] = f"http://{host}:{sockets[1].getsockname()[1]}"
        self.grpc = None
        if cfg.router.grpc_port is not None:
            from pdserve.router.grpc_server import start_grpc_server  # the `grpc` extra: only where asked for

            port = cfg.router.grpc_port if grpc_port is None else grpc_port
            self.grpc = await start_grpc_server(self.core, port, host, shared=shared, first=grpc_port is None)
            endpoints["grpc"] = f"{host}:{self.grpc.port}"
        self.endpoints = endpoints
        return endpoints

    def info(self) -> dict:
        """This router's process and own endpoints, and the requests it streams now."""
        return {"name": self.name, "pid": os.getpid(), "endpoints": dict(self.endpoints),
                "in_flight": self.core.in_flight() if self.core else 0}

    def _actor(self, name: str):
        return ray.get_actor(name, namespace=self.namespace)

    async def deliver(self, deltas: list[RequestDelta]) -> None:
        """One decode (or colocated) step's output for requests this router streams."""
        self.core.deliver(deltas)

    async def stop(self) -> None:
        if self.grpc is not None:
            await self.grpc.stop(grace=1)
        self.http.should_exit = True
        for t in self._tasks:
            t.cancel()

