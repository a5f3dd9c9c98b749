"""Tiny random HF checkpoints of every supported family, written with `save_pretrained`.

Each one exercises a feature of its family: q/k/v (and o) bias, shared expert with its gate,
dense layers among MoE ones, tied embeddings, llama3 RoPE scaling, a sharded index. Weights are
float32 with a large init std (and random norms and biases, which HF would init to 1 and 0) so
that a mistake in any of them shows in the logits.
"""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

_COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=96, max_position_embeddings=256,
               initializer_range=0.15, rms_norm_eps=1e-6, attn_implementation="eager")

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

# family -> (config class, model class, config kwargs, save_pretrained kwargs)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_hidden_layers=3, head_dim=32, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1]),
                  dict(max_shard_size="150KB")),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=False,
                       shared_expert_intermediate_size=80, decoder_sparse_step=2),
                  {}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=6, num_experts_per_tok=2), {}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, rope_parameters=LLAMA3_ROPE), {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True), {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24), {}),
}


@dataclass
class Checkpoint:
    path: Path
    hf_model: torch.nn.Module  # the reference, float32, eager attention


def build_checkpoint(family: str, root: Path, seed: int = 0) -> Checkpoint:
    """Save a random `family` checkpoint under root/family and return it with its HF model."""
    config_cls, model_cls, kwargs, save_kwargs = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**_COMMON, **kwargs})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
    path = root / family
    model.save_pretrained(path, **save_kwargs)
    return Checkpoint(path, model)


def write_old_layout(src: Path, dst: Path) -> None:
    """Copy a checkpoint, rewriting config.json as pre-transformers-5 checkpoints have it."""
    shutil.copytree(src, dst)
    cfg = json.loads((src / "config.json").read_text())
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
    cfg["torch_dtype"] = cfg.pop("dtype")
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer covering every id: the engine needs one to detokenize."""
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
