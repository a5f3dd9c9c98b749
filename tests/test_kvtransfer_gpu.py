"""KV transfer between two GPUs (runs where two are present; skipped on CPU machines).

Same contract as tests/test_kvtransfer.py, on GPU memory: nixl (VRAM over UCX) and cuda_ipc.
"""

import pytest
import torch

from kv_pair import engine_config, start_pair
from pdserve.engine.engine import Engine
from pdserve.protocol import SamplingParams

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

GREEDY = dict(max_tokens=12, temperature=0, ignore_eos=True)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in [1, 15, 16, 17, 1000]]


@pytest.mark.parametrize("backend", ["nixl", "cuda_ipc"])
@pytest.mark.parametrize("fragment", [False, True], ids=["fresh", "fragmented"])
def test_gpu_disaggregated_greedy_equals_colocated(backend, fragment):
    _pair_equals_colocated(backend, fragment)


def _pair_equals_colocated(backend: str, fragment: bool = False, **engine_kw) -> None:
    """Five prompts prefilled on GPU 0 and decoded on GPU 1 give a colocated engine's greedy tokens,
    and both pools come back to idle."""
    engine = Engine(engine_config("colocated", 0, "cuda:0", **engine_kw))
    expected = [c.token_ids for c in engine.generate(prompts(), SamplingParams(**GREEDY))]
    del engine
    p, d = start_pair(backend, fragment=fragment, devices=("cuda:0", "cuda:1"), **engine_kw)
    try:
        for i, prompt in enumerate(prompts()):
            handle = d.call("reserve", f"r{i}", prompt, GREEDY, 30.0, None)
            p.call("prefill", f"r{i}", prompt, GREEDY, handle)
        presults, pfree, pidle = p.call("run", 60)
        dresults, dfree, didle = d.call("run", 60)
        assert presults == {f"r{i}": True for i in range(5)}
        assert [dresults[f"r{i}"] for i in range(5)] == expected
        assert pfree == pidle and dfree == didle
    finally:
        p.stop()
        d.stop()


def test_block_copy_kernel_between_gpus():
    """The cuda_ipc copy kernel, GPU0 -> GPU1 over the peer mapping, random blocks, all layers."""
    from pdserve.kvtransfer.backends.block_copy import copy_blocks

    torch.cuda.set_device(0)
    src = torch.randn(6, 2, 40, 16, 4, 128, dtype=torch.bfloat16, device="cuda:0")
    dst = torch.randn(6, 2, 50, 16, 4, 128, dtype=torch.bfloat16, device="cuda:1")
    torch.ones(1, device="cuda:1").copy_(torch.ones(1, device="cuda:0"))  # enables peer access
    want = dst.cpu()
    s, d = torch.randperm(40)[:17], torch.randperm(50)[:17]
    copy_blocks(src, dst, 1, 4, s.to("cuda:0", torch.int32), d.to("cuda:0", torch.int32))
    torch.cuda.synchronize(0)
    want[1:5, :, d] = src[1:5, :, s].cpu()
    assert torch.equal(dst.cpu(), want)


def test_block_copy_compiled_launch_between_gpus():
    """BlockCopy's later calls launch the compiled kernel directly (no JIT): every call of one
    instance — other blocks, other layers, odd counts, a side stream, ids off the 16-byte
    alignment (back through the JIT) — copies exactly what indexing would."""
    from pdserve.kvtransfer.backends.block_copy import BlockCopy

    torch.cuda.set_device(0)
    src = torch.randn(6, 2, 40, 16, 4, 128, dtype=torch.bfloat16, device="cuda:0")
    dst = torch.randn(6, 2, 50, 16, 4, 128, dtype=torch.bfloat16, device="cuda:1")
    torch.ones(1, device="cuda:1").copy_(torch.ones(1, device="cuda:0"))
    copy = BlockCopy(src, dst)
    side = torch.cuda.Stream(device="cuda:0")
    g = torch.Generator().manual_seed(5)
    for i, (first, count, n) in enumerate([(0, 6, 17), (2, 1, 3), (5, 1, 40), (1, 4, 1), (0, 6, 9)]):
        want = dst.cpu()
        s, d = torch.randperm(40, generator=g)[:n], torch.randperm(50, generator=g)[:n]
        ids = torch.cat([torch.zeros(1, dtype=torch.int32), s.int(), d.int()]).to("cuda:0")
        sid, did = (ids[1:n + 1], ids[n + 1:]) if i == 4 else (ids[1:n + 1].clone(), ids[n + 1:].clone())
        if i % 2:
            side.wait_stream(torch.cuda.current_stream())
            copy(first, count, sid, did, stream=side.cuda_stream)
            side.synchronize()
        else:
            copy(first, count, sid, did)
        torch.cuda.synchronize(0)
        want[first:first + count, :, d] = src[first:first + count, :, s].cpu()
        assert torch.equal(dst.cpu(), want), (first, count, n)
    assert copy._kernel is not None  # the later calls took the compiled kernel's launcher


def test_block_copy_reads_ids_from_pinned_memory():
    """The connector's posts hand the kernel block ids in pinned host memory (read over PCIe,
    nothing uploaded), refilled between posts: each copy moves the blocks its ids name at its
    launch, whether through the JIT (first call) or the compiled kernel's launcher, with a count
    shorter than the slot (`n`)."""
    from pdserve.kvtransfer.backends.block_copy import BlockCopy

    torch.cuda.set_device(0)
    src = torch.randn(6, 2, 40, 16, 4, 128, dtype=torch.bfloat16, device="cuda:0")
    dst = torch.randn(6, 2, 50, 16, 4, 128, dtype=torch.bfloat16, device="cuda:1")
    torch.ones(1, device="cuda:1").copy_(torch.ones(1, device="cuda:0"))
    slot = torch.zeros(2, 48, dtype=torch.int32, pin_memory=True)
    copy = BlockCopy(src, dst)
    g = torch.Generator().manual_seed(7)
    for first, count, n in [(0, 6, 17), (3, 2, 40), (1, 1, 5)]:
        want = dst.cpu()
        s, d = torch.randperm(40, generator=g)[:n], torch.randperm(50, generator=g)[:n]
        slot[0, :n], slot[1, :n] = s, d
        copy(first, count, slot[0], slot[1], n=n)
        torch.cuda.synchronize(0)
        want[first:first + count, :, d] = src[first:first + count, :, s].cpu()
        assert torch.equal(dst.cpu(), want), (first, count, n)
    assert copy._kernel is not None


def test_gpu_fp8_cache_over_cuda_ipc_equals_colocated():
    """An FP8 cache (kv_cache_dtype: fp8_e4m3) moved by cuda_ipc's copy kernel, which moves words
    whatever they hold: the decode GPU continues as a colocated FP8 engine does; pools come back."""
    _pair_equals_colocated("cuda_ipc", kv_cache_dtype="fp8_e4m3")