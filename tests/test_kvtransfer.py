"""KV transfer between a prefill process and a decode process, both backends, real sockets/UCX.

The decode side's greedy continuation must equal colocated generation, and every fault —
a dead peer, an abort from either side, a lease running out — must leave both pools idle.
"""

import os
import signal
import threading
import time
from dataclasses import asdict

import msgpack
import numpy as np
import pytest
import torch

from hf_checkpoints import build_checkpoint, write_tokenizer
from kv_pair import (LoopbackBackend, Worker, _decode_main, _prefill_main, assert_staged, assert_staging_idle,
                     loopback_connectors, loopback_pair, start_pair, tiny_kv)
from pdserve.messages import Request
from pdserve.forward.kv_cache import KVLayout, allocate_kv_cache
from pdserve.kvtransfer.wire import Notice, ReserveHandle
from pdserve.kvtransfer.metadata import HandshakeError, KVAgentMetadata, accept_peer
from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.protocol import SamplingParams

BACKENDS = ["tcp", "nixl"]
# The fault contract also holds for the same-host GPU backend, where two GPUs are present (its
# greedy equality, against a GPU colocated run, is in tests/test_kvtransfer_gpu.py).
FAULT_BACKENDS = BACKENDS + (["cuda_ipc"] if torch.cuda.device_count() >= 2 else [])
PROMPT_LENS = [1, 15, 16, 17, 1000]
GREEDY = dict(max_tokens=12, temperature=0, ignore_eos=True)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def colocated() -> list[list[int]]:
    engine = Engine(EngineConfig(model=ModelConfig(path="tiny-moe"), num_kv_blocks=160))
    return [c.token_ids for c in engine.generate(prompts(), SamplingParams(**GREEDY))]


def transfer_all(p, d, ps, lease_s=30.0):
    for i, prompt in enumerate(ps):
        handle = d.call("reserve", f"r{i}", prompt, GREEDY, lease_s, None)
        assert handle is not None
        p.call("prefill", f"r{i}", prompt, GREEDY, handle)
    presults, pfree, pidle = p.call("run", 60)
    dresults, dfree, didle = d.call("run", 60)
    return presults, dresults, (pfree, pidle), (dfree, didle)


# Blocks as a fresh cache gives them (one run), fragmented (runs of two) and scattered (no two
# next to each other), on both sides.
LAYOUTS = [False, True, "scattered"]
LAYOUT_IDS = ["fresh", "fragmented", "scattered"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fragment", LAYOUTS, ids=LAYOUT_IDS)
def test_disaggregated_greedy_equals_colocated(backend, fragment, colocated):
    """NIXL moves fragmented and scattered KV through staging slots (five leases, four slots: one
    takes the per-block path), fresh KV (one run a request) without."""
    p, d = start_pair(backend, fragment=fragment)
    try:
        presults, dresults, (pfree, pidle), (dfree, didle) = transfer_all(p, d, prompts())
        assert presults == {f"r{i}": True for i in range(len(PROMPT_LENS))}
        assert [dresults[f"r{i}"] for i in range(len(PROMPT_LENS))] == colocated
        assert pfree == pidle and dfree == didle
        if backend == "nixl":
            assert_staged(p, d, fragment)
        assert_staging_idle(p, d)
    finally:
        p.stop()
        d.stop()


@pytest.fixture(scope="module")
def mla_models(tmp_path_factory) -> dict[str, str]:
    """The tiny DeepSeek-V2 and -V3 checkpoints of the HF parity tests, with a tokenizer."""
    root = tmp_path_factory.mktemp("mla")
    out = {}
    for family in ("deepseek_v2", "deepseek_v3"):
        ck = build_checkpoint(family, root)
        write_tokenizer(ck.path, ck.hf_model.config.vocab_size)
        out[family] = str(ck.path)
    return out


# Within the tiny checkpoints' 256 positions; ids within their 128-token vocabulary.
MLA_PROMPT_LENS = [1, 15, 16, 17, 200]


@pytest.mark.parametrize("family,backend,fragment", [
    ("deepseek_v2", "tcp", False), ("deepseek_v2", "nixl", False), ("deepseek_v2", "nixl", True),
    ("deepseek_v2", "nixl", "scattered"), ("deepseek_v3", "tcp", False), ("deepseek_v3", "nixl", True)],
    ids=["v2-tcp-fresh", "v2-nixl-fresh", "v2-nixl-fragmented", "v2-nixl-scattered", "v3-tcp-fresh",
         "v3-nixl-fragmented"])
def test_mla_disaggregated_greedy_equals_colocated(family, backend, fragment, mla_models):
    """Multi-head Latent Attention: the cache holds one latent plane (kv_lora_rank + qk_rope_head_dim
    per token and layer, no V), and the backends move its blocks as they move K/V: the decode side
    continues exactly as colocated generation does."""
    path = mla_models[family]
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(0, 128, (n,), generator=g).tolist() for n in MLA_PROMPT_LENS]
    engine = Engine(EngineConfig(model=ModelConfig(path=path), num_kv_blocks=160))
    assert engine.layout.kind == "latent" and engine.kv_cache.shape[1] == 1
    want = [c.token_ids for c in engine.generate(ps, SamplingParams(**GREEDY))]
    p, d = start_pair(backend, fragment=fragment, model=path)
    try:
        presults, dresults, (pfree, pidle), (dfree, didle) = transfer_all(p, d, ps)
        assert presults == {f"r{i}": True for i in range(len(ps))}
        assert [dresults[f"r{i}"] for i in range(len(ps))] == want
        assert pfree == pidle and dfree == didle
        if backend == "nixl":  # the latent plane through the slots too
            assert_staged(p, d, fragment)
        assert_staging_idle(p, d)
    finally:
        p.stop()
        d.stop()


def test_a_latent_cache_and_a_kv_cache_refuse_each_other_naming_the_layout():
    """The handshake compares layouts first: a latent (MLA) cache never takes a K/V cache's blocks,
    even where the two happen to be as many bytes."""
    kv = tiny_kv()  # [2 layers, K/V, 8 blocks, 4 tokens, 2 heads, 8]: 64 bytes a plane's block
    latent_layout = KVLayout(2, 8, 4, 1, 16, torch.float32, "latent")  # 64 bytes a block too
    latent = (allocate_kv_cache(latent_layout, torch.device("cpu")), latent_layout, "tiny")
    assert latent_layout.bytes_per_block == kv[1].bytes_per_block
    ours, theirs = (KVAgentMetadata.for_cache(name, "tcp", *c) for name, c in (("mla", latent), ("gqa", kv)))
    with pytest.raises(HandshakeError, match=r"layout: ours 'layers,latent,.*'gqa' has 'layers,kv,.*num_planes"):
        accept_peer(ours, theirs.pack())  # what either connector's add_peer does first
    with pytest.raises(HandshakeError, match=r"layout: ours 'layers,kv,.*'mla' has 'layers,latent,"):
        accept_peer(theirs, ours.pack())


def test_a_peer_of_another_version_is_refused_by_name():
    """Metadata with a field missing (a worker from before num_planes) or one unknown to us is a
    named refusal, not a TypeError from the constructor."""
    ours = KVAgentMetadata.for_cache("p", "tcp", *tiny_kv())
    old = asdict(ours)
    del old["num_planes"]
    with pytest.raises(HandshakeError, match=r"peer 'p' speaks another pdserve version.*missing: num_planes; "
                                             r"unknown: none\): run one pdserve version"):
        accept_peer(ours, msgpack.packb(old))
    with pytest.raises(HandshakeError, match=r"missing: none; unknown: kv_scale"):
        accept_peer(ours, msgpack.packb({**asdict(ours), "kv_scale": 1.0}))


@pytest.mark.parametrize("kind", ["kv", "latent"])
def test_every_backend_addresses_a_block_where_the_layout_puts_it(kind):
    """NIXL's descriptor rows, the handshake's offsets and the allocation agree for either layout:
    row (layer * planes + plane) * blocks + block is that block's bytes."""
    from pdserve.kvtransfer.backends.nixl_descs import block_descs, plane_indices

    layout = KVLayout(3, 5, 4, *((2, 8) if kind == "kv" else (1, 24)), torch.float32, kind)
    kv = allocate_kv_cache(layout, torch.device("cpu"))
    meta = KVAgentMetadata.for_cache("e", "nixl", kv, layout, "f")
    rows = block_descs(meta.base_addr, meta.num_layers, meta.num_blocks, meta.bytes_per_block, 0, meta.num_planes)
    assert len(rows) == 3 * layout.num_planes * 5 and rows[-1][0] + rows[-1][1] == kv.data_ptr() + kv.nbytes
    blocks = np.array([4, 1])
    for layer in range(3):
        idx = plane_indices(layer, blocks, 5, meta.num_planes)
        want = [meta.base_addr + meta.offset(layer, plane, b) for plane in range(layout.num_planes) for b in blocks]
        assert rows[idx, 0].tolist() == want
        assert want == [kv[layer, plane, b].data_ptr() for plane in range(layout.num_planes) for b in blocks]


def test_finish_notice_carries_the_first_tokens_logprob_only_where_asked():
    lp = [-0.25, [[7, -0.25], [300, -1.5]]]
    n = Notice("finish", "r", 7, sender="p", first_logprob=lp)
    assert Notice.unpack(n.pack()) == n
    plain = Notice("finish", "r", 7, sender="p")  # no logprobs asked for: the notice as it always was
    assert msgpack.unpackb(plain.pack()) == {"kind": "finish", "request_id": "r", "first_token": 7, "sender": "p"}
    assert Notice.unpack(plain.pack()) == plain


LOGPROBS = dict(GREEDY, logprobs=2)


@pytest.mark.parametrize("backend", FAULT_BACKENDS)
def test_decode_side_streams_the_first_tokens_logprob(backend):
    """The first token is sampled on the prefill side; its logprob crosses in the finish notice, so
    the decode side's first output has its entry, and every request has one per token."""
    ps = prompts()[:4]
    p, d = start_pair(backend)
    try:
        for i, prompt in enumerate(ps):
            handle = d.call("reserve", f"r{i}", prompt, LOGPROBS, 30.0, None)
            p.call("prefill", f"r{i}", prompt, LOGPROBS, handle)
        presults, _, _ = p.call("run", 60)
        dresults, dfree, didle = d.call("run", 60)
        outputs = d.call("logprobs")
        assert presults == {f"r{i}": True for i in range(len(ps))} and dfree == didle
    finally:
        p.stop()
        d.stop()
    if backend == "cuda_ipc":  # on GPUs: not the CPU reference's numbers
        want = [None] * len(ps)
    else:
        engine = Engine(EngineConfig(model=ModelConfig(path="tiny-moe"), num_kv_blocks=160))
        want = engine.generate(ps, SamplingParams(**LOGPROBS))
    for i, w in enumerate(want):
        tokens, outs = dresults[f"r{i}"], outputs[f"r{i}"]
        assert [lp.token_id for lp in outs[0]] == tokens[:1]  # the first output: the prefill side's token
        got = [lp for out in outs for lp in out]
        assert [lp.token_id for lp in got] == tokens and len(tokens) == GREEDY["max_tokens"]
        assert all(len(lp.top) == 2 and lp.top[0][0] == lp.token_id for lp in got)
        if w is not None:
            assert tokens == w.token_ids
            assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in w.logprobs], abs=1e-4)
            assert [lp.text for lp in got] == [lp.text for lp in w.logprobs]


def fault_pair(backend: str):
    """A pair for the fault tests: NIXL's with scattered blocks, so that every lease holds a staging
    slot, which must come back as its blocks do."""
    return start_pair(backend, fragment="scattered" if backend == "nixl" else False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mismatched_fingerprint_is_refused(backend):
    p = Worker(_prefill_main, backend, seed=1)  # other dummy weights: another model
    d = Worker(_decode_main, backend, seed=0)
    try:
        with pytest.raises(RuntimeError, match="HandshakeError.*fingerprint"):
            d.call("add_peer", p.call("meta"))
        with pytest.raises(RuntimeError, match="fingerprint"):
            p.call("add_peer", d.call("meta"))
    finally:
        p.stop()
        d.stop()


@pytest.mark.parametrize("backend", FAULT_BACKENDS)
def test_abort_from_either_side_frees_both(backend):
    p, d = fault_pair(backend)
    pid = KVAgentMetadata.unpack(p.call("meta")).engine_id
    ps = prompts()
    try:
        # Decode side aborts before the prefill starts: the prefill side drops the request.
        h = d.call("reserve", "a", ps[4], GREEDY, 30.0, pid)
        d.call("abort", "a")
        p.call("prefill", "a", ps[4], GREEDY, h)
        # Prefill side aborts: the decode side hears of it long before the 30 s lease ends.
        h = d.call("reserve", "b", ps[4], GREEDY, 30.0, pid)
        p.call("prefill", "b", ps[4], GREEDY, h)
        p.call("abort", "b")
        t0 = time.time()
        presults, pfree, pidle = p.call("run", 20)
        dresults, dfree, didle = d.call("run", 20)
        assert time.time() - t0 < 20
        assert presults.get("a") is False and presults.get("b") is False
        assert dresults == {"a": "failed", "b": "failed"}
        assert pfree == pidle and dfree == didle
        assert_staging_idle(d, used="given")
        assert_staging_idle(p, used="gathered")
    finally:
        p.stop()
        d.stop()


@pytest.mark.parametrize("backend", FAULT_BACKENDS)
def test_decode_abort_after_delivery_is_no_prefill_failure(backend):
    """The decode side aborts a request whose KV the prefill side has delivered but whose "finish"
    it has not read yet: the prefill side's result stays delivered, both pools come back idle."""
    p, d = fault_pair(backend)
    pid = KVAgentMetadata.unpack(p.call("meta")).engine_id
    try:
        h = d.call("reserve", "late", prompts()[4], GREEDY, 30.0, pid)
        p.call("prefill", "late", prompts()[4], GREEDY, h)
        presults, _, _ = p.call("run", 30)
        assert presults == {"late": True}
        d.call("abort", "late")  # before the decode side polled the "finish" notice
        presults, pfree, pidle = p.call("listen", 1.0)  # the abort arrives at the prefill side
        assert "late" not in presults  # not reported failed after it was delivered
        dresults, dfree, didle = d.call("run", 20)
        assert dresults == {"late": "failed"}  # aborted by the client: no tokens streamed
        assert pfree == pidle and dfree == didle
        assert_staging_idle(p, d)
    finally:
        p.stop()
        d.stop()


@pytest.mark.parametrize("backend", FAULT_BACKENDS)
def test_decode_killed_after_reserving_frees_prefill_blocks_within_lease(backend):
    p, d = fault_pair(backend)
    ps = prompts()
    try:
        h = d.call("reserve", "x", ps[4], GREEDY, 3.0, None)
        d.kill()
        p.call("prefill", "x", ps[4], GREEDY, h)
        t0 = time.time()
        presults, pfree, pidle = p.call("run", 30)
        assert presults == {"x": False}
        assert time.time() - t0 < 15
        assert pfree == pidle
        assert_staging_idle(p, used="gathered")
    finally:
        p.stop()
        d.stop()


@pytest.mark.parametrize("backend", FAULT_BACKENDS)
def test_prefill_killed_mid_transfer_frees_decode_blocks(backend):
    p, d = fault_pair(backend)
    pid = KVAgentMetadata.unpack(p.call("meta")).engine_id
    ps = prompts()
    try:
        h = d.call("reserve", "y", ps[4], GREEDY, 3.0, pid)
        p.call("prefill", "y", ps[4], GREEDY, h)
        p.conn.send(("run", 30))  # it starts streaming ...
        time.sleep(0.05)
        p.kill()  # ... and dies
        dresults, dfree, didle = d.call("run", 30)
        assert dresults == {"y": "failed"}
        assert dfree == didle
        assert_staging_idle(d, used="given")
    finally:
        p.stop()
        d.stop()


@pytest.mark.parametrize("backend", FAULT_BACKENDS)
def test_decode_abort_holds_blocks_until_the_prefill_side_stops_writing(backend):
    """A write posted before the abort may still land: the blocks are reused only once the prefill
    side answers (it answers after its writes stopped) or, if it stays silent, after the lease."""
    p, d = fault_pair(backend)
    pid = KVAgentMetadata.unpack(p.call("meta")).engine_id
    ps = prompts()
    lease_s = 2.0
    try:
        # A live prefill side answers at once: the blocks come back long before the lease ends.
        h = d.call("reserve", "live", ps[4], GREEDY, 30.0, pid)
        p.call("prefill", "live", ps[4], GREEDY, h)
        p.conn.send(("run", 30))  # streaming ...
        time.sleep(0.05)
        d.call("abort", "live")  # ... when the decode side gives up
        t0 = time.time()
        dresults, dfree, didle = d.call("run", 20)
        assert dresults == {"live": "failed"} and dfree == didle and time.time() - t0 < 20
        p.conn.recv()
        os.kill(p.proc.pid, signal.SIGSTOP)  # a silent prefill side: it never answers
        assert_staging_idle(d)
        h = d.call("reserve", "silent", ps[4], GREEDY, lease_s, pid)
        held = didle - dfree_after_reserve(d)
        d.call("abort", "silent")
        _, dfree, _ = d.call("run", 0.5)
        assert didle - dfree == held > 0  # still held: the prefill side may yet write
        s = d.call("staging")
        assert s is None or s["idle"] == s["slots"] - 1  # and so is the slot it would write into
        t0 = time.time()
        _, dfree, _ = d.call("run", 30)
        assert dfree == didle  # the lease ran out and the settling time passed
        assert time.time() - t0 < 20
        assert_staging_idle(d)
    finally:
        os.kill(p.proc.pid, signal.SIGCONT)
        p.stop()
        d.stop()


def dfree_after_reserve(d: Worker) -> int:
    return d.call("run", 0.01)[1]



def test_a_handle_carries_the_leases_length_not_a_time_of_day():
    """Hosts' clocks differ: what crosses is how long the lease lasts, and each end counts it from
    when it made or received the handle."""
    made = ReserveHandle("r", "decode-0", [3, 4], 30.0)
    assert msgpack.unpackb(made.pack()) == {"request_id": "r", "engine_id": "decode-0", "block_ids": [3, 4],
                                            "lease_s": 30.0, "cached_blocks": 0}
    time.sleep(0.05)  # on its way
    got = ReserveHandle.unpack(made.pack())
    assert got == made and got.deadline - made.deadline >= 0.05


def test_each_end_counts_the_lease_on_its_own_clock(monkeypatch):
    """The decode end's lease runs out by its clock, the prefill end's by its own, counted from when
    the handle reached it; a prefill host whose wall clock is an hour ahead changes nothing."""
    p, d = loopback_connectors(tiny_kv(), tiny_kv())
    try:
        lease_s, way_s = 1.0, 0.4
        made_at = time.monotonic()
        made = d.reserve("r", [0, 1], lease_s)  # no prefill id: no abort crosses, each end expires alone
        wall = time.time
        monkeypatch.setattr(time, "time", lambda: wall() + 3600)  # the prefill host's clock
        time.sleep(way_s)
        got_at = time.monotonic()
        got = ReserveHandle.unpack(made.pack())
        p.send_layer("r", 0, [0, 1], got)  # posted, never finished: the lease runs out
        failed_at: dict[str, float] = {}
        deadline = time.monotonic() + 10
        while len(failed_at) < 2 and time.monotonic() < deadline:
            if "r" in d.poll().failed:
                failed_at["decode"] = time.monotonic()
            if "r" in p.poll()[1]:
                failed_at["prefill"] = time.monotonic()
            time.sleep(0.005)
        assert lease_s <= failed_at["prefill"] - got_at < lease_s + 1  # from when the handle came
        assert lease_s <= failed_at["decode"] - made_at < lease_s + 1  # from when it was made
    finally:
        p.close()
        d.close()


def test_the_prefill_end_posts_nothing_past_its_lease():
    """A request that reaches its first post after its lease ran out (a long queue) fails without
    writing: the decode end frees those blocks soon after its own deadline."""
    prefill_end, decode_end = tiny_kv(), tiny_kv()
    prefill_end[0].fill_(1.0)
    p, d = loopback_connectors(prefill_end, decode_end)
    try:
        got = ReserveHandle.unpack(d.reserve("r", [0, 1], 0.2).pack())
        time.sleep(0.3)
        p.send_layer("r", 0, [0, 1], got)
        deadline = time.monotonic() + 5
        while "r" not in p.poll()[1]:
            assert time.monotonic() < deadline, "the request never failed"
            time.sleep(0.005)
        assert not decode_end[0].any()  # nothing landed
    finally:
        p.close()
        d.close()


def test_aborts_of_requests_never_prefilled_are_forgotten_once_no_post_can_come():
    """The decode end aborts requests whose prefill never reaches the prefill end (the client left
    first). The prefill end answers at once and refuses their posts while a handle of theirs could
    still come, then forgets them: the record does not grow with every such abort."""
    prefill_end, decode_end = tiny_kv(), tiny_kv()
    prefill_end[0].fill_(1.0)
    p, d = loopback_connectors(prefill_end, decode_end)
    d.settle_s = 0.3
    lease_s, n = 0.5, 200
    try:
        handles = [d.reserve(f"r{i}", [i % 8], lease_s, p.meta.engine_id) for i in range(n)]
        for i in range(n):
            d.release(f"r{i}")
        settled, deadline = set(), time.monotonic() + 10
        while len(settled) < n:  # answered at once: the prefill end held no write of them
            assert time.monotonic() < deadline, f"{n - len(settled)} aborts unanswered"
            settled.update(d.poll().settled)
            time.sleep(0.005)
        late = ReserveHandle.unpack(handles[0].pack())  # one prefill comes after all, within the lease
        p.send_layer("r0", 0, [0], late)
        p.finish("r0", 7)
        while "r0" not in p.poll()[1]:
            assert time.monotonic() < deadline, "the late request never failed"
            time.sleep(0.005)
        assert not decode_end[0].any()  # refused: those blocks may be another request's by now
        time.sleep(lease_s + d.settle_s + 0.2)
        assert len(p._transfers._aborted) == 0
    finally:
        p.close()
        d.close()


class GatedLoopback(LoopbackBackend):
    """A slow network: a write reads its source blocks only once `gate` is open, as a posted NIXL
    WRITE reads them whenever the transfer runs; until then the blocks it will read are `reading()`."""

    def __init__(self, meta, kv_cache):
        super().__init__(meta, kv_cache)
        self.gate = threading.Event()
        self._writes: list[list] = []  # [peer, layer, src, dst, copied]

    def write(self, peer_id: str, layer: int, src_blocks: list[int], dst_blocks: list[int]) -> list:
        w = [peer_id, layer, list(src_blocks), list(dst_blocks), False]
        self._writes.append(w)
        return w

    def state(self, token) -> str:
        if not token[4]:
            if not self.gate.is_set():
                return "pending"
            super().write(*token[:4])
            token[4] = True
        return "done"

    def reading(self) -> set[int]:
        return {b for w in list(self._writes) if not w[4] for b in w[2]}


def test_a_prefill_engine_short_of_blocks_never_hands_out_blocks_its_kv_writes_still_read():
    """Two prompts that need more blocks than the prefill engine has, streamed while the network
    holds every write: no block is handed out while a write that reads it is pending (preempting
    the newer prompt would free blocks it posted), and the decode side decodes what colocated
    generation does."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(0, 256, (80,), generator=g).tolist() for _ in range(2)]  # 5 blocks each
    want = Engine(EngineConfig(model=ModelConfig(path="tiny-moe"), num_kv_blocks=64)).generate(ps, params)
    prefill = Engine(EngineConfig(model=ModelConfig(path="tiny-moe"), role="prefill", num_kv_blocks=8,
                                  chunk_size=16, max_num_batched_tokens=32, enable_prefix_cache=False))
    decode = Engine(EngineConfig(model=ModelConfig(path="tiny-moe"), role="decode", num_kv_blocks=64))
    streamer, intake = loopback_pair(prefill, decode, prefill_backend=GatedLoopback)
    p = streamer.connector
    allocate = prefill.pool.allocate

    def checked_allocate(n, after=None):
        out = allocate(n, after)
        p._post.call(lambda: None)  # every post queued so far has reached the backend
        assert not set(out) & p.backend.reading(), "handed out blocks that pending KV writes read"
        return out

    prefill.pool.allocate = checked_allocate
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(ps))}
    try:
        for i, prompt in enumerate(ps):
            streamer.add(Request(f"r{i}", prompt, params), intake.reserve(Request(f"r{i}", prompt, params)))
        for _ in range(12):  # the network holds every write meanwhile
            streamer.step()
        assert p.backend.reading()
        p.backend.gate.set()
        deadline = time.monotonic() + 60
        while len(outputs["r0"]) + len(outputs["r1"]) < 2 * params.max_tokens:
            assert time.monotonic() < deadline, "the requests did not finish"
            streamer.step()
            assert intake.poll() == []
            for out in decode.step():
                outputs[out.request_id] += out.token_ids
    finally:
        p.close()
        intake.connector.close()
    assert [outputs[f"r{i}"] for i in range(len(ps))] == [w.token_ids for w in want]
    assert prefill.scheduler.num_preemptions == 0  # the newer prompt waited for blocks instead
    assert prefill.pool.num_free_blocks == 8 and decode.pool.num_free_blocks == 64


def raise_once(obj, method: str, error: BaseException) -> None:
    """An injected fault: obj.method raises `error` the first time it is called, then works again."""
    real, armed = getattr(obj, method), [True]

    def faulty(*args, **kw):
        if armed:
            armed.clear()
            raise error
        return real(*args, **kw)

    setattr(obj, method, faulty)


def test_a_dead_posting_thread_fails_every_transfer_and_says_so(caplog):
    """The backend raises where the posting thread polls a post: the thread dies, but not silently.
    The transfer it held fails on both sides at once, one handed in later fails on the prefill side
    at once and on the decode side when its lease runs out, and the connector says why."""
    prefill = Engine(EngineConfig(model=ModelConfig(path="tiny-moe"), role="prefill", num_kv_blocks=64))
    decode = Engine(EngineConfig(model=ModelConfig(path="tiny-moe"), role="decode", num_kv_blocks=64))
    streamer, intake = loopback_pair(prefill, decode)
    p, d = streamer.connector, intake.connector
    intake.lease_s, d.settle_s = 2.0, 0.2
    fault = RuntimeError("transport gone")
    raise_once(p.backend, "state", fault)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompt = list(range(40))
    failed = {"prefill": set(), "decode": set()}

    def run_until(done, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"hung: {failed}"
            failed["prefill"].update(streamer.step()[2])
            failed["decode"].update(rid for rid, _ in intake.poll())
            time.sleep(0.002)

    try:
        streamer.add(Request("held", prompt, params), intake.reserve(Request("held", prompt, params)))
        run_until(lambda: "held" in failed["prefill"] and "held" in failed["decode"], 5)
        assert p.error is fault
        assert any(r.levelname == "ERROR" and "posting thread" in r.getMessage() for r in caplog.records)
        streamer.add(Request("later", prompt, params), intake.reserve(Request("later", prompt, params)))
        run_until(lambda: "later" in failed["prefill"], 5)
        run_until(lambda: "later" in failed["decode"] and not intake.busy(), 10)  # its lease, then settling
    finally:
        p.close()
        d.close()
    assert not streamer.busy()
    assert prefill.pool.num_free_blocks == decode.pool.num_free_blocks == 64


class WaitingLoopback(LoopbackBackend):
    """A loopback backend that can block until a post is done: the connector runs a completion thread."""

    waits = True

    @staticmethod
    def wait(token) -> bool:
        return True


def test_a_dead_completion_thread_takes_the_posting_thread_with_it():
    """A bug kills the completion thread while it holds a finished transfer: that transfer fails on
    both sides, and the connector says why, rather than the transfer waiting out its lease."""
    p, d = loopback_connectors(tiny_kv(), tiny_kv(), prefill_backend=WaitingLoopback)
    try:
        handle = d.reserve("r", [0], 30.0, p.meta.engine_id)
        raise_once(p._transfers, "complete", RuntimeError("a bug"))
        p.send_layer("r", 0, [0], handle)
        p.finish("r", 7)
        failed, deadline = {"prefill": False, "decode": False}, time.monotonic() + 5
        while not all(failed.values()):
            assert time.monotonic() < deadline, f"hung: {failed}"
            failed["prefill"] |= "r" in p.poll()[1]
            failed["decode"] |= "r" in d.poll().failed
            time.sleep(0.005)
        assert p.error is not None
    finally:
        p.close()
        d.close()


def test_a_prefill_worker_whose_posting_thread_died_reports_itself_down():
    """Its stats() raise, which is how a router counts a replica down (and ends its requests)."""
    from pdserve.prefill.worker import PrefillWorker

    worker = PrefillWorker("prefill-hazard", EngineConfig(model=ModelConfig(path="tiny-moe"), role="prefill",
                                                          num_kv_blocks=16), "tcp")
    try:
        assert worker.stats().free_blocks == 16
        raise_once(worker.connector.backend, "notifications", RuntimeError("receiver broke"))
        deadline = time.monotonic() + 5
        while True:  # the posting thread polls notifications even when idle
            try:
                worker.stats()
            except RuntimeError as e:
                assert "KV connector failed" in str(e) and "receiver broke" in str(e)
                break
            assert time.monotonic() < deadline, "stats() never raised"
            time.sleep(0.01)
        assert worker.loop.alive()  # the engine is fine; its KV cannot leave
    finally:
        worker.loop.stop()
        worker.connector.close()
