"""CPU decode throughput of the engine on tiny-moe, against HF transformers in the same run.

    python -m pdserve.benchmarks.engine_cpu [--batches 1 32] [--prompt-len 32] [--new-tokens 64]

Both sides run the same weights (copied from the engine into an HF Qwen3-MoE module), the same
prompts, greedy, with every request forced to produce exactly --new-tokens tokens.
"""

import argparse
import datetime
import json
import platform
import time

import torch

from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.protocol import SamplingParams


def hf_twin(engine: Engine):
    """An HF transformers Qwen3-MoE holding the engine's weights."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    a = engine.args
    cfg = Qwen3MoeConfig(
        vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_layers, num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_kv_heads, head_dim=a.head_dim, num_experts=a.num_experts,
        num_experts_per_tok=a.num_experts_per_tok, moe_intermediate_size=a.moe_intermediate_size,
        norm_topk_prob=a.norm_topk_prob, rms_norm_eps=a.rms_norm_eps,
        max_position_embeddings=a.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": a.rope_theta},
        tie_word_embeddings=a.tie_word_embeddings)
    hf = Qwen3MoeForCausalLM(cfg).eval()
    missing, unexpected = hf.load_state_dict(export_hf_state(engine.model), strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return hf


def export_hf_state(model) -> dict[str, torch.Tensor]:
    """The engine model's weights under transformers 5's in-memory names (fused experts)."""
    out = {}
    for name, t in model.state_dict().items():
        name = name.replace("mlp.w13", "mlp.experts.gate_up_proj").replace("mlp.w2", "mlp.experts.down_proj")
        out[name if name.startswith("lm_head") else f"model.{name}"] = t.contiguous()
    return out


def time_engine(engine: Engine, prompts, new_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    assert all(len(o.token_ids) == new_tokens for o in outs)
    return len(prompts) * new_tokens / dt, [o.token_ids for o in outs]


@torch.inference_mode()
def time_hf(hf, prompts, new_tokens: int) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts)
    hf.generate(ids[:1], max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm-up
    t0 = time.perf_counter()
    out = hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                      pad_token_id=0)
    dt = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + new_tokens
    return len(prompts) * new_tokens / dt, out[:, ids.shape[1]:].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(model=ModelConfig(path="tiny-moe"), num_kv_blocks=1024))
    hf = hf_twin(engine)
    g = torch.Generator().manual_seed(0)
    rows = []
    for b in args.batches:
        prompts = torch.randint(0, 256, (b, args.prompt_len), generator=g).tolist()
        ours, our_tokens = time_engine(engine, prompts, args.new_tokens)
        ref, ref_tokens = time_hf(hf, prompts, args.new_tokens)
        # Same weights, same prompts, greedy: a speed figure only counts if the tokens agree.
        same = sum(a == b for a, b in zip(our_tokens, ref_tokens))
        print(f"batch {b}: {same}/{b} sequences identical to HF transformers", flush=True)
        rows.append({"batch": b, "pdserve_tok_s": round(ours, 1), "hf_tok_s": round(ref, 1),
                     "ratio": round(ours / ref, 2), "identical": f"{same}/{b}"})
        print(f"batch {b}: pdserve {ours:.1f} tok/s, HF transformers {ref:.1f} tok/s", flush=True)
    meta = {"date": datetime.date.today().isoformat(), "device": platform.processor() or platform.machine(),
            "threads": args.threads, "torch": torch.__version__, "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens}
    print(f"\n{'batch':>5} {'pdserve tok/s':>14} {'HF tok/s':>10} {'ratio':>6} {'identical':>10}")
    for r in rows:
        print(f"{r['batch']:>5} {r['pdserve_tok_s']:>14} {r['hf_tok_s']:>10} {r['ratio']:>6} {r['identical']:>10}")
    print(json.dumps(meta))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
