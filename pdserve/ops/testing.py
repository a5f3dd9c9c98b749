"""Random inputs for checking the GPU kernels against the torch reference (tests and check_kernels.py)."""

import math
from dataclasses import dataclass

import torch

from pdserve.forward.forward_batch import ForwardBatch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere in `out` gives inf."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return math.inf
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@dataclass
class PagedCase:
    """One attention step: the batch the kernel gets (its cache's unused slots are NaN, so reading
    past a context shows) and the same batch over a clean cache for the reference."""

    batch: ForwardBatch
    ref_batch: ForwardBatch
    q: torch.Tensor  # [T, heads, D] (q_dim given: [T, heads, q_dim])
    k: torch.Tensor  # [T, kv_heads, D]; a latent cache's one plane: the step's latents [T, 1, D]
    v: torch.Tensor

    @property
    def latent(self) -> torch.Tensor:
        """The step's latents [T, D] (a case of one plane: random_paged_case(planes=1))."""
        return self.k[:, 0]


def random_paged_case(seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
                      block_size: int, dtype: torch.dtype, device: str | torch.device,
                      gen: torch.Generator, spare_blocks: int = 3, cache_dtype: torch.dtype | None = None,
                      kv_scales: tuple[float, ...] = (), planes: int = 2, q_dim: int | None = None) -> PagedCase:
    """seqs[i] = (context length after this step, tokens this step); one layer; blocks scattered at
    random. The cache is `cache_dtype` (default: `dtype`); an FP8 one comes with its plane scales
    ((k, v), or (latent,)). planes=1 with num_kv_heads 1: an MLA latent cache (head_dim = its
    width; q [T, heads, q_dim])."""
    need = [math.ceil(ctx / block_size) for ctx, _ in seqs]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(int(gen.initial_seed()))).tolist()
    tables, slots, positions, starts = [], [], [], [0]
    for (ctx, n), nb in zip(seqs, need):
        assert 1 <= n <= ctx
        table = [perm.pop() for _ in range(nb)]
        tables.append(table)
        positions += range(ctx - n, ctx)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx - n, ctx)]
        starts.append(starts[-1] + n)
    width = max(need)
    block_tables = torch.zeros(len(seqs), width, dtype=torch.long)
    used = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for i, ((ctx, _), table) in enumerate(zip(seqs, tables)):
        block_tables[i, : len(table)] = torch.tensor(table)
        for p in range(0, ctx, block_size):
            s = table[p // block_size] * block_size
            used[s: s + min(block_size, ctx - p)] = True

    shape = (1, planes, num_blocks, block_size, num_kv_heads, head_dim)
    clean = torch.randn(shape, generator=gen, device=device).to(cache_dtype or dtype)
    poisoned = clean.clone()
    view = poisoned.view(1, planes, num_blocks * block_size, num_kv_heads, head_dim)
    if clean.dtype == torch.float8_e4m3fn:  # no masked fill for float8: its NaN byte, 0x7f, through uint8
        view.view(torch.uint8)[:, :, ~used.to(device)] = 0x7F
    else:
        view[:, :, ~used.to(device)] = float("nan")
    t = starts[-1]
    q = torch.randn(t, num_heads, q_dim or head_dim, generator=gen, device=device).to(dtype)
    k = torch.randn(t, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
    v = torch.randn(t, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
    ctx_lens = [c for c, _ in seqs]

    def batch(cache: torch.Tensor) -> ForwardBatch:
        lens = torch.tensor(ctx_lens + starts, dtype=torch.int32, device=device)
        return ForwardBatch(
            input_ids=torch.zeros(t, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            block_tables=block_tables.to(device), query_start=starts, context_lens=ctx_lens,
            logits_indices=torch.tensor([t - 1], device=device), kv_cache=cache,
            context_lens_t=lens[: len(seqs)], query_start_t=lens[len(seqs):],
            kv_scales=(tuple(kv_scales),) if kv_scales else ())

    return PagedCase(batch(poisoned), batch(clean), q, k, v)


def random_moe_inputs(num_tokens: int, num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
                      device: str | torch.device, gen: torch.Generator
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I] (scaled so outputs stay O(1)), router logits [T, E] in dtype."""
    x = torch.randn(num_tokens, hidden, generator=gen, device=device).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=device) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen, device=device) / inter ** 0.5).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen, device=device).to(dtype)
    return x, w13, w2, logits
