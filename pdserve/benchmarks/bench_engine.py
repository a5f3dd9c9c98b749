"""Engine speed on one device against its own ceilings and HF transformers, all in one run.

    python -m pdserve.benchmarks.bench_engine [--model qwen3-30b-a3b] [--device cuda] [--json out.json]
    pdserve bench-engine ...                                  (the same command)
    pdserve bench-engine --model tiny-moe --device cpu ...    (dry run: checks the script, no figure)

Measured in the same run (each model is freed before the next one is built):
  ceilings  HBM copy rate: a large device-to-device copy, bytes read + written, median of repeats;
            matmul rate: 8192³ random matrices in the model's dtype (small sizes on the CPU).
  prefill   one prompt per size, the whole prompt in one engine step, prefix cache off (a size
            within --prefill-graph-max-tokens replays its bucket's CUDA graph, as when serving;
            its row names the graph): tok/s, TFLOP/s, MFU = FLOPs / time / matmul rate, with
            FLOPs = 2 × active params per token × tokens                     (projections, router,
                    + 2 × layers × heads × (qk + v head dims) × tokens² / 2  top-k experts; MLA:
                    + 2 × vocab × hidden                                     its up-projection,
                                                                             q·k over 192, p·v
                                                                             over 128 for V2-Lite)
                                                                             (lm_head, sampled row)
  decode    B sequences put straight into decode state (decode role: reserve, then start_decode)
            over `context` tokens of random KV; the median engine step = one token for each of B:
            tok/s and S-MBU ("roofline %") = bytes touched per step / step time / HBM copy rate,
            bytes = non-expert weights (lm_head, attention, norms, router; no embedding rows)
                    + experts hit × expert bytes   (distinct experts per layer, counted by hooks
                                                    on the routers in untimed steps of the same
                                                    batch; E·(1 − (1 − k/E)^B) if no router found)
                    + B × mean context × KV bytes per token   (K and V, or MLA's latent:
                                                               576 values per layer for V2-Lite).
  HF        transformers' model of the same shape (Qwen3MoeForCausalLM, DeepseekV2ForCausalLM: its
            cache holds the latents, as ours does) with its own random weights:
            prefill of one prompt (logits for the last row only, as `generate` does) and greedy
            `generate` decode, step time = time from the first decode forward's start to the
            end of `generate` over the decode steps (all `generate` does per token), median of
            reps; the same formulas, one table for both sides.
"""

import argparse
import dataclasses
import datetime
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.messages import Request
from pdserve.config import EngineConfig, ModelConfig
from pdserve.models import ModelArgs, resolve_model_args

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_COUNT_STEPS = 4  # untimed decode steps with router hooks (they also warm up)
_WARMUP_STEPS = 2  # untimed decode steps without hooks before the timed ones
_PROMPT_IDS = 256  # prompts draw ids from [0, 256): bytes for the preset tokenizer


def log(msg: str) -> None:
    print(f"[bench-engine] {msg}", flush=True)


# -- what a forward costs, from the model's shape ---------------------------------------------------


@dataclass(frozen=True)
class ModelCost:
    """Parameters a token passes through and bytes a decode step must read, from ModelArgs."""

    args: ModelArgs
    itemsize: int  # bytes per weight (and per KV element, unless kv_itemsize says)
    kv_itemsize: int | None = None  # an FP8 cache: 1

    @property
    def moe_layers(self) -> int:
        return sum(self.args.is_moe_layer(i) for i in range(self.args.num_layers))

    @property
    def expert_params(self) -> int:
        """One routed expert: w13 [2I, H] + w2 [H, I]."""
        return 3 * self.args.hidden_size * self.args.moe_intermediate_size

    @property
    def lm_head_params(self) -> int:
        return self.args.vocab_size * self.args.hidden_size

    def _attention_params(self) -> int:
        a = self.args
        if a.is_mla:  # q (direct or through q_lora_rank), kv_a to the latent, kv_b from it, o
            h, heads, qk = a.hidden_size, a.num_heads, a.head_dim
            q = h * heads * qk if a.q_lora_rank is None else a.q_lora_rank * (h + heads * qk)
            return (q + h * (a.kv_lora_rank + a.qk_rope_head_dim)
                    + a.kv_lora_rank * heads * (a.qk_nope_head_dim + a.v_head_dim) + heads * a.v_head_dim * h)
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        return a.hidden_size * (q + 2 * kv) + q * a.hidden_size

    def _mlp_params(self, layer: int) -> int:
        """Matmul weights every token of this layer passes through, routed experts aside."""
        a = self.args
        if not a.is_moe_layer(layer):
            return 3 * a.hidden_size * a.intermediate_size
        shared = 3 * a.hidden_size * a.shared_expert_intermediate_size + (
            a.hidden_size if a.shared_expert_gate else 0) if a.shared_expert_intermediate_size else 0
        return a.hidden_size * a.num_experts + shared  # router (+ shared expert and its gate)

    def active_params_per_token(self) -> int:
        """Matmul parameters one token passes through: projections, router, top-k experts; no lm_head."""
        a = self.args
        return sum(self._attention_params() + self._mlp_params(i)
                   + (a.num_experts_per_tok * self.expert_params if a.is_moe_layer(i) else 0)
                   for i in range(a.num_layers))

    def non_expert_params(self) -> int:
        """Parameters every decode step reads whatever the routing: all but experts and embedding rows."""
        a = self.args
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        if a.is_mla:  # layer norms, the latent norms; biases on q_a, kv_a and o
            lora = a.q_lora_rank or 0
            per_layer_small = 2 * a.hidden_size + a.kv_lora_rank + lora + (
                lora + a.kv_lora_rank + a.qk_rope_head_dim + a.hidden_size if a.attention_bias else 0)
        else:
            per_layer_small = (2 * a.hidden_size + (2 * a.head_dim if a.qk_norm else 0)
                               + ((q + 2 * kv) if a.attention_bias else 0) + (a.hidden_size if a.o_proj_bias else 0))
        routing_bias = a.num_experts if a.topk_method == "noaux_tc" else 0  # DeepSeek-V3's e_score_correction_bias
        layers = sum(self._attention_params() + self._mlp_params(i) + per_layer_small
                     + (routing_bias if a.is_moe_layer(i) else 0) for i in range(a.num_layers))
        return layers + a.hidden_size + self.lm_head_params  # final norm, lm_head

    def total_params(self) -> int:
        a = self.args
        embed = 0 if a.tie_word_embeddings else self.lm_head_params
        return self.non_expert_params() + self.moe_layers * a.num_experts * self.expert_params + embed

    def prefill_flops(self, tokens: int, sampled: int = 1) -> float:
        """One prompt of `tokens` from an empty cache; `sampled` rows go through lm_head."""
        a = self.args
        value_dim = a.v_head_dim if a.is_mla else a.head_dim  # MLA: q.k over head_dim, p.v over v_head_dim
        attention = 2 * a.num_layers * a.num_heads * (a.head_dim + value_dim) * tokens * tokens / 2  # causal
        return 2.0 * self.active_params_per_token() * tokens + 2.0 * self.lm_head_params * sampled + attention

    def uniform_experts_hit(self, batch: int) -> float:
        """Expected distinct experts per MoE layer for `batch` tokens routed uniformly: E·(1 − (1 − k/E)^B)."""
        e, k = self.args.num_experts, self.args.num_experts_per_tok
        return e * (1 - (1 - k / e) ** batch) if e else 0.0

    def kv_bytes_per_token(self) -> int:
        """The cache's bytes per token over all layers: K and V, or MLA's latent (KVLayout)."""
        a = self.args
        _, planes, heads, dim = a.kv_cache_entry()
        return planes * a.num_layers * heads * dim * (self.kv_itemsize or self.itemsize)

    def decode_bytes(self, batch: int, context: float, experts_hit: float) -> dict[str, float]:
        """Bytes one decode step must move: weights, the experts hit (per layer), the KV it attends over."""
        weights = self.non_expert_params() * self.itemsize
        experts = self.moe_layers * experts_hit * self.expert_params * self.itemsize
        kv = batch * context * self.kv_bytes_per_token()
        return {"weights": weights, "experts": experts, "kv": kv, "total": weights + experts + kv}


# -- timing and ceilings --------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_host(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """(seconds, result) of fn(), host clock between two device synchronisations."""
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def time_kernel(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int = 3) -> float:
    """Median seconds of fn() over reps, after warm-up; CUDA events on a GPU, host clock on the CPU."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        return statistics.median(time_host(fn, device)[0] for _ in range(reps))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    _sync(device)
    for start, end in events:
        start.record()
        fn()
        end.record()
    _sync(device)
    return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3


def measure_ceilings(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """HBM copy rate (bytes read + written per second) and matmul rate (FLOP/s) of this device."""
    gpu = device.type == "cuda"
    nbytes, n, reps = (2 << 30, 8192, 20) if gpu else (64 << 20, 512, 5)
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_s = time_kernel(lambda: dst.copy_(src), device, reps)
    del src, dst
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    c = torch.empty(n, n, dtype=dtype, device=device)
    mm_s = time_kernel(lambda: torch.mm(a, b, out=c), device, reps)
    del a, b, c
    free_memory(device)
    return {"hbm_copy_GB_s": round(2 * nbytes / copy_s / 1e9, 1), "copy_bytes": nbytes,
            "matmul_TFLOP_s": round(2 * n**3 / mm_s / 1e12, 2), "matmul_n": n,
            "matmul_dtype": str(dtype).removeprefix("torch.")}


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _peak_gb(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 1e9, 1) if device.type == "cuda" else None


def _random_ids(gen: torch.Generator, shape: tuple[int, ...], vocab: int) -> torch.Tensor:
    return torch.randint(0, min(vocab, _PROMPT_IDS), shape, generator=gen)


# -- counting the experts a decode step hits ------------------------------------------------------


def _topk_ids(output: Any, top_k: int) -> torch.Tensor:
    """The router's chosen experts [T, k]: HF routers return (logits, weights, ids); a plain gate, logits."""
    if isinstance(output, tuple):
        ids = [t for t in output if torch.is_tensor(t) and not t.is_floating_point()]
        if ids:
            return ids[-1].reshape(-1, top_k)
        output = output[0]
    return output.reshape(-1, output.shape[-1]).topk(top_k, dim=-1).indices


def experts_hit_per_layer(model: torch.nn.Module, run: Callable[[], Any], rows: int, top_k: int,
                          num_experts: int) -> float | None:
    """Mean distinct experts per MoE layer over the forwards of `rows` tokens that run() makes.

    Hooks the routers (modules named `*.mlp.gate`); None if the model has none or none fired
    (CUDA graph replays and padded batches are not seen: the caller falls back to uniform routing).
    """
    counts: list[torch.Tensor] = []

    def hook(module, inputs, output):
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return  # a CUDA graph being captured: nothing runs, and bincount would sync
        ids = _topk_ids(output, top_k)
        if ids.shape[0] == rows:  # a decode forward (a prefill forward has more rows)
            counts.append((torch.bincount(ids.flatten(), minlength=num_experts) > 0).sum())

    handles = [m.register_forward_hook(hook) for name, m in model.named_modules() if name.endswith("mlp.gate")]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return torch.stack(counts).float().mean().item() if counts else None


def decode_row(cost: ModelCost, batch: int, context: float, step_s: float, hit: float | None,
               copy_rate: float) -> dict[str, Any]:
    """One decode figure: step time, tok/s, bytes per step and S-MBU (the roofline %)."""
    source = "counted" if hit is not None else "uniform"
    hit = hit if hit is not None else cost.uniform_experts_hit(batch)
    b = cost.decode_bytes(batch, context, hit)
    roofline_s = b["total"] / copy_rate
    return {"batch": batch, "context": round(context, 1), "step_ms": round(step_s * 1e3, 3),
            "tok_s": round(batch / step_s, 1), "experts_per_layer": round(hit, 2), "experts_source": source,
            "experts_uniform": round(cost.uniform_experts_hit(batch), 2),
            "weights_GB": _sig(b["weights"] / 1e9), "experts_GB": _sig(b["experts"] / 1e9),
            "kv_GB": _sig(b["kv"] / 1e9), "GB_s": _sig(b["total"] / step_s / 1e9),
            "roofline_pct": _sig(100 * roofline_s / step_s),
            "roofline_tok_s": round(batch / roofline_s, 1)}


def prefill_row(cost: ModelCost, tokens: int, times: list[float], matmul_rate: float) -> dict[str, Any]:
    t = statistics.median(times)
    flops = cost.prefill_flops(tokens)
    return {"tokens": tokens, "ms": round(t * 1e3, 2), "tok_s": round(tokens / t, 1),
            "TFLOP_s": _sig(flops / t / 1e12), "MFU_pct": _sig(100 * flops / t / matmul_rate),
            "TFLOP": _sig(flops / 1e12), "all_ms": [round(x * 1e3, 2) for x in times]}


# -- the engine -----------------------------------------------------------------------------------


def engine_configs(a: argparse.Namespace, args: ModelArgs) -> tuple[EngineConfig, EngineConfig]:
    """(prefill, decode) engine settings; validated here, before anything is measured."""
    model = ModelConfig(path=a.model, dtype=a.dtype, load_format=a.load_format, seed=a.seed,
                        kv_cache_dtype=a.kv_cache_dtype)
    common = dict(model=model, device=a.device, block_size=a.block_size, enable_prefix_cache=False,
                  attention_backend=a.attention_backend, moe_backend=a.moe_backend)
    longest = max(a.prefill_sizes, default=a.block_size)
    # Prefill is timed one step at a time: its output must come from the step that computed it.
    # Its steps go the engine's own way: a size within prefill_graph_max_tokens replays the CUDA
    # graph of its bucket (engine/prefill_graphs.py), as it would serving.
    prefill = EngineConfig(**common, role="colocated", num_kv_blocks=-(-(longest + 1) // a.block_size) + 1,
                           max_num_seqs=1, max_num_batched_tokens=longest, chunk_size=longest,
                           overlap_scheduling=False, prefill_graph_max_tokens=a.prefill_graph_max_tokens)
    # Sized for the largest batch: context + every untimed and timed step, not 90 % of the device.
    steps = _COUNT_STEPS + _WARMUP_STEPS + a.decode_steps + 2
    per_seq = -(-(a.context + steps) // a.block_size)
    biggest = max(a.decode_batches, default=1)
    decode = EngineConfig(**common, role="decode", num_kv_blocks=biggest * per_seq + 1, max_num_seqs=biggest,
                          max_num_batched_tokens=max(biggest, 8192),
                          overlap_scheduling={"auto": None, "on": True, "off": False}[a.overlap])
    return prefill, decode


def _engine_backends(engine) -> dict[str, str]:
    return {k: type(getattr(engine.model, f"{k}_backend", None)).__name__ for k in ("attn", "moe")}


def bench_engine_prefill(a, cfg: EngineConfig, cost: ModelCost, matmul_rate: float, errors: list) -> dict:
    """Prefill of one prompt per size, the whole prompt in one step; median of reps after a warm-up."""
    from pdserve.engine.engine import Engine
    from pdserve.protocol import SamplingParams

    engine = Engine(cfg, log=log)
    device, rows = engine.device, []
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(a.seed)
    for n in a.prefill_sizes:
        try:
            prompt = _random_ids(gen, (n,), cost.args.vocab_size).tolist()
            times = []
            graphs = engine.runner.prefill_graphs
            replayed = dict(graphs.replays) if graphs is not None else {}
            for i in range(1 + a.reps):
                engine.add_request(f"prefill-{n}-{i}", prompt, params)
                dt, outs = time_host(engine.step, device)
                assert len(outs) == 1 and outs[0].finished, f"the {n}-token prompt did not finish in one step"
                times.append(dt)
            rows.append(prefill_row(cost, n, times[1:], matmul_rate))
            # The CUDA graph its steps replayed (bucket and layout), or None: eager.
            new = [k for k, v in (graphs.replays.items() if graphs is not None else ()) if v > replayed.get(k, 0)]
            rows[-1]["graph"] = " ".join(map(str, new[0])) if new else None
            log(f"engine prefill {rows[-1]}")
            if a.profile:
                engine.add_request(f"prefill-{n}-profile", prompt, params)
                rows[-1]["profile"] = _profile(a, f"prefill-{n}", engine.step, device)
        except Exception as e:  # noqa: BLE001 — one size failing (e.g. out of memory) must not lose the rest
            errors.append({"part": f"engine prefill {n}", "error": f"{type(e).__name__}: {e}"})
            log(f"engine prefill {n} failed: {errors[-1]['error']}")
            for rid in list(engine.seqs):
                engine.abort(rid)
            free_memory(device)
    out = {"rows": rows, "backends": _engine_backends(engine), "peak_GB": _peak_gb(device)}
    del engine
    return out


def _random_kv(kv_cache: torch.Tensor, seed: int) -> None:
    """Fill the cache with N(0, 1) values (not zeros); an FP8 one layer by layer: it has no normal_,
    and a bfloat16 copy of a whole cache sized to the GPU would not fit."""
    gen = torch.Generator(kv_cache.device).manual_seed(seed)
    if kv_cache.dtype.itemsize > 1:
        kv_cache.normal_(generator=gen)
        return
    for layer in kv_cache:
        layer.copy_(torch.randn(layer.shape, generator=gen, device=layer.device, dtype=torch.bfloat16))


def bench_engine_decode(a, cfg: EngineConfig, cost: ModelCost, copy_rate: float, errors: list) -> dict:
    """Steady-state decode steps of B sequences placed straight into decode state over random KV."""
    from pdserve.engine.engine import Engine

    engine = Engine(cfg, log=log)
    _random_kv(engine.kv_cache, a.seed)
    idle, rows = engine.pool.num_free_blocks, []
    for b in a.decode_batches:
        try:
            rows.append(_decode_batch(a, engine, cost, b, copy_rate))
            log(f"engine decode {rows[-1]}")
        except Exception as e:  # noqa: BLE001 — e.g. out of memory at the largest batch
            errors.append({"part": f"engine decode batch {b}", "error": f"{type(e).__name__}: {e}"})
            log(f"engine decode batch {b} failed: {errors[-1]['error']}")
        finally:
            for rid in list(engine.seqs):
                engine.abort(rid)
            free_memory(engine.device)
        assert engine.pool.num_free_blocks == idle, "decode left blocks allocated"
    out = {"rows": rows, "backends": _engine_backends(engine), "peak_GB": _peak_gb(engine.device),
           "kv_blocks": engine.layout.num_blocks}
    del engine
    return out


def _decode_batch(a, engine, cost: ModelCost, batch: int, copy_rate: float) -> dict[str, Any]:
    from pdserve.protocol import SamplingParams

    steps = _COUNT_STEPS + _WARMUP_STEPS + a.decode_steps
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(a.seed + batch)
    prompts = _random_ids(gen, (batch, a.context), cost.args.vocab_size).tolist()
    firsts = _random_ids(gen, (batch,), cost.args.vocab_size).tolist()
    for i, prompt in enumerate(prompts):
        # The KV of these blocks is whatever the cache holds (random): no prefill needed.
        assert engine.reserve(Request(f"decode-{batch}-{i}", prompt, params)) is not None, "KV cache too small"
    for i, tok in enumerate(firsts):
        engine.start_decode(f"decode-{batch}-{i}", tok)
    assert len(engine.scheduler.running) == batch
    hit = experts_hit_per_layer(engine.model, lambda: [engine.step() for _ in range(_COUNT_STEPS)],
                                batch, cost.args.num_experts_per_tok, cost.args.num_experts)
    for _ in range(_WARMUP_STEPS):
        engine.step()
    # Steps back to back, as a serving loop runs them (no device sync between them: an overlapped
    # engine queues step N+1 before it waits for step N); the figure is their mean.
    context = statistics.mean(s.num_computed_tokens + 1 for s in engine.scheduler.running) + (a.decode_steps - 1) / 2

    def steps_() -> list:
        return [engine.step() for _ in range(a.decode_steps)]

    dt, outs = time_host(steps_, engine.device)
    assert all(len(o) == batch for o in outs), f"a decode step gave {min(map(len, outs))} tokens for a batch of {batch}"
    row = decode_row(cost, batch, context, dt / a.decode_steps, hit, copy_rate)
    row["overlap"] = engine.overlap
    if a.profile:  # one more step: the sequences have two tokens to go
        row["profile"] = _profile(a, f"decode-{batch}", engine.step, engine.device)
    return row


def _profile(a, label: str, step: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    from pdserve.benchmarks.step_kernels import profile_step, summary

    p = profile_step(step, device, trace=Path(a.profile) / f"{label}.trace.json")
    log(summary(label, p))
    return p


# -- HF transformers ------------------------------------------------------------------------------


# The HF baseline's class per architecture: transformers' own model of the family.
HF_BASELINES = ("Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM")


def hf_config_kwargs(args: ModelArgs) -> dict[str, Any]:
    """The transformers config of this shape (HF_BASELINES' architectures)."""
    if args.architecture not in HF_BASELINES:
        raise ValueError(f"the HF baseline is built for {' and '.join(HF_BASELINES)} shapes, not "
                         f"{args.architecture} (use --no-hf)")
    kw = dict(vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
              num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads,
              num_experts_per_tok=args.num_experts_per_tok, moe_intermediate_size=args.moe_intermediate_size,
              norm_topk_prob=args.norm_topk_prob, rms_norm_eps=args.rms_norm_eps,
              max_position_embeddings=args.max_position_embeddings, tie_word_embeddings=args.tie_word_embeddings,
              rope_parameters={"rope_type": "default", **(args.rope_scaling or {}), "rope_theta": args.rope_theta})
    if args.architecture == "Qwen3MoeForCausalLM":
        return dict(kw, num_key_value_heads=args.num_kv_heads, head_dim=args.head_dim, num_experts=args.num_experts,
                    decoder_sparse_step=args.decoder_sparse_step, mlp_only_layers=list(args.mlp_only_layers))
    # DeepSeek-V2 (V2-Lite): Multi-head Latent Attention, whose cache transformers keeps as latents too.
    return dict(kw, num_key_value_heads=args.num_heads, kv_lora_rank=args.kv_lora_rank, q_lora_rank=args.q_lora_rank,
                qk_nope_head_dim=args.qk_nope_head_dim, qk_rope_head_dim=args.qk_rope_head_dim,
                v_head_dim=args.v_head_dim, n_routed_experts=args.num_experts,
                n_shared_experts=args.shared_expert_intermediate_size // args.moe_intermediate_size,
                first_k_dense_replace=args.first_k_dense_replace, topk_method=args.topk_method,
                n_group=args.n_group, topk_group=args.topk_group, routed_scaling_factor=args.routed_scaling_factor,
                attention_bias=args.attention_bias)


def build_hf(args: ModelArgs, dtype: torch.dtype, device: torch.device, seed: int):
    """transformers' model of this shape (HF_BASELINES) on `device`, random weights (grouped_mm experts if it can)."""
    import transformers

    kw = hf_config_kwargs(args)
    model_cls = getattr(transformers, args.architecture)
    config_cls = getattr(transformers, args.architecture.removesuffix("ForCausalLM") + "Config")
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # allocate straight in dtype: the 30B shape does not fit twice in float32
    try:
        with torch.device(device):
            try:
                hf = model_cls(config_cls(**kw, experts_implementation="grouped_mm"))
            except (ValueError, ImportError, TypeError) as e:
                log(f"HF grouped_mm experts unavailable ({e}); using transformers' default")
                hf = model_cls(config_cls(**kw))
    finally:
        torch.set_default_dtype(old)
    _random_init(hf, seed)
    return hf.eval().requires_grad_(False)


@torch.no_grad()
def _random_init(model: torch.nn.Module, seed: int) -> None:
    # As the engine's dummy weights: normal(0, 0.02), norms 1. A zero router would send every token
    # to the same k experts and flatter the decode figures.
    gen = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name.rsplit(".", 2)[-2]:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)


def bench_hf(a, cost: ModelCost, dtype: torch.dtype, ceilings: dict, errors: list) -> dict:
    import transformers

    transformers.logging.set_verbosity_error()
    device = torch.device(a.device)
    log(f"building HF transformers {transformers.__version__} {cost.args.architecture} ({a.model} shape, random weights)")
    hf = build_hf(cost.args, dtype, device, a.seed + 1)
    impl = getattr(hf.config, "_experts_implementation", None)
    out: dict[str, Any] = {"version": transformers.__version__, "experts_implementation": impl,
                           "decode_switches_to_batched_mm": device.type != "cpu" and impl == "grouped_mm"
                           and hasattr(hf, "_optimize_model_for_decode"), "prefill": [], "decode": []}
    matmul_rate, copy_rate = ceilings["matmul_TFLOP_s"] * 1e12, ceilings["hbm_copy_GB_s"] * 1e9
    for n in a.hf_prefill_sizes:
        try:
            out["prefill"].append(_hf_prefill(a, hf, cost, n, device, matmul_rate))
            log(f"HF prefill {out['prefill'][-1]}")
        except Exception as e:  # noqa: BLE001
            errors.append({"part": f"HF prefill {n}", "error": f"{type(e).__name__}: {e}"})
            log(f"HF prefill {n} failed: {errors[-1]['error']}")
        free_memory(device)
    for b in a.hf_decode_batches:
        try:
            out["decode"].append(_hf_decode(a, hf, cost, b, device, copy_rate))
            log(f"HF decode {out['decode'][-1]}")
        except Exception as e:  # noqa: BLE001
            errors.append({"part": f"HF decode batch {b}", "error": f"{type(e).__name__}: {e}"})
            log(f"HF decode batch {b} failed: {errors[-1]['error']}")
        free_memory(device)
    out["peak_GB"] = _peak_gb(device)
    del hf
    return out


@torch.inference_mode()
def _hf_prefill(a, hf, cost: ModelCost, n: int, device: torch.device, matmul_rate: float) -> dict:
    ids = _random_ids(torch.Generator().manual_seed(a.seed + n), (1, n), cost.args.vocab_size).to(device)
    times = [time_host(lambda: hf(input_ids=ids, logits_to_keep=1), device)[0] for _ in range(1 + a.reps)]
    return prefill_row(cost, n, times[1:], matmul_rate)


@torch.inference_mode()
def _hf_decode(a, hf, cost: ModelCost, batch: int, device: torch.device, copy_rate: float) -> dict:
    ids = _random_ids(torch.Generator().manual_seed(a.seed + batch), (batch, a.context),
                      cost.args.vocab_size).to(device)
    mask = torch.ones_like(ids)

    def generate(new: int) -> None:
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0)
        assert out.shape == (batch, a.context + new), tuple(out.shape)

    # The counting run also warms up (prefill and decode shapes of this batch).
    hit = experts_hit_per_layer(hf, lambda: generate(1 + _COUNT_STEPS), batch,
                                cost.args.num_experts_per_tok, cost.args.num_experts)
    per_rep = [_decode_step_time(hf, lambda: generate(1 + a.hf_steps), a.hf_steps, device) for _ in range(a.reps)]
    # Decode forwards see contexts context + 1 .. context + hf_steps.
    row = decode_row(cost, batch, a.context + (a.hf_steps + 1) / 2, statistics.median(per_rep), hit, copy_rate)
    row["all_ms"] = [round(t * 1e3, 3) for t in per_rep]
    return row


def _decode_step_time(hf, run: Callable[[], None], steps: int, device: torch.device) -> float:
    """Mean seconds per decode step of one `generate` making 1 + `steps` tokens: prefill left out.

    The clock starts when the first decode forward begins, on an idle device (the prefill done),
    and stops when `generate` has returned and the device is idle: it covers everything
    `generate` does per token. No other synchronisation is added, so the host may run ahead as
    `generate` lets it.
    """
    stamps: list[float] = []

    def stamp(module, args, kwargs):
        if len(stamps) < 2:  # the prefill forward, then the first decode forward
            _sync(device)
        stamps.append(time.perf_counter())

    handle = hf.register_forward_pre_hook(stamp, with_kwargs=True)
    try:
        run()
    finally:
        handle.remove()
    _sync(device)
    end = time.perf_counter()
    assert len(stamps) == 1 + steps, f"generate made {len(stamps)} forwards, expected {1 + steps}"
    return (end - stamps[1]) / steps


# -- the command ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench-engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-30b-a3b", help="preset or HF model directory (default: %(default)s)")
    p.add_argument("--device", default="cuda", help="cuda[:N] or cpu (default: %(default)s)")
    p.add_argument("--dtype", default="auto", choices=["auto", *_DTYPES],
                   help="auto: bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"],
                   help="ModelConfig.kv_cache_dtype (auto: the model's dtype)")
    p.add_argument("--load-format", default="dummy", choices=["auto", "dummy"],
                   help="dummy: random weights (speed does not depend on their values)")
    p.add_argument("--prefill-sizes", type=int, nargs="*", default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--decode-batches", type=int, nargs="*", default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--context", type=int, default=1024, help="KV tokens per sequence when decoding")
    p.add_argument("--decode-steps", type=int, default=16, help="timed engine decode steps, back to back (their mean)")
    p.add_argument("--overlap", choices=["auto", "on", "off"], default="auto",
                   help="decode engine's overlap_scheduling (auto: on a GPU; default: %(default)s)")
    p.add_argument("--reps", type=int, default=3, help="timed repeats of each prefill and HF generate")
    p.add_argument("--prefill-graph-max-tokens", type=int, default=None,
                   help="EngineConfig.prefill_graph_max_tokens of the prefill engine: sizes up to it replay "
                        "CUDA graphs (default: the engine's, 4096 on a GPU; 0: every size eager)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--attention-backend", default="auto", help="EngineConfig.attention_backend")
    p.add_argument("--moe-backend", default="auto", help="EngineConfig.moe_backend")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    p.add_argument("--hf-prefill-sizes", type=int, nargs="*", help="default: the prefill sizes <= 4096")
    p.add_argument("--hf-decode-batches", type=int, nargs="*", help="default: the decode batches <= 64")
    p.add_argument("--hf-steps", type=int, default=16, help="decode steps of each timed HF generate (their mean)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--profile", metavar="DIR",
                   help="also profile one more step of each prefill size and decode batch: host vs GPU time, "
                        "kernel count and top kernels in the log and the JSON, a Chrome trace per step in DIR")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    a = build_parser().parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {a.device}: no CUDA device here (a CPU dry run: --model tiny-moe --device cpu)")
    if a.dtype == "auto":
        a.dtype = "float32" if a.device == "cpu" else "bfloat16"
    if a.context < 2:  # a decode forward is told from a prefill forward by its row count
        raise ValueError(f"--context must be at least 2, got {a.context}")
    if min(a.decode_steps, a.reps, a.hf_steps) < 1:
        raise ValueError("--decode-steps, --reps and --hf-steps must be at least 1")
    if a.hf_prefill_sizes is None:
        a.hf_prefill_sizes = [n for n in a.prefill_sizes if n <= 4096]
    if a.hf_decode_batches is None:
        a.hf_decode_batches = [b for b in a.decode_batches if b <= 64]
    if a.no_hf:
        a.hf_prefill_sizes, a.hf_decode_batches = [], []
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    device, dtype = torch.device(a.device), _DTYPES[a.dtype]
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    args = resolve_model_args(a.model)
    cost = ModelCost(args, dtype.itemsize, 1 if a.kv_cache_dtype == "fp8_e4m3" else None)
    prefill_cfg, decode_cfg = engine_configs(a, args)  # a bad backend name fails here, not after minutes
    if device.type == "cuda":
        torch.cuda.set_device(device)
    errors: list[dict[str, str]] = []
    result: dict[str, Any] = {"meta": _meta(a, device, cost), "errors": errors}
    log(f"ceilings on {result['meta']['device_name']}")
    ceilings = result["ceilings"] = measure_ceilings(device, dtype)
    log(f"ceilings {ceilings}")
    _write_json(a.json, result)
    # HF first: a fault in an engine kernel can leave the CUDA context unusable, and the
    # baseline should survive it. The JSON is rewritten after every part, so a run cut short
    # keeps what it measured.
    hf_cost = dataclasses.replace(cost, kv_itemsize=None)  # HF caches in the model's dtype, whatever ours holds
    parts = [("hf", a.hf_prefill_sizes + a.hf_decode_batches, lambda: bench_hf(a, hf_cost, dtype, ceilings, errors)),
             ("engine_prefill", a.prefill_sizes,
              lambda: bench_engine_prefill(a, prefill_cfg, cost, ceilings["matmul_TFLOP_s"] * 1e12, errors)),
             ("engine_decode", a.decode_batches,
              lambda: bench_engine_decode(a, decode_cfg, cost, ceilings["hbm_copy_GB_s"] * 1e9, errors))]
    for name, work, run in parts:
        if not work:
            continue
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            result[name] = run()
        except Exception as e:  # noqa: BLE001 — e.g. the model does not fit: keep the other parts
            errors.append({"part": name, "error": f"{type(e).__name__}: {e}"})
            log(f"{name} failed: {errors[-1]['error']}")
        free_memory(device)
        _write_json(a.json, result)
    print_table(result)
    if a.json:
        log(f"wrote {a.json}")
    return 1 if errors else 0


def _write_json(path: str | None, result: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def _sig(x: float, digits: int = 4) -> float:
    """x to `digits` significant digits: a tiny CPU dry run's TFLOP/s must not round to 0."""
    return float(f"{x:.{digits}g}")


def _meta(a: argparse.Namespace, device: torch.device, cost: ModelCost) -> dict[str, Any]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"date": datetime.date.today().isoformat(), "device_name": name, "torch": torch.__version__,
            "model": a.model, "dtype": a.dtype, "kv_cache_dtype": a.kv_cache_dtype, "device": a.device,
            "context": a.context, "reps": a.reps,
            "decode_steps": a.decode_steps, "hf_steps": a.hf_steps, "block_size": a.block_size,
            "attention_backend": a.attention_backend, "moe_backend": a.moe_backend,
            "cpu_threads": torch.get_num_threads(),
            "active_params_per_token": cost.active_params_per_token(), "total_params": cost.total_params(),
            "non_expert_params": cost.non_expert_params(), "expert_params": cost.expert_params,
            "moe_layers": cost.moe_layers, "kv_bytes_per_token": cost.kv_bytes_per_token()}


def _fmt(row: dict | None, *keys: str) -> list[str]:
    return [str(row[k]) if row else "-" for k in keys]


def print_table(r: dict[str, Any]) -> None:
    m, c = r["meta"], r.get("ceilings", {})
    hf = r.get("hf", {})
    print(f"\n{m['model']} {m['dtype']} on {m['device_name']} ({m['date']}, torch {m['torch']}); "
          f"HBM copy {c.get('hbm_copy_GB_s')} GB/s, matmul {c.get('matmul_TFLOP_s')} TFLOP/s; "
          f"engine backends {r.get('engine_decode', r.get('engine_prefill', {})).get('backends')}; "
          f"HF {hf.get('version', '-')} experts {hf.get('experts_implementation', '-')}")
    pre = {x["tokens"]: x for x in r.get("engine_prefill", {}).get("rows", [])}
    hpre = {x["tokens"]: x for x in hf.get("prefill", [])}
    print(f"{'prefill':>8} {'ms':>9} {'tok/s':>9} {'TFLOP/s':>8} {'MFU %':>6} {'graph':>11} | {'HF ms':>9} "
          f"{'HF MFU %':>8}")
    for n in sorted(pre.keys() | hpre.keys()):
        ms, tok, tf, mfu = _fmt(pre.get(n), "ms", "tok_s", "TFLOP_s", "MFU_pct")
        graph = (pre.get(n) or {}).get("graph") or "-"
        hms, hmfu = _fmt(hpre.get(n), "ms", "MFU_pct")
        print(f"{n:>8} {ms:>9} {tok:>9} {tf:>8} {mfu:>6} {graph:>11} | {hms:>9} {hmfu:>8}")
    dec = {x["batch"]: x for x in r.get("engine_decode", {}).get("rows", [])}
    hdec = {x["batch"]: x for x in hf.get("decode", [])}
    print(f"{'batch':>8} {'step ms':>9} {'tok/s':>9} {'roofl %':>8} {'exp/L':>6} | "
          f"{'HF step ms':>10} {'HF tok/s':>9} {'HF roofl %':>10}   (context {m['context']})")
    for b in sorted(dec.keys() | hdec.keys()):
        ms, tok, pct, exp = _fmt(dec.get(b), "step_ms", "tok_s", "roofline_pct", "experts_per_layer")
        hms, htok, hpct = _fmt(hdec.get(b), "step_ms", "tok_s", "roofline_pct")
        print(f"{b:>8} {ms:>9} {tok:>9} {pct:>8} {exp:>6} | {hms:>10} {htok:>9} {hpct:>10}")
    for e in r["errors"]:
        print(f"FAILED {e['part']}: {e['error']}")


if __name__ == "__main__":
    sys.exit(main())
