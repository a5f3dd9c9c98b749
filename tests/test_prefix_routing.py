"""Prefix-aware routing: replicas' KV events, the router's index of them, and a multi-turn workload
through 2 prefill + 2 decode replicas against the kv-aware policy."""

import random
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from pdserve.benchmarks.load.workloads import plan
from pdserve.engine.block_pool import BlockPool, block_hashes
from pdserve.engine.kv_events import KVEventLog
from pdserve.router import prefix_index
from pdserve.router.prefix_index import PrefixIndex
from serving_cluster import Cluster


def hashes(ids, bs=4):
    return block_hashes(ids, bs)


def test_the_log_gives_each_reader_what_it_missed_or_the_whole_cache():
    pool = BlockPool(8)
    pool.events = log = KVEventLog(pool.cached, max_events=4)
    h = hashes(list(range(12)))
    blocks = pool.allocate(3)
    for b, x in zip(blocks, h):
        pool.register(b, x)
    first = log.since("", 0)  # a new reader: the whole cache
    assert first.reset and sorted(x for _, x in first.events) == sorted(h)
    assert log.since(first.epoch, first.cursor).events == []  # nothing new since
    pool.free(blocks)
    pool.allocate(8)  # evicts all three (plain free blocks first: 5, then the cached, LRU first)
    ev = log.since(first.epoch, first.cursor)
    assert not ev.reset and sorted(ev.events) == sorted((False, x) for x in h)
    # A reader behind by more than the log keeps: the whole cache again (empty now), not a gap.
    assert log.since(first.epoch, 0).reset and log.since(first.epoch, 0).events == []
    # Another log's cursor (a replaced replica's) means nothing here.
    assert KVEventLog({}).since(first.epoch, first.cursor).reset


def test_a_reader_inside_a_full_log_gets_exactly_the_events_after_its_cursor():
    log = KVEventLog({}, max_events=8)
    keys = [bytes([i]) for i in range(20)]
    for i, x in enumerate(keys):  # seq i + 1; the log keeps seqs 13..20
        (log.stored if i % 3 else log.removed)(x)
    epoch = log.since("", 0).epoch
    for cursor in (12, 15, 19, 20):
        ev = log.since(epoch, cursor)
        assert not ev.reset and ev.cursor == 20
        assert ev.events == [(bool(i % 3), keys[i]) for i in range(cursor, 20)], cursor
    assert log.since(epoch, 11).reset  # seq 12 is gone from the log


class Cache:
    """A prefix cache's dict and its event log, kept as a block pool keeps them."""

    def __init__(self):
        self.cached: dict[bytes, int] = {}
        self.log = KVEventLog(self.cached)

    def store(self, hs):
        for x in hs:
            self.cached[x] = 0
            self.log.stored(x)

    def remove(self, x):
        del self.cached[x]
        self.log.removed(x)

    def follow(self, idx: PrefixIndex, worker: str) -> None:
        idx.apply(worker, self.log.since(*idx.cursor(worker)))


def test_the_index_matches_the_longest_cached_prefix_per_worker():
    idx, a, b = PrefixIndex(), Cache(), Cache()
    h = hashes(list(range(40)))  # 10 blocks
    a.store(h[:6])
    b.store(h[:3] + h[4:8])  # a gap at block 3: only the first 3 count (a chain)
    a.follow(idx, "a")
    b.follow(idx, "b")
    assert idx.match(h, ["a", "b", "c"]) == {"a": 6, "b": 3, "c": 0}
    a.remove(h[2])
    a.follow(idx, "a")  # an event this time, not the whole cache
    assert idx.match(h, ["a"]) == {"a": 2}
    idx.drop("b")
    assert idx.match(h, ["b"]) == {"b": 0} and idx.size() == 5  # a's six less the removed one


def test_what_the_router_routed_counts_until_it_expires(monkeypatch):
    monkeypatch.setattr(prefix_index, "ROUTED_TTL_S", 0.2)
    idx = PrefixIndex()
    h = hashes(list(range(16)))
    idx.routed("a", h)
    assert idx.match(h, ["a", "b"]) == {"a": 4, "b": 0}
    time.sleep(0.3)  # the worker's own events would have said it by now
    assert idx.match(h, ["a"]) == {"a": 0}


def test_a_lookup_in_an_index_of_100k_blocks_takes_microseconds():
    idx, cache = PrefixIndex(), Cache()
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(16 * 64)] for _ in range(100_000 // 64)]
    for p in prompts:
        cache.store(hashes(p, 16))
    cache.follow(idx, "w0")
    assert idx.size() == len(prompts) * 64
    h = hashes(prompts[7], 16)
    t0 = time.perf_counter()
    for _ in range(100):
        got = idx.match(h, ["w0", "w1", "w2", "w3"])
    per = (time.perf_counter() - t0) / 100
    assert got == {"w0": 64, "w1": 0, "w2": 0, "w3": 0}
    print(f"lookup of a 64-block prompt over 4 workers in an index of {idx.size()} blocks: {per * 1e6:.1f} us")


# -- a multi-turn workload through `pdserve up` -------------------------------------------------------

SESSIONS, TURNS, BLOCK = 8, 5, 16
# A pool as large as a GPU's is to its requests: its pressure term (used² / total) stays small.
DECODE = {"replicas": 2, "num_kv_blocks": 8192}
PLAN = plan("multi-turn", SESSIONS * TURNS, float("inf"), random.Random(5), 16, 8, prefix_len=32, turns=TURNS)


def run_sessions(c: Cluster) -> list[list[str]]:
    """SESSIONS conversations at once, each turn after its own last answer and a think time (seeded,
    up to 0.3 s: the sessions drift apart, as users do); their texts."""
    oa = openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", max_retries=0, timeout=120)

    def session(s: int) -> list[str]:
        think = random.Random(s)
        out = []
        for i in range(s * TURNS, (s + 1) * TURNS):
            time.sleep(think.uniform(0, 0.3))
            r = oa.completions.create(model="tiny-moe", prompt=PLAN.prompts[i], max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True}, user=PLAN.users[i])
            out.append(r.choices[0].text)
        return out

    with ThreadPoolExecutor(SESSIONS) as pool:
        return list(pool.map(session, range(SESSIONS)))


def at_best() -> int:
    """Prompt tokens the prefill replicas compute when every turn finds its whole history (the last
    turn's prompt, in full blocks) cached where it goes, and every first turn the system prompt —
    but the first on each of the two replicas."""
    n = 2 * 32
    for s in range(SESSIONS):
        lens = [len(PLAN.prompts[i]) for i in range(s * TURNS, (s + 1) * TURNS)]
        n += lens[0] - 32 + sum(now - before // BLOCK * BLOCK for before, now in zip(lens, lens[1:]))
    return n


def reused_at_best() -> int:
    """Decode blocks reused when every turn after the first goes where its last turn's KV is."""
    n = 0
    for s in range(SESSIONS):
        lens = [len(PLAN.prompts[i]) for i in range(s * TURNS, (s + 1) * TURNS)]
        n += sum(min(before // BLOCK, (now - 1) // BLOCK) for before, now in zip(lens, lens[1:]))
    return n


def counters(c: Cluster) -> dict[str, float]:
    """Prompt tokens the prefill replicas computed (looked up less found in their prefix caches),
    KV bytes moved to decode replicas, and blocks the decode replicas found in their own caches."""
    text = c.metrics()
    out = {"computed": 0.0, "moved": 0.0, "reused": 0.0}
    for line in text.splitlines():
        if line.startswith("pdserve_prefix_cache_queries_total{") and "prefill" in line:
            out["computed"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("pdserve_prefix_cache_hits_total{") and "prefill" in line:
            out["computed"] -= float(line.rsplit(" ", 1)[1])
        elif line.startswith("pdserve_kv_bytes_moved_total"):
            out["moved"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("pdserve_kv_blocks_reused_total{"):
            out["reused"] += float(line.rsplit(" ", 1)[1])
    return out


def placed(c: Cluster) -> dict[str, float]:
    """Requests placed on each replica so far (pdserve_replica_requests_total)."""
    out: dict[str, float] = {}
    for line in c.metrics().splitlines():
        if line.startswith("pdserve_replica_requests_total{"):
            name = line.split('replica="', 1)[1].split('"', 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


# Every turn prefilled on a prefill replica: what is measured is the policy's choice of prefill and
# decode replica and the KV that moves (adaptive would compute a cached turn on its decode replica).
REMOTE = "remote"


@pytest.fixture(scope="module")
def kv_aware(tmp_path_factory):
    """The same workload under the kv-aware policy: texts and counters. Its cluster stops before the
    test's own starts (two clusters of 4 replicas at once on 2 cores, one of them idle)."""
    c = Cluster(tmp_path_factory.mktemp("kv-aware"), prefill={"replicas": 2}, decode=DECODE,
                router={"policy": "kv-aware", "prefill_site": REMOTE})
    try:
        c.wait_ready()
        texts = run_sessions(c)
        time.sleep(1.5)  # the router's stats polls (0.5 s) bring the replicas' last counts
        result = texts, counters(c)
    finally:
        assert c.stop() == 0, c.output()
    return result


def test_turns_go_where_their_prefix_is_cached(tmp_path, kv_aware):
    texts_kv, kv = kv_aware
    c = Cluster(tmp_path, prefill={"replicas": 2}, decode=DECODE, router={"prefill_site": REMOTE})  # prefix-aware: the default
    try:
        c.wait_ready()
        texts = run_sessions(c)
        assert texts == texts_kv  # greedy output is the same wherever a turn went
        time.sleep(1.5)
        mine = counters(c)
        print(f"prefill tokens computed: prefix-aware {mine['computed']:.0f}, kv-aware {kv['computed']:.0f}; "
              f"KV bytes moved {mine['moved']:.0f} against {kv['moved']:.0f}; decode blocks reused "
              f"{mine['reused']:.0f} (at best {reused_at_best()}) against {kv['reused']:.0f}")
        # Each turn after the first finds its history on its prefill replica: only its new tokens are
        # computed; kv-aware finds it on about every other turn. A turn still goes elsewhere when its
        # replica's queue outweighs its cached history, which a loaded host makes likelier (with the
        # queue weighed at half: alone 1,088-1,120 of the best 1,088, beside the suite 1,264-1,392;
        # kv-aware 1,472-1,696).
        assert mine["computed"] <= 1.3 * at_best() and mine["computed"] < kv["computed"], (mine, kv, at_best())
        # Only new KV moves, and the decode replica chosen is the one holding the history: every turn
        # after the first reuses its last prompt's full blocks there (the last token's block is
        # always written).
        assert mine["reused"] >= 0.85 * reused_at_best() and mine["moved"] <= kv["moved"], (mine, kv)
        # A burst over one cached 24-block prefix: the replicas that hold it are the cheapest, on both
        # sides, yet one carrying BALANCE_SLACK more requests than an idle one hands the next to it.
        # (The decode side's cost counts blocks, not requests: without the guard there, in a pool this
        # large, all 24 went to one decode replica. With it, while a decode replica counted a request
        # only once its KV reservation was answered, 17 and 7, and in a loaded CI run 24 and 0: the
        # burst's reservations, sent together, all saw it idle. Counted from the call: 12 and 12.)
        shared = random.Random(9).choices(range(3, 500), k=24 * BLOCK)
        oa = openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", max_retries=0, timeout=120)

        def ask(suffix: list[int]) -> str:
            return oa.completions.create(model="tiny-moe", prompt=shared + suffix, max_tokens=48, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

        ask([7])  # cached on one replica of each side
        time.sleep(1.0)  # its KV events reach the router
        before = placed(c)
        with ThreadPoolExecutor(24) as pool:
            list(pool.map(ask, [[100 + i, 200 + i] for i in range(24)]))
        burst = {n: v - before.get(n, 0) for n, v in placed(c).items()}
        print("the burst placed:", burst)
        for role in ("prefill", "decode"):
            took = [burst.get(f"pdserve-{role}-{i}", 0) for i in range(2)]
            assert sum(took) == 24 and min(took) > 0, (role, burst)
        stats = c.wait_idle()
        assert len(stats) == 4 and all(s["used"] == 0 for s in stats.values()), stats
    finally:
        assert c.stop() == 0, c.output()
