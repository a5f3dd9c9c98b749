"""The router's parts on their own, without Ray or replicas: routing policies (router/policy.py)
choosing among replicas whose figures are set by hand, the replica set's counts and KV pairs
(router/replica_set.py), and admission's gate (router/admission.py). The cluster tests
(test_prefix_routing.py, test_router_queue.py, test_overload.py, test_faults.py) run them for real."""

import asyncio

import pytest

from pdserve.messages import KVEvents, ReplicaStats, Request
from pdserve.protocol import SamplingParams
from pdserve.router.admission import AdmissionGate, AdmissionPolicy
from pdserve.router.attempt import Attempt
from pdserve.router.decode_replica import DecodeReplica
from pdserve.router.policy import KVAware, PrefixAware, RoundRobin, routing_policy
from pdserve.router.replica_set import ReplicaSet
from pdserve.router.types import OverloadedError

BLOCK = 4


def stats(name: str, role: str, free: int = 100, total: int = 100, peers=()) -> ReplicaStats:
    return ReplicaStats(name, role, 0, 0, free, total, 0, kv_peers=list(peers))


def cluster(prefill=("p0", "p1"), decode=("d0", "d1")) -> ReplicaSet:
    """A replica set as the controller and the stats poll would leave it (no workers behind it: the
    policies read figures, never call)."""
    rs = ReplicaSet("router")
    for p in prefill:
        rs.prefill[p] = None
        rs.workers[p] = {f"{p}-w": None}
        rs.health.join(p, "prefill", fresh=True)
        rs.loads[p] = 0
        rs.stats[p] = stats(p, "prefill", peers=[f"{d}-r" for d in decode])
    for d in decode:
        rs.decode[d] = DecodeReplica(d, {f"{d}-r": None})
        rs.workers[d] = {f"{d}-r": None}
        rs.health.join(d, "decode", fresh=True)
        rs.loads[d] = 0
        rs.stats[d] = stats(d, "decode", peers=[f"{p}-w" for p in prefill])
        rs.decode[d].rank_stats[f"{d}-r"] = rs.stats[d]
    return rs


def request(prompt: list[int], session: str | None = None) -> Request:
    return Request("r", prompt, SamplingParams(max_tokens=4), session=session)


def test_round_robin_takes_turns_per_role():
    rs = cluster()
    rr = RoundRobin(rs)
    run, req = Attempt("r"), request([1, 2, 3])
    picks = [(rr.prompt_replica(["p0", "p1"], "prefill", run, req, []),
              rr.decode_order(["d0", "d1"], run, req)[0][0]) for _ in range(4)]
    # Each role has its own turn: with as many replicas per role, every pair comes up.
    assert picks == [("p0", "d0"), ("p1", "d1"), ("p0", "d0"), ("p1", "d1")]


def test_kv_aware_fewest_requests_and_most_free_blocks():
    rs = cluster()
    rs.loads.update(p0=3, p1=1)
    rs.stats["d0"].free_blocks, rs.stats["d1"].free_blocks = 10, 90
    kv = KVAware(rs)
    run, req = Attempt("r"), request([1, 2, 3])
    assert kv.prompt_replica(["p0", "p1"], "prefill", run, req, []) == "p1"
    assert [n for n, _ in kv.decode_order(["d0", "d1"], run, req)] == ["d1", "d0"]
    rs.reserved["d1"] = 85  # what we reserved there since its stats: 5 left by our count
    assert [n for n, _ in kv.decode_order(["d0", "d1"], run, req)] == ["d0", "d1"]


def test_a_burst_of_local_prompts_spreads_over_the_decode_replicas():
    """Prompts computed on decode replicas (adaptive local prefill), placed faster than stats come:
    each placement counts its blocks against its replica's last reported free blocks, so the next
    one goes where more are left, not all to the replica that had the most."""
    from pdserve.router.paths import Paths

    rs = cluster()
    rs.stats["d0"].free_blocks, rs.stats["d1"].free_blocks = 100, 90
    paths = Paths()
    paths.replicas, paths.routing, paths.block_size, paths.metrics = rs, KVAware(rs), BLOCK, None
    picks = []
    for i in range(4):
        run, req = Attempt(f"r{i}"), request(list(range(8 * BLOCK - 1)))  # 8 blocks with its first token
        name, ranks = paths.routing.decode_order(["d0", "d1"], run, req)[0]
        paths._place_whole(req, run, [], name, ranks[0])
        picks.append(name)
    assert picks == ["d0", "d0", "d1", "d0"]  # 100, 92, 84 vs 90: d1 once d0's count falls under it
    assert rs.reserved == {"d0": 24, "d1": 8}


def test_prefix_aware_goes_where_the_prompt_is_cached_until_the_balance_guard():
    rs = cluster()
    pa = PrefixAware(rs, BLOCK)
    prompt = list(range(32))  # 8 blocks
    run, req = Attempt("r"), request(prompt)
    pa.prepare(run, req, [])
    assert len(run.hashes) == 8
    # p1's worker announced every block of it (its KV events): p1 computes 0 of 32 tokens, p0 all.
    pa.index.apply("p1-w", KVEvents("e", 1, True, [(True, h) for h in run.hashes]))
    assert pa.prompt_replica(["p0", "p1"], "prefill", run, req, []) == "p1"
    assert run.to_compute == 1  # (at least the last token is computed)
    # Past SLACK + RATIO x the least-loaded replica's requests, the other one takes it.
    rs.loads.update(p0=0, p1=9)
    assert pa.prompt_replica(["p0", "p1"], "prefill", run, req, []) == "p0"


def test_prefix_aware_hashes_a_keys_prompt_as_the_engines_do():
    """A salted prompt (a key's cache_salt) matches only the blocks an engine stored under that salt:
    the router's index hashes as the engines' caches do (Engine._new_sequence), so another key's
    prompt is neither routed toward those blocks nor counted as cached there."""
    from pdserve.engine.block_pool import block_hashes, salt_root

    rs = cluster()
    pa = PrefixAware(rs, BLOCK)
    prompt = list(range(32))
    stored = block_hashes(prompt, BLOCK, salt_root("key:alpha"))  # what p1's engine announced
    pa.index.apply("p1-w", KVEvents("e", 1, True, [(True, h) for h in stored]))
    for salt, cached in (("key:alpha", True), ("key:beta", False), (None, False)):
        run = Attempt("r")
        req = Request("r", prompt, SamplingParams(max_tokens=4, cache_salt=salt))
        pa.prepare(run, req, [])
        assert (list(run.hashes) == stored) is cached, salt
        pa.prompt_replica(["p0", "p1"], "prefill", run, req, [])
        assert (run.to_compute == 1) is cached, salt


def test_prefix_aware_remembers_a_session_for_its_next_turn():
    rs = cluster()
    pa = PrefixAware(rs, BLOCK)
    first = request(list(range(16)), session="s")
    run = Attempt("r")
    pa.prepare(run, first, [])
    pa.routed(run, first, {"p1": "p1-w", "d1": "d1-r"})  # (the index learns it too)
    pa.index.drop("p1-w"), pa.index.drop("d1-r")  # its events not come yet: only the session says so
    nxt = request(list(range(16)) + [7, 7, 7, 7], session="s")
    run2 = Attempt("r2")
    pa.prepare(run2, nxt, [])
    assert pa.prompt_replica(["p0", "p1"], "prefill", run2, nxt, []) == "p1"
    assert pa.decode_order(["d0", "d1"], run2, nxt)[0][0] == "d1"


def test_a_fresh_prompt_is_hashed_through_after_the_turn_that_sends_it():
    """Placing a prompt no worker holds hashes its first block only (the index walk stops there); the
    rest once the turn that sends it is over, so its first token does not wait for 64 sha256s. A
    match before then (a burst sharing the prompt) counts it routed all the same."""
    from pdserve.engine.block_pool import block_hashes

    async def main():
        pa = PrefixAware(cluster(), BLOCK)
        prompt = list(range(64 * BLOCK))
        run, req = Attempt("r"), request(prompt)
        pa.prepare(run, req, [])
        assert pa.prompt_replica(["p0", "p1"], "prefill", run, req, []) in ("p0", "p1")
        pa.routed(run, req, {"p0": "p0-w"})
        assert not run.hashes.is_complete  # (placing it read one block)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert run.hashes.is_complete and list(run.hashes) == block_hashes(prompt, BLOCK)
        assert pa.index.match(run.hashes, ["p0-w", "p1-w"]) == {"p0-w": 64, "p1-w": 0}
        # A second prompt routed, then matched in the same turn: settled by the match.
        other, run2 = request(prompt[::-1]), Attempt("r2")
        pa.prepare(run2, other, [])
        pa.routed(run2, other, {"p1": "p1-w"})
        assert pa.index.match(block_hashes(prompt[::-1], BLOCK), ["p1-w"]) == {"p1-w": 64}

    asyncio.run(main())


def test_routing_policy_names_the_key_of_an_unknown_policy():
    assert isinstance(routing_policy("kv-aware", cluster(), BLOCK), KVAware)
    with pytest.raises(ValueError, match="router.policy"):
        routing_policy("random", cluster(), BLOCK)


def test_replica_set_pairs_only_where_both_ends_list_each_other():
    rs = cluster()
    assert rs.paired("p0") and rs.paired("p0", "d1", "d1-r")
    rs.decode["d1"].rank_stats["d1-r"].kv_peers = ["p1-w"]  # d1 has no handshake with p0 (yet)
    assert not rs.paired("p0", "d1", "d1-r") and rs.paired("p0")  # (d0 still pairs with it)
    rs.health.failed("d0", RuntimeError("no answer"))  # a missed poll is not down yet
    assert rs.paired("p0")


def test_replica_set_counts_what_an_attempt_holds_and_gives_it_back():
    rs = cluster()
    run = Attempt("r")
    rs.place("p0", run)
    rs.await_prompt(run, "p0", 100)
    assert (rs.placed("p0"), rs.prompts["p0"], rs.prompt_tokens["p0"]) == (1, 1, 100)
    assert rs.prompt_done(run) and not rs.prompt_done(run)  # once
    rs.unplace(run)
    assert (rs.placed("p0"), rs.prompts["p0"], rs.prompt_tokens["p0"], run.placed) == (0, 0, 0, [])


def test_admission_gate_queues_until_placed_and_refuses_when_full():
    async def main():
        rs = cluster()
        gate = AdmissionGate(AdmissionPolicy(max_queued=1, queue_wait_s=5, max_queued_per_replica=1), rs)
        rs.prompts["p0"] = 1
        assert not gate.has_room("p0") and gate.has_room("p1")
        room = asyncio.Event()

        async def place():
            return "p1" if room.is_set() else None

        waiting = asyncio.create_task(gate.admit(request([1]), Attempt("a"), place))
        await asyncio.sleep(0.01)
        assert len(gate.queue) == 1
        with pytest.raises(OverloadedError) as e:  # the queue (max_queued 1) is full
            await gate.admit(request([1]), Attempt("b"), place)
        assert e.value.reason == "queue_full"
        room.set()
        gate.wake()
        assert await asyncio.wait_for(waiting, 5) == "p1"
        assert len(gate.queue) == 0
        # A drain: the one waiting hears it at once (503), not at its deadline.
        waiting = asyncio.create_task(gate.admit(request([1]), Attempt("c"), lambda: asyncio.sleep(0)))
        await asyncio.sleep(0.01)
        gate.draining = True
        with pytest.raises(Exception, match="shutting down"):
            await asyncio.wait_for(waiting, 1)

    asyncio.run(main())
