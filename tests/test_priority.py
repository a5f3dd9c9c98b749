"""Priorities in the engine (vLLM's `priority`: lower is served first): a high-priority request
overtakes queued low-priority ones, preemption takes the lowest priority first, and the greedy
output of every request is still what it generates alone; every block comes back."""

import pytest
import torch

from pdserve.messages import Request
from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.protocol import SamplingParams

LOW, HIGH = 5, -1
BLOCK = 4  # small blocks: a few short requests fill a small pool
TOKENS = 10  # generated per request: a prompt of 6 and its output fill 4 blocks


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The engines here run steps of a few tokens: a second torch thread has nothing to share, and
    on a loaded machine its spin-waits made this module 4x slower (112 s against 28 s at load 13)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


MODE = {"overlap_scheduling": False}


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "overlap"])
def overlap(request):
    """Every test twice: steps handed out as they finish, and overlapped (step N+1 scheduled, and
    its victims preempted, before step N's tokens are handed out)."""
    MODE["overlap_scheduling"] = request.param
    yield request.param
    MODE["overlap_scheduling"] = False


def make_engine(**kw) -> Engine:
    kw.setdefault("num_kv_blocks", 64)
    kw.setdefault("overlap_scheduling", MODE["overlap_scheduling"])
    return Engine(EngineConfig(model=ModelConfig(path="tiny-moe"), block_size=BLOCK, **kw))


def prompt(seed: int) -> list[int]:
    return torch.randint(0, 256, (6,), generator=torch.Generator().manual_seed(seed)).tolist()


GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def alone() -> dict[int, list[int]]:
    """Each prompt's greedy output with room for all (batched equals alone: tests/test_engine.py)."""
    engine = make_engine(overlap_scheduling=False)
    return {i: c.token_ids for i, c in enumerate(engine.generate([prompt(i) for i in range(10)], GREEDY))}


def drain(engine: Engine) -> tuple[dict[str, list[int]], list[str]]:
    """Step until done: every request's tokens, and the requests in the order of their first token."""
    tokens: dict[str, list[int]] = {}
    first: list[str] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id not in tokens:
                first.append(out.request_id)
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return tokens, first


def test_a_high_priority_request_overtakes_queued_low_priority_ones(alone):
    # Two sequence slots, both taken by low-priority requests, two more of them queued: a
    # high-priority request that comes last takes a slot at the next step (the latest low-priority
    # one is preempted for it) and has its first token before the queued ones have theirs.
    engine = make_engine(max_num_seqs=2)
    for i in range(4):
        engine.add_request(f"low{i}", prompt(i), GREEDY, priority=LOW)
    tokens, first = drain_after(engine, steps=2, then=lambda: engine.add_request("high", prompt(9), GREEDY,
                                                                                  priority=HIGH))
    assert first.index("high") < first.index("low2") and first.index("high") < first.index("low3"), first
    assert engine.scheduler.num_preemptions >= 1
    assert tokens["high"] == alone[9]
    assert all(tokens[f"low{i}"] == alone[i] for i in range(4))  # the preempted one recomputed
    assert engine.pool.num_free_blocks == 64


def test_a_prefill_engine_admits_by_priority_without_preempting():
    # A prefill-role engine never preempts (its blocks may be read by a KV transfer): the
    # high-priority prompt goes ahead of the queued ones, not of those already running.
    engine = make_engine(role="prefill", max_num_seqs=2)
    for i in range(4):
        engine.add_request(f"low{i}", prompt(i), GREEDY, priority=LOW)
    outs = []
    outs += engine.step()  # low0 and low1 run (their prompts whole in one step)
    engine.add_request("high", prompt(9), GREEDY, priority=HIGH)
    for out in outs:
        engine.release(out.request_id)  # (what the KV connector does once the KV left)
    order = [o.request_id for o in outs]
    while engine.has_unfinished():
        for out in engine.step():
            order.append(out.request_id)
            engine.release(out.request_id)
    assert order == ["low0", "low1", "high", "low2", "low3"]
    assert engine.scheduler.num_preemptions == 0
    assert engine.pool.num_free_blocks == 64


def test_preemption_takes_the_lowest_priority_first(alone):
    # 8 requests of 4 blocks each (6 prompt + 10 generated tokens) in 18 blocks: preemption by
    # recompute must happen. The 4 high-priority ones (16 blocks) always fit, so only the
    # low-priority ones are preempted, whatever their arrival; arrivals alternate the two.
    engine = make_engine(num_kv_blocks=18, enable_prefix_cache=False)
    seqs = {}
    for i in range(8):
        rid = f"{'high' if i % 2 else 'low'}{i}"
        engine.add_request(rid, prompt(i), GREEDY, priority=HIGH if i % 2 else LOW)
        seqs[rid] = engine.seqs[rid]
    tokens, _ = drain(engine)
    preempted = {rid for rid, s in seqs.items() if s.num_preemptions}
    assert preempted and all(rid.startswith("low") for rid in preempted), preempted
    assert all(tokens[rid] == alone[int(rid[-1])] for rid in seqs)
    assert engine.pool.num_free_blocks == 18


def test_equal_priorities_keep_arrival_order_and_preempt_the_latest(alone):
    # One priority for all (the default): the latest arrival is preempted first, so the earliest
    # requests are never preempted and finish first.
    engine = make_engine(num_kv_blocks=18, enable_prefix_cache=False)
    seqs = {}
    for i in range(8):
        engine.add_request(f"r{i}", prompt(i), GREEDY)
        seqs[i] = engine.seqs[f"r{i}"]
    tokens, first = drain(engine)
    assert first == [f"r{i}" for i in range(8)]
    assert seqs[0].num_preemptions == 0 and any(s.num_preemptions for s in seqs.values())
    assert all(tokens[f"r{i}"] == alone[i] for i in range(8))
    assert engine.pool.num_free_blocks == 18


def drain_after(engine: Engine, steps: int, then) -> tuple[dict[str, list[int]], list[str]]:
    """`steps` steps, then `then()`, then drain; the tokens and first-token order of all of it."""
    tokens: dict[str, list[int]] = {}
    first: list[str] = []
    for _ in range(steps):
        for out in engine.step():
            if out.request_id not in tokens:
                first.append(out.request_id)
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    then()
    more, rest = drain(engine)
    for rid, ids in more.items():
        tokens.setdefault(rid, []).extend(ids)
    return tokens, first + [r for r in rest if r not in first]


# -- a decode replica's reservations ----------------------------------------------------------------

def hand_over(prefill: Engine, decode: Engine, rid: str, i: int, priority: int) -> list[int] | None:
    """What a router, a prefill replica and the KV transfer do for one request: reserve its blocks
    on the decode engine (None: refused), prefill it, copy its KV there, start it decoding; its
    tokens so far (the first)."""
    reserved = decode.reserve(Request(rid, prompt(i), GREEDY, priority=priority))
    if reserved is None:
        return None
    prefill.add_request(rid, prompt(i), GREEDY, priority=priority)
    (first,) = [o for o in prefill.step() if o.request_id == rid]
    decode.kv_cache[:, :, reserved.new_block_ids] = \
        prefill.kv_cache[:, :, first.kv_block_ids[reserved.cached_blocks:]]
    prefill.release(rid)
    decode.start_decode(rid, first.token_ids[0])
    return []


def steps(engine: Engine, n: int, tokens: dict[str, list[int]]) -> None:
    for _ in range(n):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)


@pytest.mark.parametrize("full_of", ["slots", "blocks"])
def test_a_reservation_preempts_lower_priority_decoding_requests(alone, full_of):
    # A decode engine full of low-priority requests (both of its sequence slots, or all of its
    # blocks): a high-priority reservation preempts the latest of them instead of being refused,
    # one of the low priority is still refused, and every request's greedy output is what it
    # generates alone (the victim's KV recomputed on the decode engine); every block comes back.
    room = dict(max_num_seqs=2) if full_of == "slots" else dict(num_kv_blocks=6, enable_prefix_cache=False)
    decode, prefill = make_engine(role="decode", **room), make_engine(role="prefill", overlap_scheduling=False)
    tokens: dict[str, list[int]] = {}
    for i in range(2):
        assert hand_over(prefill, decode, f"low{i}", i, LOW) is not None
    steps(decode, 4, tokens)  # 6 + 4 tokens each: 3 blocks each, all 6 taken
    assert hand_over(prefill, decode, "low2", 2, LOW) is None  # its own priority preempts nothing
    assert decode.scheduler.num_preemptions == 0
    assert hand_over(prefill, decode, "high", 9, HIGH) is not None
    victim = decode.seqs["low1"]
    assert victim.num_preemptions == 1 and decode.seqs["low0"].num_preemptions == 0
    more, _ = drain(decode)
    for rid, t in more.items():
        tokens.setdefault(rid, []).extend(t)
    assert tokens["high"] == alone[9]
    assert tokens["low0"] == alone[0] and tokens["low1"] == alone[1]
    assert decode.pool.num_free_blocks == decode.pool.num_blocks and not any(decode.pool.ref_counts)
    assert prefill.pool.num_free_blocks == prefill.pool.num_blocks


def test_a_reservation_that_preemption_would_not_make_room_for_preempts_nothing(alone):
    # All 6 blocks held, 3 by a high-priority request and 3 by a low one: a reservation ranked
    # between them needs 4, more than the low one's 3 would free, so it is refused and nobody is
    # preempted for nothing.
    decode = make_engine(role="decode", num_kv_blocks=6, enable_prefix_cache=False)
    prefill = make_engine(role="prefill", overlap_scheduling=False)
    tokens: dict[str, list[int]] = {}
    assert hand_over(prefill, decode, "high0", 0, HIGH) is not None
    assert hand_over(prefill, decode, "low1", 1, LOW) is not None
    steps(decode, 4, tokens)
    assert decode.pool.num_free_blocks == 0
    assert decode.reserve(Request("mid", list(range(13)), GREEDY, priority=0)) is None
    assert decode.scheduler.num_preemptions == 0 and "mid" not in decode.seqs
    more, _ = drain(decode)
    for rid, t in more.items():
        tokens.setdefault(rid, []).extend(t)
    assert tokens["high0"] == alone[0] and tokens["low1"] == alone[1]
    assert decode.pool.num_free_blocks == decode.pool.num_blocks
