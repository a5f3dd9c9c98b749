"""The gRPC front end over a real engine (LocalCore on tiny-moe), called through the generated stubs.

The server runs in its own thread's asyncio loop, as it will inside the router actor; the tests
are plain synchronous gRPC clients.
"""

import asyncio
import threading
import time

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.protocol import SamplingParams
from pdserve.router.grpc_gen.pdserve.v1 import completion_pb2 as pb
from pdserve.router.grpc_gen.pdserve.v1 import completion_pb2_grpc as pb_grpc
from pdserve.router.grpc_server import SERVICE_NAME, start_grpc_server
from local_core import LocalCore
from pdserve.router.types import NoCapacityError, OverloadedError, ReplicaUnavailableError, ServingError

PROMPT = "Once upon a time"
NUM_BLOCKS = 256
GREEDY = dict(max_tokens=24, temperature=0.0, ignore_eos=True)


class LoopThread:
    """An asyncio loop in a daemon thread: where the server lives, as in the router actor."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def loop():
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="module")
def served(loop):
    """(engine, reference completion, stub, channel) with a server over LocalCore(engine)."""
    engine = Engine(EngineConfig(model=ModelConfig(path="tiny-moe"), num_kv_blocks=NUM_BLOCKS))
    # Before LocalCore's thread starts stepping the engine: it is not thread-safe.
    reference = engine.generate([PROMPT], SamplingParams(**GREEDY))[0]
    core = LocalCore(engine, model_name="tiny-moe")
    server = loop.run(start_grpc_server(core, 0, host="127.0.0.1"))  # any free port: server.port
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield engine, reference, pb_grpc.CompletionStub(channel), channel
    channel.close()
    loop.run(server.stop(None))
    core.close()


def wait_idle(engine: Engine, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (engine.pool.num_free_blocks != NUM_BLOCKS or engine.seqs) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.pool.num_free_blocks == NUM_BLOCKS and not engine.seqs, "request not aborted"


def test_unary_equals_engine_generate(served):
    engine, reference, stub, _ = served
    resp = stub.Complete(pb.CompletionRequest(prompt=PROMPT, **GREEDY), timeout=30)
    assert resp.text == reference.text
    assert list(resp.token_ids) == reference.token_ids
    assert resp.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(engine.tokenizer.encode(PROMPT))
    assert resp.usage.completion_tokens == GREEDY["max_tokens"]
    assert resp.id.startswith("grpc-") and len(resp.id) == len("grpc-") + 32
    wait_idle(engine)


def test_stream_equals_unary(served):
    engine, reference, stub, _ = served
    chunks = list(stub.CompleteStream(pb.CompletionRequest(prompt=PROMPT, **GREEDY), timeout=30))
    assert "".join(c.text for c in chunks) == reference.text
    assert [t for c in chunks for t in c.token_ids] == reference.token_ids
    assert len({c.id for c in chunks}) == 1
    *running, last = chunks
    assert all(not c.finish_reason and not c.HasField("usage") for c in running)
    assert last.finish_reason == "length"
    assert last.usage.completion_tokens == GREEDY["max_tokens"]
    assert last.usage.prompt_tokens == len(engine.tokenizer.encode(PROMPT))


def test_defaults_and_stop_string(served):
    engine, reference, stub, _ = served
    resp = stub.Complete(pb.CompletionRequest(prompt=PROMPT, temperature=0, ignore_eos=True), timeout=30)
    assert resp.usage.completion_tokens == 16  # max_tokens unset: the default
    stop = reference.text[-3:]
    assert stop, "the reference generated no text"
    resp = stub.Complete(pb.CompletionRequest(prompt=PROMPT, stop=[stop], model="tiny-moe", **GREEDY),
                         timeout=30)
    assert resp.finish_reason == "stop"
    assert resp.text == reference.text[:reference.text.index(stop)]


BAD = [
    (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (dict(prompt="x " * 5000), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (dict(temperature=-0.5), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (dict(temperature=float("nan")), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (dict(top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (dict(top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (dict(stop=["ok", ""]), grpc.StatusCode.INVALID_ARGUMENT, "stop"),
    (dict(model="gpt-4"), grpc.StatusCode.NOT_FOUND, "model"),
    # The HTTP API's rules: max_tokens within the context, bounded stop strings.
    (dict(max_tokens=5000), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (dict(stop=["x"] * 1000), grpc.StatusCode.INVALID_ARGUMENT, "stop"),
    (dict(stop=["x" * 100_000]), grpc.StatusCode.INVALID_ARGUMENT, "stop"),
]


@pytest.mark.parametrize("fields,code,name", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_status(served, fields, code, name):
    _, _, stub, _ = served
    request = pb.CompletionRequest(**{"prompt": PROMPT, "max_tokens": 1, **fields})
    with pytest.raises(grpc.RpcError) as unary:
        stub.Complete(request, timeout=30)
    with pytest.raises(grpc.RpcError) as stream:
        list(stub.CompleteStream(request, timeout=30))
    for err in (unary.value, stream.value):
        assert err.code() == code
        assert err.details().startswith(f"{name}:"), err.details()
    # ... and the server keeps serving.
    assert stub.Complete(pb.CompletionRequest(prompt=PROMPT, max_tokens=1), timeout=30).usage.completion_tokens == 1


def test_health_serving(served):
    _, _, _, channel = served
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE_NAME):
        status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as err:
        health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_the_service(served):
    _, _, _, channel = served
    db = ProtoReflectionDescriptorDatabase(channel)
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= set(db.get_services())
    service = DescriptorPool(db).FindServiceByName(SERVICE_NAME)
    assert {m.name for m in service.methods} == {"Complete", "CompleteStream"}
    assert service.methods_by_name["CompleteStream"].server_streaming


def test_cancelled_stream_frees_kv_blocks(served):
    engine, _, stub, _ = served
    call = stub.CompleteStream(pb.CompletionRequest(prompt=PROMPT * 20, max_tokens=3000, ignore_eos=True))
    for _ in range(3):
        next(call)
    assert engine.pool.num_free_blocks < NUM_BLOCKS  # it is generating
    call.cancel()
    wait_idle(engine)


def test_unary_deadline_frees_kv_blocks(served):
    engine, _, stub, _ = served
    with pytest.raises(grpc.RpcError) as err:
        stub.Complete(pb.CompletionRequest(prompt=PROMPT * 20, max_tokens=3000, ignore_eos=True), timeout=1)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(engine)


class FailingCore:
    """A core whose every request fails the way a busy or broken cluster does."""

    model_name = "tiny-moe"
    max_model_len = 4096

    def __init__(self, error: Exception):
        self.error = error

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode())

    def ready(self) -> bool:
        return False

    def degraded(self) -> dict[str, str]:
        return {"pdserve-decode-0": "down: its process died"}

    async def generate(self, request, direct=None):
        raise self.error
        yield


@pytest.mark.parametrize("error", [NoCapacityError("all decode replicas are full", retry_after_s=2.0),
                                   ServingError("decode replica died"),
                                   ReplicaUnavailableError("no live decode replica: pdserve-decode-0 (its process died)")])
def test_service_errors_are_unavailable(loop, error):
    server = loop.run(start_grpc_server(FailingCore(error), 0, host="127.0.0.1"))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.CompletionStub(channel).Complete(pb.CompletionRequest(prompt="hi"), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert err.value.details() == str(error)
            if isinstance(error, NoCapacityError):
                assert ("grpc-retry-pushback-ms", "2000") in err.value.trailing_metadata()
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        loop.run(server.stop(None))


def test_overload_is_resource_exhausted_with_retry_after(loop):
    # HTTP's 429: the same whole seconds in `retry-after`, and as gRFC A6's pushback.
    error = OverloadedError("its first token would come in about 2500 ms", "predicted_ttft", retry_after_s=1.5)
    server = loop.run(start_grpc_server(FailingCore(error), 0, host="127.0.0.1"))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            for call in (pb_grpc.CompletionStub(channel).Complete,
                         lambda r, timeout: list(pb_grpc.CompletionStub(channel).CompleteStream(r, timeout=timeout))):
                with pytest.raises(grpc.RpcError) as err:
                    call(pb.CompletionRequest(prompt="hi", priority=-2), timeout=10)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert err.value.details() == str(error)
                assert {("retry-after", "2"), ("grpc-retry-pushback-ms", "2000")} <= set(err.value.trailing_metadata())
    finally:
        loop.run(server.stop(None))


def test_an_unexpected_error_is_internal_and_names_no_class(loop):
    """What a Ray actor death looked like before the router knew it: no Python internals reach the client."""
    server = loop.run(start_grpc_server(FailingCore(KeyError("<class 'ray.exceptions.ActorDiedError'>")), 0,
                                        host="127.0.0.1"))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.CompletionStub(channel).Complete(pb.CompletionRequest(prompt="hi"), timeout=10)
            assert err.value.code() == grpc.StatusCode.INTERNAL
            assert "class" not in err.value.details() and "Error" not in err.value.details()
    finally:
        loop.run(server.stop(None))
