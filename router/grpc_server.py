"""The gRPC front end: service pdserve.v1.Completion over a ServingCore, with health and reflection.
With API keys configured a call carries one in its metadata (`authorization: Bearer <key>`), as
HTTP does in its header; health stays open (a probe carries no key), and reflection is off unless
router.grpc_reflection turns it on. Calls at once, keepalive and idle connections are bounded
(GrpcLimits). TLS where the
router has a certificate (router.tls_certfile)."""

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing, asynccontextmanager, contextmanager

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.protocol import MAX_CACHE_SALT_CHARS, InvalidRequestError, SamplingParams
from pdserve.structured_outputs import KINDS, GrammarTokenizer, grammar_of
from pdserve.router.grpc_gen.pdserve.v1 import completion_pb2 as pb
from pdserve.router.grpc_gen.pdserve.v1 import completion_pb2_grpc as pb_grpc
from pdserve.router import token_budget
from pdserve.router.listen import PortInUseError, check_free, holder
from pdserve.router.rate_limits import RateLimited
from pdserve.router.tenants import Charge, Tenant, Tenants, Unauthenticated
from pdserve.messages import Request, RequestDelta
from pdserve.router.choices import DEFAULT_MAX_N, Interleaved, check_n, child_params, close_all, each
from pdserve.router.types import NoCapacityError, OverloadedError, ServingCore, ServingError, off_loop

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Completion"].full_name  # "pdserve.v1.Completion"
DEFAULT_MAX_TOKENS = 16
HEALTH_POLL_S = 1.0
_background: set[asyncio.Task] = set()  # strong references: the loop keeps only weak ones


class ModelNotFoundError(LookupError):
    """The request names a model this service does not serve."""


class CompletionServicer(pb_grpc.CompletionServicer):
    def __init__(self, core: ServingCore, tenants: Tenants | None = None, max_n: int = DEFAULT_MAX_N):
        self.core = core
        self.tenants = tenants  # the API keys a call must carry, and their limits; None: open
        self.max_n = max_n  # router.max_n

    async def Complete(self, request: pb.CompletionRequest, context: grpc.aio.ServicerContext
                       ) -> pb.CompletionResponse:
        """Generate to the end; one response (with n > 1, every choice's)."""
        async with _errors_as_status(context):
            reqs, charge = await self._charged_requests(request, context)
            generated: list[int] = []
            with _settled(charge, generated):
                streams = [self.core.generate(r) for r in reqs]
                try:
                    got = await each(streams, whole=True, on_delta=lambda d: generated.extend(d.token_ids))
                finally:
                    await close_all(streams)
            choices = [pb.Choice(index=i, text="".join(d.text for d in ds), token_ids=[t for d in ds for t in d.token_ids],
                                 finish_reason=ds[-1].finish_reason or "", **_stop_reason(ds[-1]))
                       for i, ds in enumerate(got)]
            first = choices[0]
            return pb.CompletionResponse(id=reqs[0].request_id.rsplit("-", 1)[0] if len(reqs) > 1 else reqs[0].request_id,
                                         text=first.text, token_ids=first.token_ids, finish_reason=first.finish_reason,
                                         usage=_usage(reqs[0], len(generated)), choices=choices,
                                         **_stop_reason(got[0][-1]))

    async def CompleteStream(self, request: pb.CompletionRequest, context: grpc.aio.ServicerContext
                             ) -> None:
        """Stream one chunk per wake of a choice: a delta, with those the core already held after it
        (RequestDelta.more) joined into it; usage on the last."""
        # context.write rather than an async-generator handler: a client's cancel then lands on an
        # await inside the `aclosing` block, so the core's generator (and the request) is closed
        # right away instead of whenever the handler generator is garbage-collected.
        async with _errors_as_status(context):
            reqs, charge = await self._charged_requests(request, context)
            generated: list[int] = []  # every token so far, of every choice (what the key is charged)
            if len(reqs) > 1:
                with _settled(charge, generated):
                    await self._stream_choices(reqs, context, generated)
                return
            req = reqs[0]
            text, token_ids = [], []
            with _settled(charge, generated):
                async with aclosing(self.core.generate(req)) as deltas:
                    try:
                        async for delta in deltas:
                            generated += delta.token_ids
                            text.append(delta.text)
                            token_ids += delta.token_ids
                            if delta.more and delta.finish_reason is None:
                                continue
                            await context.write(self._chunk(req, "".join(text), token_ids, delta, len(generated)))
                            text, token_ids = [], []
                    except Exception:
                        if token_ids:  # what was held for the next write goes out before the error status
                            await context.write(self._chunk(req, "".join(text), token_ids, None, len(generated)))
                        raise

    async def _stream_choices(self, reqs: list[Request], context: grpc.aio.ServicerContext,
                              generated: list[int]) -> None:
        """n > 1: every choice's deltas as they come, each chunk with its choice's index; usage on the
        last chunk of all."""
        deltas = Interleaved([self.core.generate(r) for r in reqs])
        try:
            while not deltas.finished:
                wake = await deltas.wake()
                for i, (k, d) in enumerate(wake):
                    generated += d.token_ids
                    last = deltas.finished and i == len(wake) - 1
                    chunk = self._chunk(reqs[k], d.text, d.token_ids, d, len(generated) if last else None)
                    chunk.index, chunk.id = k, reqs[k].request_id.rsplit("-", 1)[0]
                    await context.write(chunk)
        finally:
            await deltas.aclose()

    async def _charged_requests(self, request: pb.CompletionRequest, context: grpc.aio.ServicerContext,
                                ) -> tuple[list[Request], Charge | None]:
        """The request's choices (one, or n), checked, and charged to its API key where keys are
        configured: admitted under the key before its prompt is tokenized (Tenants.admit), its
        tokens charged once counted."""
        tenant = charge = None
        if self.tenants is not None:
            authorization = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None)
            tenant = self.tenants.authenticate(authorization if isinstance(authorization, str) else None)
            charge = self.tenants.admit(tenant)
        try:
            req = await self._generate_request(request, tenant)
            n = request.n or 1
            check_n(n, n, self.max_n)
            reqs = [req] if n == 1 else [dataclasses.replace(req, request_id=f"{req.request_id}-{j}",
                                                             params=child_params(req.params, j)) for j in range(n)]
            if charge is not None:
                charge.tokens(len(req.prompt_ids), req.params.max_tokens * n)
        except BaseException:
            if charge is not None:
                charge.cancel()
            raise
        return reqs, charge

    async def _generate_request(self, request: pb.CompletionRequest, tenant: Tenant | None) -> Request:
        """tenant: the call's API key (None: open), which bounds its priority and salts its prefix cache."""
        if request.model and request.model != self.core.model_name:
            raise ModelNotFoundError(
                f"model: {request.model!r} is not served here; this service serves {self.core.model_name!r}")
        if not request.prompt:
            raise InvalidRequestError("prompt", "must not be empty")
        prompt_ids = await off_loop(self.core.tokenize, request.prompt)
        # The HTTP API's rule: checked here, in front of a replica pick and a KV reservation.
        max_tokens = token_budget.max_tokens(request.max_tokens or None, "max_tokens", DEFAULT_MAX_TOKENS,
                                       len(prompt_ids), self.core.max_model_len)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=request.temperature if request.HasField("temperature") else 1.0,
            top_p=request.top_p if request.HasField("top_p") else 1.0,
            top_k=request.top_k,
            seed=request.seed if request.HasField("seed") else None,
            stop=list(request.stop),
            ignore_eos=request.ignore_eos,
            min_p=request.min_p,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty if request.HasField("repetition_penalty") else 1.0,
            logit_bias=dict(request.logit_bias),
            min_tokens=request.min_tokens,
            stop_token_ids=list(request.stop_token_ids),
            cache_salt=_cache_salt(request, tenant),
            # (Off the loop, as the HTTP API's: a large schema's check takes a fraction of a second.)
            grammar=(await off_loop(_grammar, request, self.core.grammar_tokenizer)
                     if request.HasField("structured_outputs") else None),
        )
        asked = request.priority if request.HasField("priority") else None
        priority = (asked or 0) if tenant is None else tenant.priority_of(asked)
        return Request(f"grpc-{uuid.uuid4().hex}", prompt_ids, params, priority=priority)

    @staticmethod
    def _chunk(req: Request, text: str, token_ids: list[int], delta: RequestDelta | None,
               num_tokens: int | None) -> pb.CompletionChunk:
        """num_tokens: the usage to report (the stream's last chunk), else None."""
        finish_reason = delta.finish_reason if delta is not None else None
        chunk = pb.CompletionChunk(id=req.request_id, text=text, token_ids=token_ids, finish_reason=finish_reason or "")
        if finish_reason is not None:
            chunk.MergeFrom(pb.CompletionChunk(**_stop_reason(delta)))
            if num_tokens is not None:
                chunk.usage.CopyFrom(_usage(req, num_tokens))
        return chunk


def _cache_salt(request: pb.CompletionRequest, tenant: Tenant | None) -> str | None:
    """The call's prefix-cache salt: its key's with its own `cache_salt` (Tenant.cache_salt), or its own alone."""
    asked = request.cache_salt if request.HasField("cache_salt") else None
    if asked is not None and not 0 < len(asked) <= MAX_CACHE_SALT_CHARS:
        raise InvalidRequestError("cache_salt", f"must be 1 to {MAX_CACHE_SALT_CHARS} characters, got {len(asked)}")
    return asked if tenant is None else tenant.cache_salt(asked)


def _stop_reason(delta: RequestDelta) -> dict:
    """The oneof stop_reason's field of a finished choice: its stop string or stop token id, if either ended it."""
    r = delta.stop_reason
    if r is None:
        return {}
    return {"stop_string": r} if isinstance(r, str) else {"stop_token_id": r}


def _usage(req: Request, num_tokens: int) -> pb.Usage:
    return pb.Usage(prompt_tokens=len(req.prompt_ids), completion_tokens=num_tokens)


@contextmanager
def _settled(charge: Charge | None, generated: list[int]) -> Iterator[None]:
    """Settle the call's charge under its key once it ends, however it ends (`generated`: its tokens,
    filled in meanwhile)."""
    if charge is None:
        yield
        return
    outcome = "error"
    try:
        yield
        outcome = "ok"
    except asyncio.CancelledError:  # the client cancelled, or went away
        outcome = "aborted"
        raise
    except Exception:
        outcome = "error" if generated else "refused"
        raise
    finally:
        charge.end(len(generated), outcome)


@asynccontextmanager
async def _errors_as_status(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """Turn the errors a request can meet into gRPC status codes (context.abort raises)."""
    try:
        yield
    except Unauthenticated as e:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))
    except RateLimited as e:
        # The wait in trailing metadata: `retry-after` (seconds, as HTTP's header) and gRFC A6's pushback.
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), trailing_metadata=(
            ("retry-after", e.headers["Retry-After"]), ("grpc-retry-pushback-ms", str(int(e.retry_after_s * 1000)))))
    except InvalidRequestError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    except ModelNotFoundError as e:
        await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
    except OverloadedError as e:  # HTTP's 429: the same seconds in `retry-after`, and as gRFC A6's pushback
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), trailing_metadata=(
            ("retry-after", str(e.retry_after)), ("grpc-retry-pushback-ms", str(e.retry_after * 1000))))
    except NoCapacityError as e:
        # gRFC A6 retry pushback: a client with a retry policy waits this long before retrying.
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(e),
                            trailing_metadata=(("grpc-retry-pushback-ms", str(int(e.retry_after_s * 1000))),))
    except ServingError as e:
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
    except (grpc.aio.AbortError, asyncio.CancelledError):
        raise  # context.abort's own exception; a client's cancel
    except Exception:
        # Never a Python class name or traceback to the client: those are the router's log's.
        log.exception("unexpected error serving a gRPC request")
        await context.abort(grpc.StatusCode.INTERNAL, "internal error in the router; its log has the details")


async def _set_health(core: ServingCore, servicer: health.aio.HealthServicer) -> None:
    status = (health_pb2.HealthCheckResponse.SERVING if core.ready()
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for service in ("", SERVICE_NAME):  # "" is the whole server, by the health protocol
        await servicer.set(service, status)


async def _track_health(core: ServingCore, server: grpc.aio.Server, servicer: health.aio.HealthServicer,
                        ) -> None:
    """Mirror core.ready() into the health service (Check and Watch) until the server stops."""
    # wait_for_termination doubles as the poll's sleep: it returns False (no timeout) once stopped.
    while await server.wait_for_termination(timeout=HEALTH_POLL_S):
        await _set_health(core, servicer)


@dataclasses.dataclass(frozen=True)
class GrpcLimits:
    """What the gRPC server sheds (router.grpc_* keys, pdserve/config.py), and whether it serves reflection."""

    max_concurrent_rpcs: int = 2048
    keepalive_s: float = 60.0
    max_idle_s: float = 600.0
    reflection: bool = True

    @classmethod
    def of(cls, router, tenants: Tenants | None) -> "GrpcLimits":
        """From RouterConfig; reflection unset: served only without keys (it maps the API to anyone)."""
        reflection = tenants is None if router.grpc_reflection is None else router.grpc_reflection
        return cls(router.grpc_max_concurrent_rpcs, router.grpc_keepalive_s, router.grpc_max_idle_s, reflection)

    def options(self) -> list[tuple[str, int]]:
        """The server's channel arguments: keepalive pings of idle connections (an unanswered one
        closes it after KEEPALIVE_TIMEOUT_S), client pings no more often than MIN_CLIENT_PING_S (a ping
        flood is answered with GOAWAY), idle connections closed."""
        return [("grpc.keepalive_time_ms", int(self.keepalive_s * 1000)),
                ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_S * 1000),
                ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_S * 1000),
                ("grpc.http2.max_ping_strikes", 2),
                ("grpc.max_connection_idle_ms", int(self.max_idle_s * 1000))]


KEEPALIVE_TIMEOUT_S = 20
MIN_CLIENT_PING_S = 10


async def start_grpc_server(core: ServingCore, port: int, host: str = "0.0.0.0", shared: bool = False,
                            first: bool = True, tenants: Tenants | None = None,
                            credentials: grpc.ServerCredentials | None = None,
                            max_n: int = DEFAULT_MAX_N, limits: GrpcLimits = GrpcLimits()) -> grpc.aio.Server:
    """Start serving pdserve.v1.Completion, health and reflection on host:port (0: any free port,
    then `server.port` says which); the caller stops it. Raises PortInUseError when it is taken.
    shared: one of several routers on this port (SO_REUSEPORT); the first checks it is free.
    tenants: the API keys a call must carry (None: open); credentials: TLS (tls.grpc_credentials);
    max_n: router.max_n; limits: concurrency, keepalive and reflection (GrpcLimits.of)."""
    if shared and first:
        check_free(host, port, "router.grpc_port")  # see listen.claim_shared
    # SO_REUSEPORT only where routers share the port: else a port already taken (say, by a stale
    # router) fails here instead of silently splitting the connections between the two servers.
    server = grpc.aio.server(options=[("grpc.so_reuseport", int(shared)), *limits.options()],
                             maximum_concurrent_rpcs=limits.max_concurrent_rpcs)
    pb_grpc.add_CompletionServicer_to_server(CompletionServicer(core, tenants, max_n), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if limits.reflection:
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        # the port taken: `port`, or a free one for 0
        server.port = (server.add_secure_port(address, credentials) if credentials is not None
                       else server.add_insecure_port(address))
    except RuntimeError:
        raise PortInUseError(f"router.grpc_port: cannot listen on {address}; {holder(port)}. Stop it, or set "
                             f"router.grpc_port to a free port (0 takes any, null turns gRPC off)") from None
    await _set_health(core, health_servicer)
    await server.start()
    task = asyncio.create_task(_track_health(core, server, health_servicer))
    _background.add(task)
    task.add_done_callback(_background.discard)
    return server


def _grammar(request: pb.CompletionRequest, tokenizer: GrammarTokenizer) -> str | None:
    """The request's structured_outputs as a grammar, checked against the model's tokenizer too
    (InvalidRequestError names the field)."""
    if not request.HasField("structured_outputs"):
        return None
    so = request.structured_outputs
    kind = so.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError("structured_outputs", f"must set one of {', '.join(KINDS)}")
    spec = list(so.choice.values) if kind == "choice" else getattr(so, kind)
    return grammar_of(f"structured_outputs.{kind}", kind, spec, tokenizer)
