"""Only new KV moves: a decode reservation takes what its engine's own prefix cache holds of the
prompt, and the prefill side streams only the blocks after those.

The oracle is colocated generation (greedy, token for token); the counters are exact (blocks and
bytes); every reservation that ends without its KV — refused halfway, aborted on either side, its
lease run out — leaves the decode pool idle with its prefix cache intact.
"""

import time

import pytest
import torch

from ep_ranks import run_disaggregated
from hf_checkpoints import build_checkpoint, write_tokenizer
from kv_pair import loopback_pair, start_pair
from pdserve.messages import Request
from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.kvtransfer.wire import ReserveHandle
from pdserve.kvtransfer.metadata import KVAgentMetadata
from pdserve.protocol import SamplingParams

GREEDY = dict(max_tokens=12, temperature=0, ignore_eos=True)
BS = 16  # the engines' block size (EngineConfig's default)


def ids(n: int, seed: int, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(role: str = "colocated", blocks: int = 64, **model) -> Engine:
    return Engine(EngineConfig(model=ModelConfig(path="tiny-moe", **model), role=role, num_kv_blocks=blocks))


def test_a_reservation_takes_the_cached_prefix_and_gives_every_reference_back():
    """Block-pool bookkeeping of reservations alone (the KV is whatever the blocks hold): cached
    blocks are shared with a reference each, a reservation refused halfway drops the references it
    looked up, and starting a sequence registers only the blocks after its cached ones."""
    decode = engine("decode", blocks=8)
    pool, params = decode.pool, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    def finish(rid: str, first: int) -> list[int]:
        decode.start_decode(rid, first)
        out = [first]
        while decode.has_unfinished():
            out += [t for o in decode.step() for t in o.token_ids]
        return out

    first = ids(40, 1)
    r = decode.reserve(Request("a", first, params))
    assert r.cached_blocks == 0 and len(r.block_ids) == 3
    answer = finish("a", 7)
    assert len(pool.cached) == 2  # 43 tokens computed: two full blocks
    held = [pool.cached[h] for h in decode_hashes(first[:32])]
    # The next turn: prompt + answer + new text; its third block was never full, so two are cached.
    turn = first + answer + ids(10, 2)
    r = decode.reserve(Request("b", turn, params))
    assert r.cached_blocks == 2 and r.block_ids[:2] == held and len(r.new_block_ids) == 2
    assert [pool.ref_counts[b] for b in held] == [1, 1]
    # A request sharing only the prefix, at the same time: the same blocks, a reference more.
    sibling = decode.reserve(Request("c", first[:32] + ids(5, 3), params))
    assert sibling.block_ids[:2] == held and sibling.cached_blocks == 2 and len(sibling.new_block_ids) == 1
    assert [pool.ref_counts[b] for b in held] == [2, 2]
    # 6 blocks, 2 cached: 4 more are not free (3 are): refused after the lookup, nothing kept.
    assert decode.reserve(Request("d", first[:32] + ids(60, 4), params)) is None
    assert "d" not in decode.seqs and [pool.ref_counts[b] for b in held] == [2, 2]
    assert pool.num_free_blocks == 3
    # A resumed request (a migrated one): its output_ids' blocks are looked up with its prompt's.
    resumed = decode.reserve(Request("e", first[:20], SamplingParams(max_tokens=32), output_ids=first[20:36] + [5]))
    assert resumed.block_ids[:2] == held and len(resumed.new_block_ids) == 1
    decode.abort("e")
    decode.abort("c")  # a reservation dropped: its own block freed, its cached ones' references dropped
    assert [pool.ref_counts[b] for b in held] == [1, 1]
    finish("b", 9)
    # 57 tokens computed: block 2 registered now, blocks 0 and 1 kept their one registration.
    assert len(pool.cached) == 3 and [pool.cached[h] for h in decode_hashes(first[:32])] == held
    assert all(pool.block_hash[b] == h for h, b in pool.cached.items())
    assert pool.num_free_blocks == pool.num_blocks and not any(pool.ref_counts)


def test_a_reservation_finds_only_its_own_salts_blocks():
    """The prefix cache salted (SamplingParams.cache_salt, a key's salt from the router): a decode
    reservation of the same prompt under another salt finds none of its blocks, under the same
    salt all; the prefix-aware router hashes a salted prompt to the very keys the engine stores."""
    from pdserve.engine.block_pool import block_hashes, salt_root

    decode = engine("decode", blocks=16)
    prompt = ids(40, 3)

    def reserve(rid: str, salt: str | None) -> int:
        r = decode.reserve(Request(rid, prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True,
                                                               cache_salt=salt)))
        decode.start_decode(rid, 7)
        while decode.has_unfinished():
            decode.step()
        return r.cached_blocks

    assert reserve("a", "key:alpha") == 0
    assert set(decode.pool.cached) >= set(block_hashes(prompt[:32], BS, salt_root("key:alpha")))
    assert reserve("b", "key:beta") == 0 and reserve("c", None) == 0  # another key's, and none
    assert reserve("d", "key:alpha") == 2
    assert salt_root(None) is None and block_hashes(prompt, BS, salt_root("")) == decode_hashes(prompt)


def decode_hashes(tokens: list[int]) -> list[bytes]:
    from pdserve.engine.block_pool import block_hashes

    return block_hashes(tokens, BS)


def run_in_process(streamer, intake, decode, requests: dict[str, list[int]], params: SamplingParams,
                   timeout: float = 60) -> dict[str, list[int]]:
    """Prefill and decode `requests` (id -> prompt) through the real connectors of one process."""
    handles = {}
    for rid, prompt in requests.items():
        handles[rid] = intake.reserve(Request(rid, prompt, params))
        streamer.add(Request(rid, prompt, params), handles[rid])
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    done: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(done) < len(requests):
        assert time.monotonic() < deadline, "the requests did not finish"
        streamer.step()
        assert intake.poll() == []
        for o in decode.step():
            out[o.request_id] += o.token_ids
            if o.finished:
                done.add(o.request_id)
    return out, handles


def test_leases_that_end_without_their_kv_keep_the_cache_and_free_the_rest():
    """With cached blocks in the reservation: a lease that runs out, a prefill that fails and a
    decode-side abort each leave the decode pool idle, and the cached prefix serves the next turn,
    whose output is colocated generation's."""
    params = SamplingParams(**GREEDY)
    prefill, decode = engine("prefill"), engine("decode")
    streamer, intake = loopback_pair(prefill, decode)
    p, d = streamer.connector, intake.connector
    d.settle_s = 0.3
    idle = decode.pool.num_blocks
    first = ids(40, 5)
    colocated = engine()
    want1 = colocated.generate([first], params)[0].token_ids
    try:
        got, _ = run_in_process(streamer, intake, decode, {"t1": first}, params)
        assert got["t1"] == want1
        turn = first + want1 + ids(20, 6)

        def ended(rid: str, timeout: float = 10) -> None:
            deadline = time.monotonic() + timeout
            while rid in decode.seqs or intake.busy():
                assert time.monotonic() < deadline, f"{rid}: blocks still held"
                streamer.step()
                intake.poll()
                time.sleep(0.005)
            assert decode.pool.num_free_blocks == idle and not any(decode.pool.ref_counts)

        intake.lease_s = 0.3  # never prefilled: the lease runs out, then settles
        assert intake.reserve(Request("expired", turn, params)).cached_blocks == 3
        ended("expired")
        intake.lease_s = 30.0
        handle = intake.reserve(Request("failed", turn, params), p.meta.engine_id)
        streamer.add(Request("failed", turn, params), handle)
        streamer.abort("failed")  # the prefill side gives up: the decode side hears it at once
        ended("failed", timeout=5)
        handle = intake.reserve(Request("aborted", turn, params), p.meta.engine_id)
        intake.abort("aborted")  # the client left: the prefill side answers the abort at once
        ended("aborted", timeout=5)
        got, handles = run_in_process(streamer, intake, decode, {"t2": turn}, params)
        assert handles["t2"].cached_blocks == 3 and intake.blocks_reused == 3
        assert got["t2"] == colocated.generate([turn], params)[0].token_ids
    finally:
        p.close()
        d.close()
    assert decode.pool.num_free_blocks == idle and prefill.pool.num_free_blocks == prefill.pool.num_blocks


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> str:
    ck = build_checkpoint("deepseek_v2", tmp_path_factory.mktemp("reuse"))
    write_tokenizer(ck.path, ck.hf_model.config.vocab_size)
    return str(ck.path)


@pytest.mark.parametrize("backend,model,kv_cache_dtype", [
    ("tcp", "tiny-moe", "auto"), ("nixl", "tiny-moe", "auto"), ("nixl", "deepseek_v2", "auto"),
    ("tcp", "tiny-moe", "fp8_e4m3")])
def test_the_next_turn_moves_only_its_new_kv(backend, model, kv_cache_dtype, request):
    """Two processes, a real backend. Turn 1 moves its whole prompt's KV; then, at once, turn 2
    (turn 1's prompt + answer + new text) and a request sharing turn 1's first two blocks reserve
    with the decode side's cached blocks, the prefill side computes what its own cache lacks and
    sends exactly the blocks after the decode side's, and both decode what colocated generation
    does. Aborts of reservations holding cached blocks then leave the decode pool idle."""
    path = request.getfixturevalue("deepseek") if model == "deepseek_v2" else model
    vocab = 128 if model == "deepseek_v2" else 256
    params = SamplingParams(**GREEDY)
    colocated = Engine(EngineConfig(model=ModelConfig(path=path, kv_cache_dtype=kv_cache_dtype), num_kv_blocks=160))
    first = ids(40, 7, vocab)
    [want1] = [c.token_ids for c in colocated.generate([first], params)]
    turn2 = first + want1 + ids(20, 8, vocab)  # 72 tokens: 5 blocks; 51 computed in turn 1: 3 cached
    sibling = first[:32] + ids(10, 9, vocab)  # 42 tokens: 3 blocks, the first 2 cached
    want2 = [c.token_ids for c in colocated.generate([turn2, sibling], params)]

    p, d = start_pair(backend, model=path, kv_cache_dtype=kv_cache_dtype)
    pid = KVAgentMetadata.unpack(p.call("meta")).engine_id
    try:
        def turn(requests: dict[str, list[int]]) -> tuple[dict, dict]:
            handles = {}
            for rid, prompt in requests.items():
                handles[rid] = ReserveHandle.unpack(d.call("reserve", rid, prompt, GREEDY, 30.0, pid))
                p.call("prefill", rid, prompt, GREEDY, handles[rid].pack())
            presults, _, _ = p.call("run", 60)
            dresults, dfree, didle = d.call("run", 60)
            assert presults == {rid: True for rid in requests} and dfree == didle
            return dresults, handles

        got, handles = turn({"t1": first})
        assert got["t1"] == want1 and handles["t1"].cached_blocks == 0
        reused0, received0, block_bytes = d.call("counters")
        assert (reused0, received0) == (0, 3 * block_bytes)
        assert [b for b, _ in p.call("delivered")] == [3 * block_bytes]
        computed0 = p.call("profile")["tokens_computed"]
        assert computed0 == 40

        got, handles = turn({"t2": turn2, "s": sibling})
        assert [got["t2"], got["s"]] == want2
        assert (handles["t2"].cached_blocks, len(handles["t2"].block_ids)) == (3, 2)
        assert (handles["s"].cached_blocks, len(handles["s"].block_ids)) == (2, 1)
        # Exactly the blocks after the cached ones moved, on both sides' counts.
        assert sorted(b for b, _ in p.call("delivered")) == [1 * block_bytes, 2 * block_bytes]
        assert d.call("counters") == (5, received0 + 3 * block_bytes, block_bytes)
        # The prefill side's own cache held turn 1's two full prompt blocks: it computed the rest.
        assert p.call("profile")["tokens_computed"] - computed0 == (72 - 32) + (42 - 32)

        # Reservations holding cached blocks that end without their KV: the decode side aborts one
        # before its prefill arrives, the prefill side another mid-way. Both pools go back to idle.
        a = ReserveHandle.unpack(d.call("reserve", "a", turn2, GREEDY, 30.0, pid))
        d.call("abort", "a")
        p.call("prefill", "a", turn2, GREEDY, a.pack())
        b = ReserveHandle.unpack(d.call("reserve", "b", turn2, GREEDY, 30.0, pid))
        p.call("prefill", "b", turn2, GREEDY, b.pack())
        p.call("abort", "b")
        assert a.cached_blocks == b.cached_blocks == 4  # turn 2 computed 83 tokens: its first 4 blocks
        presults, pfree, pidle = p.call("run", 20)
        dresults, dfree, didle = d.call("run", 20)
        assert presults == {"a": False, "b": False} and dresults == {"a": "failed", "b": "failed"}
        assert pfree == pidle and dfree == didle
        assert d.call("counters")[:2] == (5, received0 + 3 * block_bytes)  # nothing arrived: nothing counted
    finally:
        p.stop()
        d.stop()


def test_an_expert_parallel_decode_replica_reuses_each_ranks_own_cache():
    """Two EP ranks (gloo), each with its own block pool fed by a prefill engine through the real
    connectors: each rank's second turn reserves with its own cached blocks, and every rank decodes
    what one colocated engine generates."""
    params = SamplingParams(**GREEDY)
    firsts = [ids(40, 10 + r) for r in range(2)]
    colocated = engine()
    want1 = [c.token_ids for c in colocated.generate(firsts, params)]
    news = [ids(20 + 4 * r, 20 + r) for r in range(2)]
    turns = [f + w + n for f, w, n in zip(firsts, want1, news)]
    want2 = [c.token_ids for c in colocated.generate(turns, params)]
    ranks = run_disaggregated("tiny-moe", firsts, news, GREEDY)
    for r, out in enumerate(ranks):
        assert out["tokens"] == [want1[r], want2[r]], f"rank {r}"
        assert out["cached_blocks"] == [0, 3] and out["blocks_reused"] == 3, f"rank {r}"
        assert out["free_blocks"] == out["num_blocks"], f"rank {r}: blocks left in use"
