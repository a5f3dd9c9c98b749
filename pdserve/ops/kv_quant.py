"""FP8 KV cache, torch reference: what the KV-write kernels store and what attention reads back.

A value is stored as clamp(value / scale, ±448) in float8 e4m3 (round to nearest even, saturating
as the GPU's conversion does) and read as stored * scale, in float32 and then the model's dtype.
One scale per layer and plane (pdserve.forward.kv_cache.KVLayout.scales).
"""

import torch

from pdserve.forward.kv_cache import FP8, FP8_MAX


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x (any float dtype) -> float8 e4m3 of x / scale, saturated at ±448."""
    return (x.to(torch.float32) / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """float8 e4m3 -> x * scale in `dtype` (computed in float32)."""
    out = x.to(torch.float32)
    if scale != 1.0:
        out.mul_(scale)
    return out.to(dtype)


def round_trip(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What a reader of the cache gets back for x: quantized, then dequantized to x's dtype."""
    return dequantize(quantize(x, scale), scale, x.dtype)


def dequantize_planes(entries: torch.Tensor, scales: tuple[float, ...], dtype: torch.dtype) -> torch.Tensor:
    """entries [planes, ...] float8 gathered from a cache -> [planes, ...] in `dtype`, plane i times scales[i]."""
    out = entries.to(torch.float32)
    for i, s in enumerate(scales):
        if s != 1.0:
            out[i].mul_(s)
    return out.to(dtype)
