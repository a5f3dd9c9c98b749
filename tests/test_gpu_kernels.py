"""The GPU kernels (pdserve/ops, Triton) against the torch reference, on fresh random inputs.

Each check poisons the output with NaN first, then compares ‖out − ref‖ / ‖ref‖ with a reference
computed in float64 (CPU) or float32 (GPU) from the same inputs upcast. Two modes:

- a CUDA device: the real kernels, real shapes (skipped without one);
- PDSERVE_TRITON_INTERPRET=1: the same kernels on the CPU under Triton's interpreter, tiny shapes,
  float32/float16 only (the interpreter rounds bfloat16 toward zero; its float8 rounding, which
  drops the carry out of the mantissa, is replaced by torch's round-to-nearest-even, the GPU's).
  Slow: not part of CI.
"""

import copy
import os

INTERPRET = os.environ.get("PDSERVE_TRITON_INTERPRET") == "1"
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated: before importing them

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("no CUDA device (PDSERVE_TRITON_INTERPRET=1 runs the kernels under Triton's interpreter)",
                allow_module_level=True)
triton = pytest.importorskip("triton")

from pdserve.forward.forward_batch import ForwardBatch  # noqa: E402
from pdserve.models.layers import RMSNorm, RotaryEmbedding  # noqa: E402
from pdserve.ops import arrival  # noqa: E402
from pdserve.ops.norms import apply_rotary  # noqa: E402
from pdserve.ops.activation import silu_and_mul  # noqa: E402
from pdserve.ops.attention import TorchAttention, gather, write_kv, write_latent  # noqa: E402
from pdserve.ops.decode_attention import decode_num_splits, paged_decode_attention  # noqa: E402
from pdserve.ops.fused_moe import fused_moe, moe_align  # noqa: E402
from pdserve.ops.gemv_linear import GEMV_LINEAR_MAX_TOKENS, gemv_linear, linear  # noqa: E402
from pdserve.ops.gemv_moe import gemv_moe  # noqa: E402
from pdserve.ops.grouped_mm_moe import grouped_mm_moe  # noqa: E402
from pdserve.ops.kv_write import write_kv_triton, write_latent_triton  # noqa: E402
from pdserve.ops.mla_decode import mla_num_splits, paged_mla_decode  # noqa: E402
from pdserve.ops.moe import TorchMoE, grouped_route, route  # noqa: E402
from pdserve.ops.prefill_attention import paged_prefill_attention  # noqa: E402
from pdserve.ops.rms_norm import fused_add_rms_norm, rms_norm  # noqa: E402
from pdserve.ops.rotary import qk_norm_rope  # noqa: E402
from pdserve.ops.routing import fused_topk, grouped_topk, router_gemv  # noqa: E402
from pdserve.ops.testing import random_moe_inputs, random_paged_case, rel_err  # noqa: E402
from pdserve.ops.triton_attention import TritonAttention  # noqa: E402
from pdserve.ops.triton_moe import TritonMoE  # noqa: E402
from pdserve.ops.triton_norms import TritonNorms  # noqa: E402


def _patch_interpreter() -> None:
    # Triton 3.6's interpreter turns a loaded scalar (a 1-element array) into a Python int with
    # int(array), which numpy >= 2.4 refuses; `range(start, end)` over loaded bounds needs it.
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched

    # Triton 3.9's interpreter rounds float32 -> float8e4nv by adding the cut-off bit to the
    # mantissa without carrying into the exponent (7.9 becomes 4.0); the GPU rounds to nearest even
    # (cvt.rn.satfinite), as torch's conversion does: use torch's for that one conversion.
    import numpy as np
    import triton.language as tl

    convert = interpreter._convert_float

    def convert_float(data, src, dst, rounding_mode):
        if dst == tl.float8e4nv and src == tl.float32:
            x = torch.from_numpy(np.ascontiguousarray(data).view(np.float32))
            return x.to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(data.shape)
        return convert(data, src, dst, rounding_mode)

    interpreter._convert_float = convert_float

    # A mask combining a block with a splatted scalar comparison (the decode kernel's fused write)
    # reaches the interpreter's store as int32, which it refuses: a GPU mask is i1 whatever its way.
    store = interpreter.InterpreterBuilder.create_masked_store

    def masked_store(self, ptrs, value, mask, cache_policy):
        mask = interpreter.TensorHandle(mask.data.astype(np.bool_), mask.dtype)
        return store(self, ptrs, value, mask, cache_policy)

    interpreter.InterpreterBuilder.create_masked_store = masked_store


if INTERPRET:
    _patch_interpreter()

DEVICE = "cpu" if INTERPRET else "cuda"
REF_DTYPE = torch.float64 if INTERPRET else torch.float32
DTYPES = [torch.float32, torch.float16] if INTERPRET else [torch.bfloat16, torch.float16, torch.float32]
# ‖out − ref‖ / ‖ref‖ bounds (METHOD.md): float32 kernels use IEEE dots (no tf32).
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}
BLOCK = 16
FP8 = torch.float8_e4m3fn


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def pick(gpu, interp):
    return interp if INTERPRET else gpu


def poisoned(shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert torch.isfinite(out).all(), f"{what}: output not fully written (NaN/inf left)"
    err = rel_err(out, ref)
    print(f"{what} {str(dtype).removeprefix('torch.')}: rel err {err:.2e}")  # pytest -s shows them
    assert err <= TOL[dtype], f"{what}: relative error {err:.3g} > {TOL[dtype]:.0e}"


def reference_attention(case, scale: float) -> torch.Tensor:
    """TorchAttention over upcast copies of the clean batch; writes the step's KV into ref_batch's
    cache. An FP8 cache stays FP8: the reference reads it dequantized in REF_DTYPE."""
    ref = case.ref_batch
    cache = ref.kv_cache.clone() if ref.kv_scales else ref.kv_cache.to(REF_DTYPE)
    up = ForwardBatch(**{**ref.__dict__, "kv_cache": cache})
    out = TorchAttention().forward(0, case.q.to(REF_DTYPE), case.k.to(REF_DTYPE), case.v.to(REF_DTYPE), up, scale)
    # the expected cache, in the cache's dtype
    write_kv(ref.kv_cache[0], case.k, case.v, ref.slot_mapping, ref.layer_scales(0))
    return out


def assert_cache_written(case) -> None:
    """The step's K/V landed where write_kv puts them, and every context is NaN-free (the unused
    slots of the kernel's cache are NaN: a write to a wrong slot, or a missed one, shows)."""
    b, ours, ref = case.batch, case.batch.kv_cache, case.ref_batch.kv_cache
    filled = ~torch.isnan(ours.float())
    if ours.dtype == FP8:
        # Byte for byte: Triton and torch both round to nearest even, saturating.
        assert torch.equal(ours.view(torch.uint8)[filled], ref.view(torch.uint8)[filled]), \
            "FP8 KV cache differs from write_kv's"
        ours = ours.float()  # for the holes check below
    else:
        assert torch.equal(ours[filled], ref[filled]), "KV cache differs from write_kv's"
    for i, ctx in enumerate(b.context_lens):
        table = b.block_tables[i, : -(-ctx // b.block_size)]
        assert torch.isfinite(ours[0][:, table].flatten(1, 2)[:, :ctx]).all(), f"sequence {i}: context has holes"


# -- KV write -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv(dtype):
    g = gen(1)
    kv_heads, head_dim, blocks = pick((4, 128, 64), (2, 32, 8))
    cache = torch.randn(2, blocks, BLOCK, kv_heads, head_dim, generator=g, device=DEVICE).to(dtype)
    t = pick(300, 20)
    slots = torch.randperm(blocks * BLOCK, device="cpu")[:t].to(DEVICE)
    slots[3] = -1  # padding row: skipped
    k = torch.randn(t, kv_heads, head_dim, generator=g, device=DEVICE).to(dtype)
    v = torch.randn(t, kv_heads, head_dim, generator=g, device=DEVICE).to(dtype)
    ref = cache.clone()
    keep = slots >= 0
    write_kv(ref, k[keep], v[keep], slots[keep])
    write_kv_triton(cache, k, v, slots)
    assert torch.equal(cache, ref)


# -- attention --------------------------------------------------------------------------------------

# (heads, kv_heads, head_dim): GQA ratios 1, 4, 8; head_dim 64 and 128 (tiny ones under the interpreter).
HEADS = pick([(8, 8, 64), (16, 4, 128), (32, 4, 128), (16, 2, 64)], [(4, 4, 16), (8, 2, 32), (8, 1, 32)])
DECODE_CTX = pick([1, 15, 16, 17, 100, 1000, 1023, 4097, 5000], [1, 15, 16, 17, 40, 77])


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention(heads, splits, dtype):
    num_heads, kv_heads, head_dim = heads
    g = gen(2)
    ctx = DECODE_CTX[::-1] + [int(x) for x in torch.randint(1, max(DECODE_CTX), (3,), generator=g, device=DEVICE)]
    case = random_paged_case([(c, 1) for c in ctx], num_heads, kv_heads, head_dim, BLOCK, dtype, DEVICE, g)
    scale = head_dim ** -0.5
    ref = reference_attention(case, scale)
    b = case.batch
    write_kv_triton(b.kv_cache[0], case.k, case.v, b.slot_mapping)
    assert_cache_written(case)
    if splits is None:  # the backend's own choice
        splits = decode_num_splits(len(ctx), kv_heads, max(ctx), torch.device(DEVICE))
    out = poisoned(case.q.shape, dtype)
    paged_decode_attention(case.q, b.kv_cache[0], b.block_tables, b.context_lens_t, scale, splits, out=out)
    check(out, ref, dtype, f"decode {heads} splits={splits}")


def _poison_new_slots(case) -> None:
    """NaN at the step's own slots in the kernel's cache: a fused write that reads its slot back
    (instead of using k/v directly) or misses it shows."""
    cache = case.batch.kv_cache[0]
    planes = cache.shape[0]
    if cache.dtype == FP8:  # float8's NaN byte, through uint8 (no float8 fill)
        cache.view(torch.uint8).view(planes, -1, *cache.shape[3:])[:, case.batch.slot_mapping] = 0x7F
        return
    flat = cache.view(planes, -1, *cache.shape[3:])
    flat[:, case.batch.slot_mapping] = float("nan")


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("splits", [None, 1, 3, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_fused_kv_write(heads, splits, dtype):
    """The decode kernel writing the step's K/V itself: same output as write + decode, same cache."""
    num_heads, kv_heads, head_dim = heads
    g = gen(15)
    ctx = DECODE_CTX[::-1] + [int(x) for x in torch.randint(1, max(DECODE_CTX), (3,), generator=g, device=DEVICE)]
    case = random_paged_case([(c, 1) for c in ctx], num_heads, kv_heads, head_dim, BLOCK, dtype, DEVICE, g)
    scale = head_dim ** -0.5
    ref = reference_attention(case, scale)
    _poison_new_slots(case)
    b = case.batch
    if splits is None:
        splits = decode_num_splits(len(ctx), kv_heads, max(ctx), torch.device(DEVICE))
    out = poisoned(case.q.shape, dtype)
    paged_decode_attention(case.q, b.kv_cache[0], b.block_tables, b.context_lens_t, scale, splits, out=out,
                           block_n=pick(64, 16), k_new=case.k, v_new=case.v, slot_mapping=b.slot_mapping)
    assert_cache_written(case)
    check(out, ref, dtype, f"decode fused write {heads} splits={splits}")


@pytest.mark.parametrize("splits", [1, 3, 16])
def test_decode_prefetch_before_the_wait_changes_nothing(splits, monkeypatch):
    """The decode kernel loading its first chunk of cached K/V before its PDL wait (PDSERVE_PREFETCH's
    "attention") gives the same output and cache bit for bit: empty slices, contexts of one token
    and graph padding (context 0, slot -1) included."""
    from pdserve.ops import pdl

    g = gen(18)
    ctx_list = [1, 2, 17, 77, 40, 64, 65]
    case = random_paged_case([(c, 1) for c in ctx_list], 8, 2, 32, BLOCK, torch.float32, DEVICE, g)
    b = case.batch
    ctx = b.context_lens_t.clone()
    ctx[-1] = 0
    slots = b.slot_mapping.clone()
    slots[-1] = -1
    results = []
    for kinds in (set(), {"attention"}):
        monkeypatch.setattr(pdl, "PREFETCH", kinds)
        cache = b.kv_cache[0].clone()
        out = poisoned(case.q.shape, torch.float32)
        paged_decode_attention(case.q, cache, b.block_tables, ctx, 0.2, splits, out=out, block_n=pick(64, 16),
                               k_new=case.k, v_new=case.v, slot_mapping=slots)
        results.append((out, cache))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(torch.nan_to_num(results[0][1]), torch.nan_to_num(results[1][1]))
    assert torch.isfinite(results[1][0]).all() and (results[1][0][-1] == 0).all()


def test_decode_fused_write_padding_rows():
    """Graph padding rows (context 0, slot -1) write nothing and give zeros; strided k/v views work."""
    g = gen(16)
    case = random_paged_case([(20, 1), (5, 1), (33, 1)], 8, 2, 32, BLOCK, torch.float32, DEVICE, g)
    b = case.batch
    ctx = b.context_lens_t.clone()
    ctx[1] = 0
    slots = b.slot_mapping.clone()
    slots[1] = -1
    kv = torch.cat([case.k, case.v], dim=1)  # k, v as strided views of one tensor
    k, v = kv[:, :2], kv[:, 2:]
    for splits in (1, 4):
        cache = b.kv_cache[0].clone()
        before = cache.clone()
        out = poisoned(case.q.shape, torch.float32)
        paged_decode_attention(case.q, cache, b.block_tables, ctx, 0.2, splits, out=out,
                               k_new=k, v_new=v, slot_mapping=slots)
        assert torch.isfinite(out).all() and (out[1] == 0).all()
        changed = ~((cache == before) | (torch.isnan(cache) & torch.isnan(before)))
        flat = changed.view(2, -1, *cache.shape[3:]).any(-1).any(-1).any(0)
        assert torch.equal(flat.nonzero().flatten().sort().values, slots[[0, 2]].sort().values)


def test_decode_context_zero_gives_zeros():
    """Rows of context 0 (CUDA-graph padding) come out as zeros, not NaN, whatever the split count."""
    g = gen(3)
    case = random_paged_case([(20, 1), (5, 1)], 8, 2, 32, BLOCK, torch.float32, DEVICE, g)
    b = case.batch
    ctx = torch.tensor([20, 0], dtype=torch.int32, device=DEVICE)
    for splits in (1, 4):
        out = poisoned(case.q.shape, torch.float32)
        paged_decode_attention(case.q, case.ref_batch.kv_cache[0], b.block_tables, ctx, 0.2, splits, out=out)
        assert torch.isfinite(out).all() and (out[1] == 0).all()


def _prefill_seqs(g) -> list[tuple[int, int]]:
    """Fresh prompts, chunks continuing a cached prefix (block-aligned or not), and decode rows."""
    if INTERPRET:
        return [(33, 33), (40, 7), (16, 16), (50, 16), (9, 1), (17, 2), (1, 1)]
    seqs = [(600, 600), (5000, 317), (4096, 512), (2048, 16), (3000, 1), (17, 17), (1, 1), (100, 37)]
    n = int(torch.randint(1, 400, (1,), generator=g, device=DEVICE))
    return seqs + [(n + int(torch.randint(0, 2000, (1,), generator=g, device=DEVICE)), n)]


@pytest.mark.parametrize("flat", [False, True], ids=["grid", "flat"])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention(heads, dtype, flat):
    num_heads, kv_heads, head_dim = heads
    g = gen(4)
    case = random_paged_case(_prefill_seqs(g), num_heads, kv_heads, head_dim, BLOCK, dtype, DEVICE, g)
    scale = head_dim ** -0.5
    ref = reference_attention(case, scale)
    b = case.batch
    write_kv_triton(b.kv_cache[0], case.k, case.v, b.slot_mapping)
    assert_cache_written(case)
    out = poisoned(case.q.shape, dtype)
    paged_prefill_attention(case.q, b.kv_cache[0], b.block_tables, b.context_lens_t, b.query_start_t,
                            max(b.query_lens), scale, out=out, flat=flat)
    check(out, ref, dtype, f"prefill {heads}{' flat' if flat else ''}")


@pytest.mark.parametrize("fuse_kv_write", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_backend_mixed_batch(dtype, fuse_kv_write):
    """TritonAttention end to end (KV write + kernel choice), without the ForwardBatch device fields."""
    g = gen(5)
    num_heads, kv_heads, head_dim = HEADS[1]
    seqs = pick([(300, 300), (1200, 1), (700, 64), (33, 1)], [(20, 20), (30, 1), (40, 9)])
    # mixed, then decode only, then fresh prompts only (SDPA on the step's own K/V)
    for rows in (seqs, [(c, 1) for c, _ in seqs], [(n, n) for _, n in seqs if n > 1]):
        case = random_paged_case(rows, num_heads, kv_heads, head_dim, BLOCK, dtype, DEVICE, g)
        case.batch.context_lens_t = case.batch.query_start_t = None
        ref = reference_attention(case, 0.1)
        _poison_new_slots(case)
        out = TritonAttention(fuse_kv_write=fuse_kv_write).forward(0, case.q, case.k, case.v, case.batch, 0.1)
        assert_cache_written(case)
        check(out, ref, dtype, f"backend {rows}")


def _in_prefill_graph(case, bucket: int, slots: int, g: torch.Generator) -> torch.Tensor:
    """TritonAttention over `case`'s step as a prefill graph replays it (engine/prefill_graphs.py):
    rows padded to `bucket` (slot -1, random q/k/v), `slots` sequence slots (those past the case's
    empty), the padding a slot of its own with no context, the host lists placeholders (`varlen_rows`)."""
    b, m = case.batch, case.batch.num_seqs
    n = b.query_start[-1]

    def padded(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.randn(bucket - n, *x.shape[1:], generator=g, device=DEVICE).to(x.dtype)])

    starts, ctx = b.query_start + [n] * (slots - m) + [bucket], b.context_lens + [0] * (slots + 1 - m)
    meta = torch.tensor(starts + ctx, dtype=torch.int32, device=DEVICE)
    tables = torch.zeros(slots + 1, b.block_tables.shape[1], dtype=torch.long, device=DEVICE)
    tables[:m] = b.block_tables
    graph = ForwardBatch(
        input_ids=torch.zeros(bucket, dtype=torch.long, device=DEVICE), positions=padded(b.positions) * 0,
        slot_mapping=torch.cat([b.slot_mapping, torch.full((bucket - n,), -1, device=DEVICE)]),
        block_tables=tables, query_start=[0] * (slots + 1) + [bucket], context_lens=[0] * (slots + 1),
        logits_indices=b.logits_indices, kv_cache=b.kv_cache, context_lens_t=meta[len(starts):],
        query_start_t=meta[:len(starts)], kv_scales=b.kv_scales, varlen_rows=bucket)
    return TritonAttention().forward(0, padded(case.q), padded(case.k), padded(case.v), graph, 0.1)


@pytest.mark.parametrize("fp8", [False, True], ids=["cache", "fp8-cache"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_backend_in_a_prefill_graph_of_several_prompts(dtype, fp8):
    """The batch a CUDA graph of several fresh prompts replays (engine/prefill_graphs.py): rows
    padded to the bucket (slot -1), sequence slots left empty, the padding a slot of its own with no
    context, the host lists placeholders (`varlen_rows`). Each prompt attends over its own K/V, just
    cached; the padding writes no KV and comes out zero."""
    g = gen(6)
    num_heads, kv_heads, head_dim = HEADS[1]
    lens = pick([300, 17, 129, 64], [9, 20, 3])
    extra = dict(cache_dtype=FP8, kv_scales=FP8_SCALES) if fp8 else {}
    case = random_paged_case([(n, n) for n in lens], num_heads, kv_heads, head_dim, BLOCK, dtype, DEVICE, g,
                             **extra)
    ref = reference_attention(case, 0.1)
    _poison_new_slots(case)
    n, m = sum(lens), len(lens)
    bucket, slots = n + pick(101, 7), m + 2  # two empty slots, then the padding's

    out = _in_prefill_graph(case, bucket, slots, g)
    assert_cache_written(case)  # the prompts' K/V where write_kv puts them, nothing else written
    check(out[:n], ref, dtype, f"prefill graph {lens}")
    assert torch.equal(out[n:], torch.zeros_like(out[n:])), "padding rows attend to nothing"


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_eager_chunk_beside_many_decoders_on_the_flat_grid(dtype, monkeypatch):
    """FLAT_EAGER (off by default, until timed): an eager step of a prompt's chunk beside more
    decoders than FLAT_FROM_SLOTS launches the flat grid; each sequence attends as the reference says."""
    from pdserve.ops import triton_attention

    monkeypatch.setattr(triton_attention, "FLAT_EAGER", True)
    g = gen(9)
    num_heads, kv_heads, head_dim = HEADS[1]
    decoders = [(int(c), 1) for c in torch.randint(1, pick(2000, 40), (triton_attention.FLAT_FROM_SLOTS + 3,),
                                                   generator=g, device=DEVICE)]
    rows = decoders[:5] + [(pick(900, 60), pick(400, 25))] + decoders[5:]
    case = random_paged_case(rows, num_heads, kv_heads, head_dim, BLOCK, dtype, DEVICE, g)
    case.batch.context_lens_t = case.batch.query_start_t = None
    ref = reference_attention(case, 0.1)
    _poison_new_slots(case)
    out = TritonAttention().forward(0, case.q, case.k, case.v, case.batch, 0.1)
    assert_cache_written(case)
    check(out, ref, dtype, f"eager chunk beside {len(decoders)} decoders, flat")


@pytest.mark.parametrize("fp8", [False, True], ids=["cache", "fp8-cache"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_backend_in_a_prefill_graph_of_many_sequences(dtype, fp8):
    """A prefill graph of more slots than FLAT_FROM_SLOTS (EngineConfig.prefill_graph_max_seqs raised):
    decoders of long contexts beside a prompt's later chunk and a fresh prompt, most slots empty, the
    padding a slot of its own. Its attention runs the flat grid (the sequences' tiles end to end);
    each sequence attends as the reference says, the padding comes out zero."""
    from pdserve.ops.triton_attention import FLAT_FROM_SLOTS

    g = gen(8)
    num_heads, kv_heads, head_dim = HEADS[1]
    rows = pick([(3000, 1), (40, 1), (700, 300), (129, 129), (5, 1)] + [(int(c), 1) for c in
                                                                      torch.randint(1, 2000, (20,), generator=g, device=DEVICE)],
                [(60, 1), (9, 1), (50, 21), (17, 17), (5, 1)])
    extra = dict(cache_dtype=FP8, kv_scales=FP8_SCALES) if fp8 else {}
    case = random_paged_case(rows, num_heads, kv_heads, head_dim, BLOCK, dtype, DEVICE, g, **extra)
    ref = reference_attention(case, 0.1)
    _poison_new_slots(case)
    n = case.batch.query_start[-1]
    bucket, slots = n + pick(77, 5), FLAT_FROM_SLOTS + 7  # the sequences, empty slots, then the padding's
    assert slots + 1 > FLAT_FROM_SLOTS

    out = _in_prefill_graph(case, bucket, slots, g)
    assert_cache_written(case)
    check(out[:n], ref, dtype, f"prefill graph of {slots + 1} slots")
    assert torch.equal(out[n:], torch.zeros_like(out[n:])), "padding rows attend to nothing"


# -- FP8 KV cache ------------------------------------------------------------------------------------

# (k_scale, v_scale): neither 1 nor equal, so a scale missed, or K's and V's swapped, shows.
FP8_SCALES = (0.5, 2.0)
# The kernels store what the reference stores, byte for byte, and widen it exactly: the bounds are
# the q dtype's (TOL); a scale missed or swapped errs by 50 % and more.


def fp8_case(seqs, heads, dtype, g):
    num_heads, kv_heads, head_dim = heads
    return random_paged_case(seqs, num_heads, kv_heads, head_dim, BLOCK, dtype, DEVICE, g,
                             cache_dtype=FP8, kv_scales=FP8_SCALES)


def check_fp8(out, ref, dtype, what) -> None:
    check(out, ref, dtype, f"{what} over an FP8 cache")


def test_write_kv_fp8():
    """write_kv_triton quantizes as kv_quant does: value / scale, saturated at ±448 (large values
    included), K and V through their own scales."""
    g = gen(21)
    kv_heads, head_dim, blocks = pick((4, 128, 64), (2, 32, 8))
    cache = (torch.randn(2, blocks, BLOCK, kv_heads, head_dim, generator=g, device=DEVICE)).to(FP8)
    t = pick(300, 20)
    slots = torch.randperm(blocks * BLOCK, device="cpu")[:t].to(DEVICE)
    slots[3] = -1
    k = torch.randn(t, kv_heads, head_dim, generator=g, device=DEVICE) * 3
    v = torch.randn(t, kv_heads, head_dim, generator=g, device=DEVICE) * 3
    k[0, 0, :4] = torch.tensor([1000.0, -1000.0, 200.0, 1e-3])  # beyond ±448 * 0.5: saturates
    ref = cache.clone()
    keep = slots >= 0
    write_kv(ref, k[keep], v[keep], slots[keep], FP8_SCALES)
    write_kv_triton(cache, k, v, slots, FP8_SCALES)
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))
    assert cache.float().abs().max() == 448.0 and torch.isfinite(cache.float()).all()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_fp8(fused, splits, dtype):
    """Paged decode over an FP8 cache against the torch reference reading it dequantized; with the
    fused write the kernel stores the new K/V quantized and attends to what it stored."""
    heads = HEADS[1]
    g = gen(22)
    case = fp8_case([(c, 1) for c in DECODE_CTX[::-1]], heads, dtype, g)
    ref = reference_attention(case, heads[2] ** -0.5)
    b = case.batch
    if fused:
        _poison_new_slots(case)
        new_kv = dict(k_new=case.k, v_new=case.v, slot_mapping=b.slot_mapping)
    else:
        write_kv(b.kv_cache[0], case.k, case.v, b.slot_mapping, FP8_SCALES)  # torch's rounding: reading alone
        new_kv = {}
    out = poisoned(case.q.shape, dtype)
    paged_decode_attention(case.q, b.kv_cache[0], b.block_tables, b.context_lens_t, heads[2] ** -0.5, splits,
                           out=out, block_n=pick(64, 16), kv_scales=FP8_SCALES, **new_kv)
    assert_cache_written(case)
    check_fp8(out, ref, dtype, f"decode fused={fused} splits={splits}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_fp8(dtype):
    heads = HEADS[1]
    g = gen(23)
    case = fp8_case(_prefill_seqs(g), heads, dtype, g)
    ref = reference_attention(case, heads[2] ** -0.5)
    b = case.batch
    write_kv(b.kv_cache[0], case.k, case.v, b.slot_mapping, FP8_SCALES)
    out = poisoned(case.q.shape, dtype)
    paged_prefill_attention(case.q, b.kv_cache[0], b.block_tables, b.context_lens_t, b.query_start_t,
                            max(b.query_lens), heads[2] ** -0.5, out=out, kv_scales=FP8_SCALES)
    check_fp8(out, ref, dtype, "prefill")


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_backend_fp8(dtype):
    """TritonAttention over an FP8 cache, every path: mixed (prefill kernel), decode only (fused
    write) and fresh prompts (SDPA over the step's K/V rounded through FP8, as the cache holds them)."""
    g = gen(24)
    heads = HEADS[1]
    seqs = pick([(300, 300), (1200, 1), (700, 64), (33, 1)], [(20, 20), (30, 1), (40, 9)])
    for rows in (seqs, [(c, 1) for c, _ in seqs], [(n, n) for _, n in seqs if n > 1]):
        case = fp8_case(rows, heads, dtype, g)
        ref = reference_attention(case, 0.1)
        _poison_new_slots(case)
        out = TritonAttention().forward(0, case.q, case.k, case.v, case.batch, 0.1)
        assert_cache_written(case)
        check_fp8(out, ref, dtype, f"backend {rows}")


# -- Multi-head Latent Attention ----------------------------------------------------------------------

# (heads, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim): DeepSeek-V2-Lite's (16
# heads: one program's head block), V2/V3's 128 heads (eight blocks) and 20 (a partial second
# block); tiny widths under the interpreter, latent ranks that are no power of two.
MLA_SHAPES = pick([(16, 512, 64, 128, 128), (128, 512, 64, 128, 128), (20, 512, 64, 128, 128)],
                  [(4, 24, 8, 16, 12), (20, 40, 8, 16, 12)])
MLA_CTX = pick([1, 15, 16, 17, 100, 1000, 1023, 4097, 5000], [1, 15, 16, 17, 33, 50])
LATENT_SCALE = 0.5  # an FP8 latent's scale: not 1, so a scale missed or applied twice shows


def latent_case(seqs, shape, dtype, g, absorbed: bool, fp8: bool = False):
    """A latent cache (one plane, one entry of rank + rope per token) and the step's latents; q is
    absorbed ([T, heads, rank + rope], the decode kernel's input) or the model's [T, heads, nope + rope]."""
    heads, rank, rope, nope, _ = shape
    return random_paged_case(seqs, heads, 1, rank + rope, BLOCK, dtype, DEVICE, g, planes=1,
                             q_dim=(rank if absorbed else nope) + rope, cache_dtype=FP8 if fp8 else None,
                             kv_scales=(LATENT_SCALE,) if fp8 else ())


def latent_reference(case, rank: int, scale: float) -> torch.Tensor:
    """Attention in latent space from its definition, in REF_DTYPE: every head's scores q·entry over
    its sequence's cache entries [c_kv, k_rope] (dequantized), values c_kv -> [B, heads, rank].
    Writes the step's latents into ref_batch's cache first (write_latent: the expected cache)."""
    ref = case.ref_batch
    write_latent(ref.kv_cache[0], case.latent, ref.slot_mapping, ref.layer_scales(0))
    out = []
    for i, ctx in enumerate(ref.context_lens):
        table = ref.block_tables[i, : -(-ctx // BLOCK)]
        entries = gather(ref.kv_cache[0], table, ref.layer_scales(0), REF_DTYPE).flatten(1, 2)[0, :ctx, 0]
        p = torch.softmax(case.q[ref.query_start[i]].to(REF_DTYPE) @ entries.to(REF_DTYPE).T * scale, -1)
        out.append(p @ entries[:, :rank].to(REF_DTYPE))
    return torch.stack(out)


@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_latent(dtype, fp8):
    """write_latent_triton stores what write_latent stores (FP8: byte for byte, saturating)."""
    g = gen(31)
    dim, blocks = pick((576, 64), (40, 8))
    cache = torch.randn(1, blocks, BLOCK, 1, dim, generator=g, device=DEVICE).to(FP8 if fp8 else dtype)
    t = pick(300, 20)
    slots = torch.randperm(blocks * BLOCK, device="cpu")[:t].to(DEVICE)
    slots[3] = -1  # padding row: skipped
    latent = (torch.randn(t, dim, generator=g, device=DEVICE) * 3).to(dtype)
    latent[0, :2] = 1000.0  # FP8: beyond ±448 * scale, saturates
    scales = (LATENT_SCALE,) if fp8 else ()
    ref = cache.clone()
    keep = slots >= 0
    write_latent(ref, latent[keep], slots[keep], scales)
    write_latent_triton(cache, latent, slots, scales)
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))


# (shape, fp8): every shape over a cache of the model's dtype; the largest over an FP8 cache too,
# where the kernel widens the stored values and folds the one scale into scores and output, and its
# fused write stores the latent quantized (byte for byte as write_latent).
MLA_DECODE_CASES = [(shape, False) for shape in MLA_SHAPES] + [(MLA_SHAPES[-1], True)]


@pytest.mark.parametrize("shape,fp8", MLA_DECODE_CASES, ids=[f"{c[0][0]}h-{'fp8' if c[1] else 'dense'}"
                                                           for c in MLA_DECODE_CASES])
@pytest.mark.parametrize("fused", [False, True], ids=["cached", "fused-write"])
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_decode_kernel(shape, fp8, fused, splits, dtype):
    """The absorbed decode kernel against latent attention from its definition; contexts across
    block boundaries, head blocks full and partial. Fused: the kernel writes the step's latent
    itself and attends to it from registers (its slot poisoned: a read of it shows)."""
    heads, rank, rope, nope, _ = shape
    g = gen(33 if fp8 else 32)
    case = latent_case([(c, 1) for c in MLA_CTX[::-1]], shape, dtype, g, absorbed=True, fp8=fp8)
    scale = (nope + rope) ** -0.5
    ref = latent_reference(case, rank, scale)
    b = case.batch
    scales = (LATENT_SCALE,) if fp8 else ()
    if fused:
        _poison_new_slots(case)
        new = dict(latent_new=case.latent, slot_mapping=b.slot_mapping)
    else:
        if fp8:
            write_latent(b.kv_cache[0], case.latent, b.slot_mapping, scales)
        else:
            write_latent_triton(b.kv_cache[0], case.latent, b.slot_mapping)
        new = {}
    if splits is None:  # the backend's own choice
        splits = mla_num_splits(len(MLA_CTX), heads, max(MLA_CTX), torch.device(DEVICE))
    out = poisoned((len(MLA_CTX), heads, rank), dtype)
    paged_mla_decode(case.q[..., :rank], case.q[..., rank:], b.kv_cache[0], b.block_tables, b.context_lens_t,
                     scale, splits, out=out, kv_scales=scales, **new)
    assert_cache_written(case)
    (check_fp8 if fp8 else check)(out, ref, dtype, f"mla decode {shape} fp8={fp8} splits={splits} fused={fused}")


def test_mla_split_count():
    """One split from MLA_ONE_SPLIT_PROGRAMS programs (sequences x blocks of 16 heads) on — V2-Lite's
    16 heads at batch 256, V3's 128 at batch 32 — where the GQA kernel's rule (about two programs
    per SM) would cut the context in two on an H200; below, that rule, capped by the context."""
    from pdserve.ops.mla_decode import MLA_ONE_SPLIT_PROGRAMS

    dev = torch.device(DEVICE)
    assert mla_num_splits(MLA_ONE_SPLIT_PROGRAMS, 16, 1024, dev) == 1
    assert mla_num_splits(256, 16, 1024, dev) == mla_num_splits(32, 128, 1024, dev) == 1
    if not INTERPRET and torch.cuda.get_device_properties(dev).multi_processor_count > 128:
        assert decode_num_splits(256, 1, 1024, dev) == 2  # what the GQA rule gives: the case at hand
    for b, heads in ((1, 16), (64, 16), (255, 16), (8, 128)):
        assert mla_num_splits(b, heads, 1024, dev) == decode_num_splits(b, -(-heads // 16), 1024, dev)
    assert mla_num_splits(1, 16, 64, dev) == 1  # a context of one chunk is not split


def test_mla_decode_padding_rows():
    """CUDA-graph padding rows (context 0, slot -1) write nothing and give zeros, whatever the split."""
    shape = MLA_SHAPES[-1]
    heads, rank, rope, nope, _ = shape
    case = latent_case([(20, 1), (5, 1), (33, 1)], shape, torch.float32, gen(34), absorbed=True)
    b = case.batch
    ctx = b.context_lens_t.clone()
    ctx[1] = 0
    slots = b.slot_mapping.clone()
    slots[1] = -1
    for splits in (1, 4):
        cache = b.kv_cache[0].clone()
        before = cache.clone()
        out = poisoned((3, heads, rank), torch.float32)
        paged_mla_decode(case.q[..., :rank], case.q[..., rank:], cache, b.block_tables, ctx, 0.2, splits, out=out,
                         latent_new=case.latent, slot_mapping=slots)
        assert torch.isfinite(out).all() and (out[1] == 0).all()
        changed = ~((cache == before) | (torch.isnan(cache) & torch.isnan(before)))
        rows = changed.view(-1, cache.shape[-1]).any(-1)
        assert torch.equal(rows.nonzero().flatten().sort().values, slots[[0, 2]].sort().values)


def mla_layer(shape, dtype):
    """A DeepSeek-V2-shaped MLA layer (its kv_b_proj read by both backends), random weights, and a
    REF_DTYPE copy for the reference."""
    from pdserve.models.args import ModelArgs
    from pdserve.models.mla import MLAttention

    heads, rank, rope, nope, v = shape
    args = ModelArgs.from_hf_config({
        "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": heads, "intermediate_size": 32, "max_position_embeddings": 8192,
        "q_lora_rank": None, "kv_lora_rank": rank, "qk_rope_head_dim": rope, "qk_nope_head_dim": nope,
        "v_head_dim": v, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16})
    layer = MLAttention(args, 0, TorchAttention(), None).to(DEVICE)
    with torch.no_grad():
        layer.kv_b_proj.weight.copy_(torch.randn(layer.kv_b_proj.weight.shape, generator=gen(35), device=DEVICE)
                                     * rank ** -0.5)
    return copy.deepcopy(layer).to(dtype), layer.to(REF_DTYPE)


def mla_reference(case, layer, scale: float) -> torch.Tensor:
    """TorchAttention.forward_mla (latents up-projected per step) in REF_DTYPE over the clean batch;
    writes the step's latents into ref_batch's cache (an FP8 cache stays FP8, read dequantized)."""
    ref = case.ref_batch
    cache = ref.kv_cache.clone() if ref.kv_scales else ref.kv_cache.to(REF_DTYPE)
    up = ForwardBatch(**{**ref.__dict__, "kv_cache": cache})
    out = TorchAttention().forward_mla(0, case.q.to(REF_DTYPE), case.latent.to(REF_DTYPE), up, scale, layer)
    write_latent(ref.kv_cache[0], case.latent, ref.slot_mapping, ref.layer_scales(0))  # the expected cache
    return out


@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_backend(dtype, fp8):
    """TritonAttention.forward_mla end to end against TorchAttention.forward_mla on one MLA layer:
    a mixed step (fresh prompts, chunks after a cached prefix, one-token rows: written first, then
    absorbed and expanded rows), a decode step (absorbed, fused write) and fresh prompts only."""
    shape = MLA_SHAPES[-1]
    heads, rank, rope, nope, v = shape
    layer, ref_layer = mla_layer(shape, dtype)
    seqs = pick([(300, 300), (1200, 1), (700, 64), (33, 1), (2000, 17)], [(20, 20), (30, 1), (40, 9), (18, 1)])
    scale = (nope + rope) ** -0.5
    g = gen(36)
    for rows in (seqs, [(c, 1) for c, _ in seqs], [(n, n) for _, n in seqs if n > 1]):
        case = latent_case(rows, shape, dtype, g, absorbed=False, fp8=fp8)
        case.batch.context_lens_t = case.batch.query_start_t = None  # the backend fills them
        ref = mla_reference(case, ref_layer, scale)
        _poison_new_slots(case)
        out = TritonAttention().forward_mla(0, case.q, case.latent, case.batch, scale, layer)
        assert out.shape == (case.q.shape[0], heads, v)
        assert_cache_written(case)
        check(out, ref, dtype, f"mla backend {rows}" + (" over an FP8 cache" if fp8 else ""))


@pytest.mark.parametrize("family,kv_cache_dtype", [("deepseek_v2", "auto"), ("deepseek_v3", "fp8_e4m3")])
def test_mla_engine_matches_torch_backend(family, kv_cache_dtype, tmp_path):
    """A tiny DeepSeek engine on the GPU path's kernels — TritonAttention (with the fused q / kv_a
    GEMM and the one-launch RoPE, TritonNorms.mla_rope) and TritonMoE (DeepSeek's routing in one
    launch: V2 group_limited_greedy, V3 noaux_tc; the shared experts folded into the routed
    experts' kernels) — gives the torch reference engine's greedy tokens:
    fresh prompts, chunks after a cached prefix, mixed steps and decode steps, over the model's
    dtype (V2) or FP8 (V3). On the GPU this is tests/test_gpu_engine.py's job (CUDA graphs too);
    here the kernels run interpreted. Prompts clear of near-ties: absorbed attention sums in
    another order than the expanded reference."""
    from hf_checkpoints import checkpoint_path, clear_prompts
    from pdserve.config import EngineConfig, ModelConfig
    from pdserve.engine.engine import Engine
    from pdserve.protocol import SamplingParams

    path = checkpoint_path(family, tmp_path, sharp=True)

    def engine() -> Engine:
        return Engine(EngineConfig(model=ModelConfig(path=str(path), dtype="float32", kv_cache_dtype=kv_cache_dtype),
                                   device=DEVICE, attention_backend="torch", moe_backend="torch", num_kv_blocks=32,
                                   max_num_batched_tokens=48, chunk_size=24))

    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 128, (int(n),), generator=g).tolist() for n in torch.randint(20, 60, (10,), generator=g)]
    ps, want = clear_prompts(engine(), prompts, n=3, tokens=6, min_margin=0.1)
    ours = engine()
    triton_attention, triton_norms, triton_moe = TritonAttention(), TritonNorms(), TritonMoE()
    for layer in ours.model.layers:
        layer.self_attn.backend, layer.self_attn.norms = triton_attention, triton_norms
        layer.self_attn.fuse_qkv()
    for moe in ours.model.moe_layers():
        moe.backend = triton_moe
    ours.model.fold_shared_experts()
    assert all(moe.num_shared_slots for moe in ours.model.moe_layers())
    idle = ours.pool.num_free_blocks
    got = [c.token_ids for c in ours.generate(ps, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))]
    assert got == want
    assert ours.pool.num_free_blocks == idle


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
def test_prefill_graph_batches_match_torch_backend(family, tmp_path):
    """The batches PrefillGraphs captures and replays, run eagerly on the GPU backends (attention,
    MoE, norms): one prompt padded to its bucket as one causal sequence, several (K/V caches) with
    placeholder host lists and their bounds on the device; the torch engine's greedy tokens. Run
    interpreted, this checks on a CPU what the graphs compute (tests/test_gpu_engine.py replays them)."""
    from hf_checkpoints import checkpoint_path, clear_prompts
    from pdserve.config import EngineConfig, ModelConfig
    from pdserve.engine.engine import Engine
    from pdserve.engine.prefill_graphs import SINGLE, VARLEN, PaddedPrefill
    from pdserve.models.layers import SparseMoE
    from pdserve.protocol import SamplingParams

    class GraphBatches(PaddedPrefill):
        """PrefillGraphs.run with the model run eagerly on the captured batch instead of a replay."""

        def run(self, batch, choice):
            self._fill(batch, choice[0], varlen=choice[1] == VARLEN)
            self.replays[choice] += 1
            return self.model(self.batch(*choice))

    path = checkpoint_path(family, tmp_path, sharp=True)

    def engine() -> Engine:
        return Engine(EngineConfig(model=ModelConfig(path=str(path), dtype="float32"), device=DEVICE,
                                   attention_backend="torch", moe_backend="torch", num_kv_blocks=32,
                                   max_num_batched_tokens=64, chunk_size=64))

    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, 128, (int(n),), generator=g).tolist() for n in torch.randint(3, 20, (12,), generator=g)]
    ps, want = clear_prompts(engine(), prompts, n=4, tokens=3, min_margin=0.1)
    ours = engine()
    attention, norms, experts = TritonAttention(), TritonNorms(), TritonMoE()
    for module in ours.model.modules():  # every norm, RoPE included
        if hasattr(module, "norms"):
            module.norms = norms
    for layer in ours.model.layers:
        layer.self_attn.backend = attention
        layer.self_attn.fuse_qkv()
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp.backend = experts
    ours.model.fold_shared_experts()  # DeepSeek's shared experts as the GPU path holds them
    mla = ours.args.is_mla
    pad = ours.runner.prefill_graphs = GraphBatches(ours.model, ours.kv_cache, ours.layout.scales, [16, 64],
                                                    1 if mla else 4, ours.device)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    got = [c.token_ids for c in ours.generate(ps[:1], params) + ours.generate(ps[1:], params)]
    assert got == want
    assert pad.replays[(16, SINGLE)] + pad.replays[(64, SINGLE)] == 1  # three prompts, < 60 tokens: 64
    assert sum(pad.replays.values()) == (1 if mla else 2)  # several prompts: MLA's run eagerly


# -- MoE ----------------------------------------------------------------------------------------------

MOE_SHAPES = pick(  # (experts, top_k, hidden, intermediate)
    [(8, 2, 1024, 512), (128, 8, 2048, 768), (128, 2, 512, 256)], [(8, 2, 64, 32), (16, 4, 48, 40)])
MOE_TOKENS = pick([1, 5, 64, 257, 600, 1100], [1, 3, 17])  # 1100: 128-row tiles on 8 experts


def reference_moe(x, w13, w2, weights, ids) -> torch.Tensor:
    return TorchMoE().forward(x.to(REF_DTYPE), w13.to(REF_DTYPE), w2.to(REF_DTYPE), weights.to(REF_DTYPE), ids)


@pytest.mark.parametrize("shape", MOE_SHAPES)
@pytest.mark.parametrize("tokens", MOE_TOKENS)
@pytest.mark.parametrize("renormalize", [True, False])
def test_routing(shape, tokens, renormalize):
    experts, top_k, _, _ = shape
    logits = torch.randn(tokens, experts, generator=gen(6), device=DEVICE)
    ref_w, ref_ids = route(logits, top_k, renormalize)
    w = poisoned((tokens, top_k), torch.float32)
    ids = torch.full((tokens, top_k), -1, dtype=torch.int64, device=DEVICE)
    fused_topk(logits, top_k, renormalize, out=(w, ids))
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("shape", MOE_SHAPES)
@pytest.mark.parametrize("tokens", pick([1, 2, 5, 8], [1, 3]))
@pytest.mark.parametrize("dtype", DTYPES)
def test_router_gemv(shape, tokens, dtype):
    """The router's logits as a GEMV (decode batches) equal F.linear's; the MoE backend takes it for a
    handful of tokens and cuBLAS beyond, the same logits either way."""
    experts, _, hidden, _ = shape
    g = gen(7)
    x = torch.randn(tokens, hidden, generator=g, device=DEVICE).to(dtype)
    w = (torch.randn(experts, hidden, generator=g, device=DEVICE) * hidden ** -0.5).to(dtype)
    ref = torch.nn.functional.linear(x.to(REF_DTYPE), w.to(REF_DTYPE))
    out = router_gemv(x, w)
    assert out.dtype == dtype and out.shape == (tokens, experts)
    check(out, ref, dtype, f"router gemv T={tokens} {shape}")
    backend = TritonMoE()
    many = torch.randn(20, hidden, generator=g, device=DEVICE).to(dtype)  # past ROUTER_GEMV_MAX_TOKENS
    check(backend.router_logits(x, w), ref, dtype, "TritonMoE.router_logits, a few tokens")
    check(backend.router_logits(many, w), torch.nn.functional.linear(many.to(REF_DTYPE), w.to(REF_DTYPE)),
          dtype, "TritonMoE.router_logits, many tokens")
    # Float32 logits (DeepSeek's router): the sums kept unrounded, as torch.mm(..., out_dtype=float32) has them.
    f32 = backend.router_logits(x, w, out_dtype=torch.float32)
    assert f32.dtype == torch.float32
    check(f32, ref, torch.float32, f"router gemv float32 out T={tokens} {shape}")
    if x.is_cuda and dtype != torch.float32:  # beyond the GEMV's tokens: cuBLAS, float32 out
        check(backend.router_logits(many, w, out_dtype=torch.float32),
              torch.nn.functional.linear(many.to(REF_DTYPE), w.to(REF_DTYPE)), torch.float32, "many tokens, float32 out")


# (out_features, in_features): Qwen3-30B-A3B's q/k/v and o; DeepSeek-V2-Lite's q+kv_a; ragged ones
LINEAR_SHAPES = pick([(5120, 2048), (2048, 4096), (3648, 2048), (200, 333)], [(40, 64), (33, 100)])
LINEAR_CONFIGS = [None,  # the default table
                  dict(BLOCK_N=32, BLOCK_K=pick(128, 32), num_warps=4),
                  dict(BLOCK_N=16, BLOCK_K=pick(1024, 64), num_warps=8)]
LINEAR_SHAPES = LINEAR_SHAPES + pick([(2048, 2048)], [])  # (DeepSeek-V2-Lite's o)


@pytest.mark.parametrize("shape", LINEAR_SHAPES)
@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("config", range(len(LINEAR_CONFIGS)))
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_linear(shape, tokens, bias, config, dtype):
    """The GEMV equals F.linear at one and two rows, with and without bias, at ragged shapes (a last
    tile past N, a last chunk past K), in every output it owns."""
    n, k = shape
    g = gen(5 + tokens)
    x = torch.randn(tokens, k, generator=g, device=DEVICE).to(dtype)
    w = (torch.randn(n, k, generator=g, device=DEVICE) * k ** -0.5).to(dtype)
    b = torch.randn(n, generator=g, device=DEVICE).to(dtype) if bias else None
    ref = torch.nn.functional.linear(x.to(REF_DTYPE), w.to(REF_DTYPE), b.to(REF_DTYPE) if bias else None)
    out = poisoned((tokens, n), dtype)
    gemv_linear(x, w, b, config=LINEAR_CONFIGS[config], out=out)
    check(out, ref, dtype, f"gemv_linear T={tokens} {shape} cfg{config}")


@pytest.mark.parametrize("tokens", [1, 2])
def test_weights_loaded_before_the_wait_change_nothing(tokens, monkeypatch):
    """The dense GEMV and the router's GEMV loading their first chunk of weights before their PDL
    wait (PDSERVE_PREFETCH's "linear", "router") give the same bits, at even and ragged shapes."""
    from pdserve.ops import pdl

    g = gen(29)
    for n, k in pick([(5120, 2048), (200, 333)], [(40, 64), (33, 100)]):
        x = torch.randn(tokens, k, generator=g, device=DEVICE)
        w = torch.randn(n, k, generator=g, device=DEVICE) * k ** -0.5
        outs = []
        for kinds in (set(), {"linear", "router"}):
            monkeypatch.setattr(pdl, "PREFETCH", kinds)
            outs.append((gemv_linear(x, w), router_gemv(x, w)))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_linear_takes_the_gemv_up_to_its_row_limit_only():
    g = gen(3)
    w = torch.randn(48, 64, generator=g, device=DEVICE)
    for rows in (1, GEMV_LINEAR_MAX_TOKENS, GEMV_LINEAR_MAX_TOKENS + 1):
        x = torch.randn(rows, 64, generator=g, device=DEVICE)
        check(linear(x, w), torch.nn.functional.linear(x.double(), w.double()), torch.float32, f"linear rows={rows}")
        # The GEMV sums chunk by chunk, cuBLAS in its own order: bit-equal only off the GEMV.
        if rows > GEMV_LINEAR_MAX_TOKENS or not x.is_cuda:
            assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))


def test_routing_half_precision_ties():
    """16-bit logits tie often; the chosen experts' probabilities must still be the top k."""
    logits = torch.randn(pick(600, 40), 128, generator=gen(7), device=DEVICE).to(torch.float16)
    ref_w, _ = route(logits, 8, False)
    w, ids = fused_topk(logits, 8, False)
    probs = torch.softmax(logits, -1, dtype=torch.float32)
    assert torch.equal(probs.gather(1, ids), ref_w)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-7)


# DeepSeek's routings: (scoring, method, experts, top_k, n_group, topk_group, renormalize, scaling).
# V2-Lite's shape, V2's group-limited one, V3's noaux_tc (256 experts in 8 groups), V3 renormalised.
GROUPED_ROUTINGS = pick(
    [("softmax", "greedy", 64, 6, 1, 1, False, 1.0), ("softmax", "group_limited_greedy", 160, 6, 8, 3, False, 16.0),
     ("sigmoid", "noaux_tc", 256, 8, 8, 4, True, 2.5), ("sigmoid", "noaux_tc", 64, 6, 4, 2, False, 1.0)],
    [("softmax", "greedy", 16, 3, 1, 1, False, 1.0), ("softmax", "group_limited_greedy", 24, 4, 4, 2, True, 1.5),
     ("sigmoid", "noaux_tc", 32, 4, 8, 3, True, 2.5), ("sigmoid", "noaux_tc", 16, 3, 4, 2, False, 1.0)])


def _by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's (weight, id) pairs ordered by id: the reference leaves its order unspecified."""
    order = ids.argsort(dim=1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("routing", GROUPED_ROUTINGS, ids=lambda r: f"{r[1]}-{r[2]}")
@pytest.mark.parametrize("tokens", MOE_TOKENS)
@pytest.mark.parametrize("num_shared", [0, 2])
def test_grouped_routing(routing, tokens, num_shared):
    """grouped_topk = grouped_route on random float32 logits (no ties): the same experts, the same
    weights; the shared experts' slots (ids E, E+1, weight 1) after the k routed ones."""
    scoring, method, experts, top_k, n_group, topk_group, renormalize, scaling = routing
    g = gen(23 + tokens)
    logits = torch.randn(tokens, experts, generator=g, device=DEVICE)
    bias = 0.1 * torch.randn(experts, generator=g, device=DEVICE) if method == "noaux_tc" else None
    kw = dict(scoring=scoring, method=method, n_group=n_group, topk_group=topk_group, correction_bias=bias,
              renormalize=renormalize, scaling=scaling)
    ref_w, ref_ids = grouped_route(logits, top_k, **kw)
    w = poisoned((tokens, top_k + num_shared), torch.float32)
    ids = torch.full((tokens, top_k + num_shared), -1, dtype=torch.int64, device=DEVICE)
    grouped_topk(logits, top_k, num_shared=num_shared, out=(w, ids), **kw)
    got_w, got_ids = _by_id(w[:, :top_k], ids[:, :top_k])
    ref_w, ref_ids = _by_id(ref_w, ref_ids)
    assert torch.equal(got_ids, ref_ids)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-6, atol=1e-7)
    assert torch.equal(ids[:, top_k:], torch.arange(experts, experts + num_shared, device=DEVICE).expand(tokens, -1))
    assert (w[:, top_k:] == 1).all()
    # The backends agree, shared slots included.
    ref_w, ref_ids = _by_id(*TorchMoE().grouped_route(logits, top_k, num_shared=num_shared, **kw))
    got_w, got_ids = _by_id(*TritonMoE().grouped_route(logits, top_k, num_shared=num_shared, **kw))
    assert torch.equal(got_ids, ref_ids)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_routing_ties(renormalize, dtype):
    """Logits that tie (on a coarse grid, exact in every dtype), greedy (V2-Lite's), given to the
    kernel in `dtype` (read as float32): the chosen experts' logits are the reference's, whichever
    id wins a tie, and so are the weights. (Groups that tie may keep other experts in the running:
    the grouped methods are checked without ties above.)"""
    scoring, method, experts, top_k, n_group, topk_group, _, scaling = GROUPED_ROUTINGS[0]
    logits = (4 * torch.randn(pick(600, 40), experts, generator=gen(24), device=DEVICE)).round() / 4
    kw = dict(scoring=scoring, method=method, n_group=n_group, topk_group=topk_group, correction_bias=None,
              renormalize=renormalize, scaling=scaling)
    ref_w, ref_ids = grouped_route(logits, top_k, **kw)
    w, ids = grouped_topk(logits.to(dtype), top_k, **kw)
    assert torch.equal(logits.gather(1, ids).sort(1).values, logits.gather(1, ref_ids).sort(1).values)
    torch.testing.assert_close(w.sort(1).values, ref_w.sort(1).values, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
def test_moe_align(block_m):
    experts, tokens, top_k = pick(128, 16), pick(300, 21), pick(8, 4)
    ids = torch.stack([torch.randperm(experts, device="cpu")[:top_k] for _ in range(tokens)]).to(DEVICE)
    sorted_ids, expert_ids, num_padded = moe_align(ids, experts, block_m)
    n = int(num_padded)
    pairs = tokens * top_k
    counts = torch.bincount(ids.flatten().cpu(), minlength=experts)
    assert n == int(((counts + block_m - 1) // block_m * block_m).sum())
    real = sorted_ids[:n].cpu()
    assert torch.equal(real[real < pairs].sort().values, torch.arange(pairs, dtype=torch.int32))
    assert (real[real >= pairs] == pairs).all()
    flat = ids.flatten().cpu()
    for tile in range(n // block_m):
        members = real[tile * block_m:(tile + 1) * block_m]
        members = members[members < pairs].long()
        assert (flat[members] == int(expert_ids[tile])).all()


@pytest.mark.parametrize("shape", MOE_SHAPES)
@pytest.mark.parametrize("tokens", MOE_TOKENS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_moe(shape, tokens, dtype):
    experts, top_k, hidden, inter = shape
    x, w13, w2, logits = random_moe_inputs(tokens, experts, hidden, inter, dtype, DEVICE, gen(8))
    weights, ids = route(logits, top_k, True)
    ref = reference_moe(x, w13, w2, weights, ids)
    out = poisoned(x.shape, dtype)
    fused_moe(x, w13, w2, weights, ids, out=out)
    check(out, ref, dtype, f"fused_moe T={tokens} {shape}")


GEMV_CONFIGS = [None,  # the default table
                dict(BLOCK_N13=8, BLOCK_K13=pick(512, 16), BLOCK_N2=32, BLOCK_K2=pick(128, 16), EPP=1, num_warps=4),
                dict(BLOCK_N13=32, BLOCK_K13=pick(128, 32), BLOCK_N2=8, BLOCK_K2=pick(256, 32), EPP=2, num_warps=2)]


@pytest.mark.parametrize("shape", MOE_SHAPES)
@pytest.mark.parametrize("tokens", pick([1, 2, 5, 8, 16], [1, 3, 8]))
@pytest.mark.parametrize("config", range(len(GEMV_CONFIGS)))
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_moe(shape, tokens, config, dtype):
    experts, top_k, hidden, inter = shape
    x, w13, w2, logits = random_moe_inputs(tokens, experts, hidden, inter, dtype, DEVICE, gen(17 + tokens))
    weights, ids = route(logits, top_k, True)
    ids[0, :] = ids[-1, :]  # two tokens on the same experts (with T > 1)
    ref = reference_moe(x, w13, w2, weights, ids)
    out = poisoned(x.shape, dtype)
    gemv_moe(x, w13, w2, weights, ids, config=GEMV_CONFIGS[config], out=out)
    check(out, ref, dtype, f"gemv_moe T={tokens} {shape} cfg{config}")


@pytest.mark.parametrize("config", [1, 2])
@pytest.mark.parametrize("tokens", pick([1, 3, 8], [1, 3]))
def test_gemv_moe_partials_summed_by_the_last_program(config, tokens, monkeypatch):
    """The down GEMV's partial rows (EPP < k) summed by the last of a token's programs on a tile give
    moe_sum's output bit for bit, launch after launch (the counters are left zeroed)."""
    experts, top_k, hidden, inter = MOE_SHAPES[0]
    x, w13, w2, logits = random_moe_inputs(tokens, experts, hidden, inter, torch.float32, DEVICE, gen(19))
    weights, ids = route(logits, top_k, True)
    outs = []
    for fused in (False, True, True):
        monkeypatch.setattr(arrival, "ENABLED", fused)
        out = poisoned(x.shape, torch.float32)
        gemv_moe(x, w13, w2, weights, ids, config=GEMV_CONFIGS[config], out=out)
        outs.append(out)
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])
    assert int(arrival.buffer(torch.device(DEVICE)).count_nonzero()) == 0


@pytest.mark.parametrize("shape", MOE_SHAPES)
@pytest.mark.parametrize("tokens", pick([1, 64, 600, 4096], [1, 3, 17]))
def test_grouped_mm_moe(shape, tokens):
    # CUDA's torch._grouped_mm takes bfloat16; the CPU one (interpreter mode) also float16, which
    # the interpreter, unlike bfloat16, rounds correctly.
    dtype = torch.float16 if INTERPRET else torch.bfloat16
    experts, top_k, hidden, inter = shape
    x, w13, w2, logits = random_moe_inputs(tokens, experts, hidden, inter, dtype, DEVICE, gen(9))
    weights, ids = route(logits, top_k, True)
    ref = reference_moe(x, w13, w2, weights, ids)
    out = poisoned(x.shape, dtype)
    grouped_mm_moe(x, w13, w2, weights, ids, out=out)
    check(out, ref, dtype, f"grouped_mm_moe T={tokens} {shape}")


@pytest.mark.parametrize("impl", ["fused", "gemv", "grouped_mm", "torch"])
def test_moe_skips_pairs_served_elsewhere(impl):
    """Expert parallel: a pair carrying the skip id E (another rank serves it) adds nothing, in
    every backend, whatever its never-computed rows hold. Half the pairs are skipped, and every
    pair of the last token (a padding row). Oracle: the same pairs kept at weight 0."""
    experts, top_k, hidden, inter = MOE_SHAPES[0]
    dtype = (torch.float16 if INTERPRET else torch.bfloat16) if impl == "grouped_mm" else torch.float32
    tokens = pick(5, 3) if impl == "gemv" else pick(64, 9)
    x, w13, w2, logits = random_moe_inputs(tokens, experts, hidden, inter, dtype, DEVICE, gen(21))
    weights, ids = route(logits, top_k, True)
    skip = torch.rand(ids.shape, generator=gen(22), device=DEVICE) < 0.5
    skip[-1] = True
    ref = reference_moe(x, w13, w2, torch.where(skip, 0.0, weights), ids)
    skipped = torch.where(skip, experts, ids)
    if impl == "torch":
        out = TorchMoE().forward(x, w13, w2, weights, skipped)
    else:
        out = poisoned(x.shape, dtype)
        {"fused": fused_moe, "gemv": gemv_moe, "grouped_mm": grouped_mm_moe}[impl](x, w13, w2, weights, skipped,
                                                                                  out=out)
    check(out, ref, dtype, f"{impl} with skipped pairs")


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_backend(dtype):
    experts, top_k, hidden, inter = MOE_SHAPES[0]
    backend = TritonMoE(grouped_mm_min_tokens=pick(64, 10**9), gemv_max_tokens=4)
    for tokens in pick([3, 9, 100], [3, 9]):  # every side of the switches
        x, w13, w2, logits = random_moe_inputs(tokens, experts, hidden, inter, dtype, DEVICE, gen(10))
        weights, ids = backend.route(logits, top_k, True)
        assert backend.path(tokens, dtype) == ("gemv" if tokens <= 4 else "fused" if tokens < pick(64, 10**9)
                                               else "grouped_mm" if dtype == torch.bfloat16 else "fused")
        check(backend.forward(x, w13, w2, weights, ids), reference_moe(x, w13, w2, weights, ids), dtype,
              f"TritonMoE T={tokens}")


def deepseek_moe_args(routing: str):
    """A DeepSeek MoE layer's args: V2-Lite's shape and routing (greedy softmax, 2 shared experts)
    or V3's routing (noaux_tc over groups, sigmoid, renormalised, scaled; 1 shared expert); tiny
    under the interpreter."""
    import dataclasses

    from pdserve.models import resolve_model_args

    args = resolve_model_args("deepseek-v2-lite")
    if INTERPRET:
        args = dataclasses.replace(args, num_experts=16, num_experts_per_tok=4, hidden_size=64,
                                   moe_intermediate_size=24, shared_expert_intermediate_size=48)
    if routing == "v3":
        e, i = args.num_experts, args.moe_intermediate_size
        args = dataclasses.replace(args, scoring_func="sigmoid", topk_method="noaux_tc", n_group=pick(8, 4),
                                   topk_group=pick(4, 2), norm_topk_prob=True, routed_scaling_factor=2.5,
                                   num_experts_per_tok=pick(8, 3), shared_expert_intermediate_size=i,
                                   num_experts=e)
    return args


@pytest.mark.parametrize("routing", ["v2-lite", "v3"])
@pytest.mark.parametrize("tokens", pick([1, 5, 64, 600, 4096], [1, 3, 17]))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("apart", [False, True], ids=["in-kernel", "apart"])
def test_deepseek_moe_folded_shared_experts(routing, tokens, dtype, apart, monkeypatch):
    """A DeepSeek MoE layer on the GPU path — routing in one launch (TritonMoE.grouped_route), the
    shared experts folded into the routed experts' call (fold_shared_experts), whichever kernel
    the batch takes (GEMV, fused, grouped_mm), or from SHARED_APART_TOKENS on run apart as dense
    GEMMs on their folded weights — against the reference layer (TorchMoE, grouped_route, the
    shared MLP apart) upcast."""
    from pdserve.models import deepseek
    from pdserve.models.deepseek import DeepseekMoE

    monkeypatch.setattr(deepseek, "SHARED_APART_TOKENS", 1 if apart else 1 << 30)

    args = deepseek_moe_args(routing)
    g = gen(31)
    with torch.device(DEVICE):
        ref = DeepseekMoE(args, TorchMoE()).to(REF_DTYPE)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            # Values the layer's dtype holds exactly: both layers route on the same float32 logits.
            p.copy_((torch.randn(p.shape, generator=g, device=DEVICE) / fan_in ** 0.5).to(dtype))
        if ref.e_score_correction_bias is not None:  # float32, as loading keeps it
            ref.e_score_correction_bias = torch.nn.Parameter(0.1 * ref.e_score_correction_bias.float())
    ours = copy.deepcopy(ref).to(dtype)
    ours.e_score_correction_bias = ref.e_score_correction_bias
    ours.backend = TritonMoE()
    ours.fold_shared_experts()
    assert ours.shared_expert is None and ours.num_shared_slots == args.shared_expert_intermediate_size // (
        args.moe_intermediate_size)
    x = torch.randn(tokens, args.hidden_size, generator=g, device=DEVICE).to(dtype)
    with torch.inference_mode():
        check(ours(x), ref(x.to(REF_DTYPE)), dtype, f"DeepseekMoE {routing} folded T={tokens}")


# -- norm, RoPE, activation -------------------------------------------------------------------------

NORM_TOKENS = pick([1, 7, 600], [1, 5])


@pytest.mark.parametrize("tokens", NORM_TOKENS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(tokens, dtype):
    g = gen(11)
    dim = pick(2048, 48)
    norm = RMSNorm(dim, 1e-6).to(DEVICE)
    norm.weight.data = 1 + 0.1 * torch.randn(dim, generator=g, device=DEVICE)
    x = torch.randn(tokens, dim, generator=g, device=DEVICE).to(dtype)
    res = torch.randn(tokens, dim, generator=g, device=DEVICE).to(dtype)
    w = norm.weight.data.to(dtype)
    out = poisoned(x.shape, dtype)
    rms_norm(x, w, 1e-6, out=out)
    check(out, norm.to(REF_DTYPE)(x.to(REF_DTYPE)), dtype, "rms_norm")
    out = poisoned(x.shape, dtype)
    _, summed = fused_add_rms_norm(x, res, w, 1e-6, out=out)
    check(out, norm.to(REF_DTYPE)((x + res).to(REF_DTYPE)), dtype, "fused_add_rms_norm")
    assert torch.equal(summed, x + res)


@pytest.mark.parametrize("tokens", pick([1, 7, 300], [1, 6, 20]))  # q heads split over programs up to 16 tokens
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope(heads, qk_norm, dtype, tokens):
    num_heads, kv_heads, head_dim = heads
    g = gen(12)
    rotary = RotaryEmbedding(head_dim, 8192, 1e6, None).to(DEVICE)
    rotary.build_cache()
    positions = torch.randint(0, 8192, (tokens,), generator=g, device=DEVICE)
    q = torch.randn(tokens, num_heads, head_dim, generator=g, device=DEVICE).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim, generator=g, device=DEVICE).to(dtype)
    q_norm, k_norm = RMSNorm(head_dim, 1e-6).to(DEVICE), RMSNorm(head_dim, 1e-6).to(DEVICE)
    for n in (q_norm, k_norm):
        n.weight.data = 1 + 0.1 * torch.randn(head_dim, generator=g, device=DEVICE)
    cos, sin = rotary(positions, REF_DTYPE)
    rq, rk = q.to(REF_DTYPE), k.to(REF_DTYPE)
    if qk_norm:
        rq, rk = q_norm.to(REF_DTYPE)(rq), k_norm.to(REF_DTYPE)(rk)
    rq, rk = apply_rotary(rq, cos, sin), apply_rotary(rk, cos, sin)
    out = poisoned(q.shape, dtype), poisoned(k.shape, dtype)
    weights = (q_norm.weight.data.to(dtype), k_norm.weight.data.to(dtype)) if qk_norm else (None, None)
    qk_norm_rope(q, k, positions, rotary.cos, rotary.sin, *weights, eps=1e-6, out=out)
    check(out[0], rq, dtype, "q")
    check(out[1], rk, dtype, "k")


@pytest.mark.parametrize("interleave", [True, False], ids=["pairs", "halves"])
@pytest.mark.parametrize("rope_dtype", ["float32", "model"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_rope(interleave, rope_dtype, dtype):
    """MLA's RoPE and cache entry in one launch against TorchNorms.mla_rope: DeepSeek's pairs (V2,
    V3) and halves, cos/sin in float32 (V2) or the model's dtype (V3); q and k_rope strided views
    of one projection's output, as the model hands them over."""
    from pdserve.ops.mla_rope import mla_rope
    from pdserve.ops.norms import TorchNorms

    heads, rank, rope, nope, _ = MLA_SHAPES[0]
    g = gen(37)
    tokens = pick(300, 6)
    rotary = RotaryEmbedding(rope, 8192, 1e4, None).to(DEVICE)
    rotary.build_cache()
    positions = torch.randint(0, 8192, (tokens,), generator=g, device=DEVICE)
    proj = torch.randn(tokens, heads * (nope + rope) + rank + rope, generator=g, device=DEVICE).to(dtype)
    q = proj[:, :heads * (nope + rope)].view(tokens, heads, nope + rope)
    c_kv, k_rope = proj[:, heads * (nope + rope):].split([rank, rope], -1)
    cos, sin = rotary(positions, torch.float32 if rope_dtype == "float32" else dtype)
    ref_rope = (cos.to(REF_DTYPE), sin.to(REF_DTYPE))
    ref_q, ref_latent = TorchNorms().mla_rope(q.to(REF_DTYPE), c_kv.to(REF_DTYPE), k_rope.to(REF_DTYPE), ref_rope,
                                              interleave)
    out_q, out_latent = mla_rope(q, c_kv, k_rope, cos, sin, interleave)
    check(out_q, ref_q, dtype, "mla_rope q")
    check(out_latent, ref_latent, dtype, "mla_rope latent")
    assert torch.equal(out_latent[:, :rank], c_kv) and torch.equal(out_q[..., :nope], q[..., :nope])


@pytest.mark.parametrize("tokens", NORM_TOKENS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(tokens, dtype):
    inter = pick(768, 40)
    x = torch.randn(tokens, 2 * inter, generator=gen(13), device=DEVICE).to(dtype)
    gate, up = x.to(REF_DTYPE).chunk(2, dim=-1)
    out = poisoned((tokens, inter), dtype)
    silu_and_mul(x, out=out)
    check(out, F.silu(gate) * up, dtype, "silu_and_mul")


# -- a whole model ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_dtype", [torch.float32, FP8], ids=["float32-cache", "fp8-cache"])
def test_model_forward_matches_torch_backends(kv_dtype):
    """tiny-moe with the Triton backends (attention, MoE, norms and RoPE) against the torch ones: a
    prefill step, then a decode step; over a float32 cache, or an FP8 one (scales 1, the engine's)."""
    from pdserve.models.loader import load_model
    from pdserve.ops.attention import TorchAttention as TA
    from pdserve.ops.moe import TorchMoE as TM
    from pdserve.ops.norms import TorchNorms
    dtype = torch.float32
    ours, args = load_model("tiny-moe", dtype, DEVICE, attn_backend=TritonAttention(), moe_backend=TritonMoE(),
                            norms=TritonNorms())
    ref, _ = load_model("tiny-moe", dtype, DEVICE, attn_backend=TA(), moe_backend=TM(), norms=TorchNorms())
    g = gen(14)
    prompts = [(37, 37), (20, 20)]
    case = random_paged_case(prompts, args.num_heads, args.num_kv_heads, args.head_dim, BLOCK, dtype, DEVICE, g)
    layers = args.num_layers
    cache_shape = (layers,) + tuple(case.batch.kv_cache.shape[1:])
    caches = [torch.zeros(cache_shape, dtype=kv_dtype, device=DEVICE) for _ in range(2)]
    scales = ((1.0, 1.0),) * layers if kv_dtype == FP8 else ()
    tokens = torch.randint(0, 256, (sum(n for _, n in prompts),), generator=g, device=DEVICE)

    def step(batch: ForwardBatch, cache: torch.Tensor, ids: torch.Tensor, model) -> torch.Tensor:
        b = ForwardBatch(**{**batch.__dict__, "kv_cache": cache, "input_ids": ids, "kv_scales": scales,
                            "logits_indices": torch.arange(ids.numel(), device=DEVICE)})
        with torch.inference_mode():
            return model.compute_logits(model(b))

    la, lb = step(case.ref_batch, caches[0], tokens, ours), step(case.ref_batch, caches[1], tokens, ref)
    assert rel_err(la, lb) < 1e-4
    # Decode: one more token per sequence, in the blocks the prefill used.
    dec = random_paged_case([(38, 1), (21, 1)], args.num_heads, args.num_kv_heads, args.head_dim, BLOCK,
                            dtype, DEVICE, g)
    b = dec.ref_batch
    bt = case.ref_batch.block_tables
    slots = torch.tensor([int(bt[i, p // BLOCK]) * BLOCK + p % BLOCK for i, p in enumerate((37, 20))], device=DEVICE)
    b = ForwardBatch(**{**b.__dict__, "block_tables": bt, "slot_mapping": slots,
                        "positions": torch.tensor([37, 20], device=DEVICE)})
    nxt = torch.randint(0, 256, (2,), generator=g, device=DEVICE)
    assert rel_err(step(b, caches[0], nxt, ours), step(b, caches[1], nxt, ref)) < 1e-4


@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch: compute capability 9 or more")
@pytest.mark.parametrize("tokens", [1, 8])
def test_pdl_chain_in_a_graph_equals_plain_launches(monkeypatch, tokens):
    """A decode layer's MoE half as a chain of kernels that launch with PDL (pdserve/ops/pdl.py), each
    reading the one before's output, replayed from a CUDA graph many times: bit for bit what the
    same kernels give launched plainly. A kernel reading before its wait would race here."""
    from pdserve.ops import pdl

    dtype, hidden, experts, inter, top_k, layers = torch.bfloat16, 2048, 128, 768, 8, 6
    g = gen(21)
    w_norm = [torch.rand(hidden, generator=g, device=DEVICE).to(dtype) + 0.5 for _ in range(layers)]
    w_gate = [(torch.randn(experts, hidden, generator=g, device=DEVICE) * hidden ** -0.5).to(dtype)
              for _ in range(layers)]
    w13 = [(torch.randn(experts, 2 * inter, hidden, generator=g, device=DEVICE) * hidden ** -0.5).to(dtype)
           for _ in range(layers)]
    w2 = [(torch.randn(experts, hidden, inter, generator=g, device=DEVICE) * inter ** -0.5).to(dtype)
          for _ in range(layers)]
    x0 = torch.randn(tokens, hidden, generator=g, device=DEVICE).to(dtype)

    def chain(x: torch.Tensor) -> torch.Tensor:
        residual = torch.zeros_like(x)
        for i in range(layers):
            h, residual = fused_add_rms_norm(x, residual, w_norm[i], 1e-6)
            weights, ids = fused_topk(router_gemv(h, w_gate[i]), top_k, True)
            x = gemv_moe(h, w13[i], w2[i], weights, ids)  # (its partials summed by the last program: arrival.py)
        return x + residual

    monkeypatch.setattr(pdl, "ENABLED", False)
    want = chain(x0)
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.enabled(x0.device)
    static_x = x0.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain(static_x)  # compiles the PDL builds outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(static_x)
    for _ in range(50):
        static_x.copy_(torch.randn(tokens, hidden, generator=g, device=DEVICE).to(dtype))
        graph.replay()
        monkeypatch.setattr(pdl, "ENABLED", False)
        ref = chain(static_x.clone())
        monkeypatch.setattr(pdl, "ENABLED", True)
        assert torch.equal(out, ref)
    static_x.copy_(x0)
    graph.replay()
    assert torch.equal(out, want)


@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch: compute capability 9 or more")
@pytest.mark.parametrize("splits", [1, 4])
def test_pdl_mla_chain_in_a_graph_equals_plain_launches(monkeypatch, splits):
    """An MLA decode layer's attention half as a chain of kernels that launch with PDL: the norm, the
    query's and the latent's RoPE with the cache entry (mla_rope), the absorbed decode writing the
    step's latent into the cache (with its splits' merge), SiLU-and-mul; replayed from a CUDA graph
    many times, bit for bit what plain launches give, its cache too. (A cuBLAS projection closes each
    layer: a plain launch, which waits for everything before it.)"""
    from pdserve.ops import pdl
    from pdserve.ops.mla_rope import mla_rope

    dtype, heads, rank, rope, layers, seqs, ctx, page = torch.bfloat16, 16, 512, 64, 4, 8, 300, BLOCK
    qk = rank + rope  # the query's nope part stands in for its absorbed latent (as wide)
    width = heads * qk + rank + rope
    g = gen(23)
    per_seq = -(-(ctx + 1) // page)
    tables = torch.arange(seqs * per_seq, dtype=torch.int32, device=DEVICE).view(seqs, per_seq)
    context = torch.full((seqs,), ctx + 1, dtype=torch.int32, device=DEVICE)  # the step's own token too
    slots = tables[:, ctx // page].long() * page + ctx % page
    angles = torch.rand(seqs, 1, rope // 2, generator=g, device=DEVICE) * 6.28
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    w_norm = [torch.rand(width, generator=g, device=DEVICE).to(dtype) + 0.5 for _ in range(layers)]
    proj = [(torch.randn(heads * rank // 2, width, generator=g, device=DEVICE) * (heads * rank) ** -0.5).to(dtype)
            for _ in range(layers)]
    caches = [torch.randn(1, seqs * per_seq, page, 1, qk, generator=g, device=DEVICE).to(dtype)
              for _ in range(layers)]

    def chain(x: torch.Tensor, kv: list[torch.Tensor]) -> torch.Tensor:
        residual = torch.zeros_like(x)
        for i in range(layers):
            h, residual = fused_add_rms_norm(x, residual, w_norm[i], 1e-6)
            q, latent = mla_rope(h[:, :heads * qk].view(seqs, heads, qk), h[:, heads * qk:heads * qk + rank],
                                 h[:, heads * qk + rank:], cos, sin, True)
            o = paged_mla_decode(q[..., :rank], q[..., rank:], kv[i], tables, context, qk ** -0.5, splits,
                                 latent_new=latent, slot_mapping=slots)
            x = silu_and_mul(o.view(seqs, heads * rank)) @ proj[i]
        return x + residual

    x0 = torch.randn(seqs, width, generator=g, device=DEVICE).to(dtype)
    static_x = x0.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain(static_x, [c.clone() for c in caches])  # compiles the PDL builds outside the capture
    torch.cuda.current_stream().wait_stream(side)
    assert pdl.enabled(x0.device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(static_x, caches)
    for _ in range(30):
        static_x.copy_(torch.randn(seqs, width, generator=g, device=DEVICE).to(dtype))
        ref_caches = [c.clone() for c in caches]
        graph.replay()
        monkeypatch.setattr(pdl, "ENABLED", False)
        ref = chain(static_x.clone(), ref_caches)
        monkeypatch.setattr(pdl, "ENABLED", True)
        assert torch.equal(out, ref)
        assert all(torch.equal(c, r) for c, r in zip(caches, ref_caches))
