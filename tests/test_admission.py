"""Admission never waits for a step: a worker's call that brings work returns while its engine is
inside a long step (the step is held open here), and the work runs once the step ends."""

import threading
import time

import pytest

from pdserve.config import EngineConfig, ModelConfig
from pdserve.messages import NewRequest, Request, Unpaired
from pdserve.protocol import SamplingParams
from pdserve.worker.colocated import ColocatedWorker

PARAMS = SamplingParams(max_tokens=4, temperature=0)


@pytest.fixture
def held():
    """A colocated worker (in this process) whose engine is inside a step until `release` is set."""
    worker = ColocatedWorker("admission-test", EngineConfig(model=ModelConfig(path="tiny-moe"), num_kv_blocks=64),
                             namespace="unused")
    worker.streams.flush_nap = lambda nap: nap  # no router here to send tokens to
    inside, release = threading.Event(), threading.Event()
    real_step = worker.engine.step

    def long_step():
        inside.set()
        release.wait(30)
        return real_step()

    worker.engine.step = long_step
    worker.engine.has_unfinished = lambda: True  # the loop steps at once
    assert inside.wait(10), "the loop did not start a step"
    yield worker, release
    release.set()
    worker.loop.stop()


def timed(call) -> float:
    t0 = time.monotonic()
    done = threading.Thread(target=call, daemon=True)
    done.start()
    done.join(timeout=5)
    assert not done.is_alive(), "the call waited for the step"
    return time.monotonic() - t0


def test_work_handed_in_during_a_long_step_returns_at_once_and_runs_after_it(held):
    worker, release = held
    added, real_add = threading.Event(), worker.engine.add
    # (Seen as it is added: 4 tokens may come and go between two looks at the engine's sequences.)
    worker.engine.add = lambda request: (added.set(), real_add(request))[1]
    refusals = []
    assert timed(lambda: refusals.append(worker.generate([NewRequest(Request("r1", [1, 2, 3], PARAMS))], "router"))) < 0.5
    assert refusals == [[None]]
    assert timed(lambda: worker.abort(["nobody"])) < 0.5
    assert not added.is_set()  # not yet: the engine is inside its step
    release.set()
    assert added.wait(10), "the request never reached the engine"


def test_a_request_that_can_never_run_is_refused_by_the_call_itself(held):
    worker, _ = held
    refused = []
    batch = [NewRequest(Request("r2", [1] * 5000, PARAMS)), NewRequest(Request("r3", [1, 2], PARAMS))]
    assert timed(lambda: refused.append(worker.generate(batch, "router"))) < 0.5
    [[too_long, fine]] = refused
    assert too_long is not None and too_long.param == "prompt" and fine is None


def test_an_abort_that_overtakes_its_request_drops_the_request_when_it_comes(held):
    # Ray runs a worker's calls on many threads: a client that left while its request was being
    # handed over can have its abort arrive first. The request must not run for nobody.
    worker, release = held
    added, add = [], worker.engine.add
    worker.engine.add = lambda request: (added.append(request.request_id), add(request))
    worker.abort(["r5"])
    worker.generate([NewRequest(Request("r5", [1, 2, 3], PARAMS)), NewRequest(Request("r7", [1, 2, 3], PARAMS))], "router")
    release.set()
    deadline = time.monotonic() + 10
    while "r7" not in added:  # the request after it is taken: r5 was passed over
        assert time.monotonic() < deadline, "the requests never reached the engine"
        time.sleep(0.01)
    assert added == ["r7"]


def test_a_reservation_overtaken_by_its_abort_is_answered_and_holds_no_blocks():
    from pdserve.decode.worker import DecodeWorker

    cfg = EngineConfig(model=ModelConfig(path="tiny-moe"), num_kv_blocks=64, role="decode")
    # TCP, not NIXL: NIXL is loaded in worker processes only (its import aborts in some test processes).
    worker = DecodeWorker("reserve-abort-test", cfg, "tcp", lease_s=30, namespace="unused")
    try:
        worker.abort(["r7"])
        t0 = time.monotonic()
        [answer] = worker.reserve([NewRequest(Request("r7", [1, 2, 3], PARAMS))], "router")
        assert time.monotonic() - t0 < 5  # answered at the next boundary, not left to hang
        assert answer.handle is None and answer.refused is not None
        assert "r7" not in worker.engine.seqs and worker.engine.pool.num_free_blocks == 64

        # A reservation naming a prefill worker this one has no KV handshake with: its KV could never
        # come, so it is answered Unpaired at once (the router reserves over another pair), holding nothing.
        [answer] = worker.reserve([NewRequest(Request("r8", [1, 2, 3], PARAMS), prefill_id="p")], "router")
        assert answer.handle is None and answer.refused is None
        assert answer.unpaired == Unpaired("reserve-abort-test", "p")
        assert "r8" not in worker.engine.seqs and worker.engine.pool.num_free_blocks == 64
        assert worker.stats().kv_peers == []
    finally:
        worker.loop.stop()
