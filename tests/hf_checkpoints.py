"""Tiny random HF checkpoints of every supported family, written with `save_pretrained`.

Each one exercises a feature of its family: q/k/v (and o) bias, shared expert with its gate,
dense layers among MoE ones, tied embeddings, llama3 RoPE scaling, a sharded index; DeepSeek's
Multi-head Latent Attention with q_lora_rank unset (V2, as V2-Lite) and set (V3), a dense first
layer, shared experts, group-limited routing (V2) and noaux_tc with a correction bias (V3), YaRN
with mscale. Weights are float32 with a large init std (and random norms, biases and routing
biases, which HF would init to 1 and 0) so that a mistake in any of them shows in the logits.
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

# DeepSeek's YaRN: mscale != mscale_all_dim makes the cos/sin factor differ from 1 (V2); both 1 as
# in DeepSeek-V3's config leaves it 1 and scales the softmax alone.
YARN_V2 = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
           "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}
YARN_V3 = {**YARN_V2, "factor": 8.0, "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 1.0}
# MLA shapes: latent 32 + rope 8 cached per token and layer; q/k heads 16 + 8 wide, v heads 12.
_MLA = dict(num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=12, moe_intermediate_size=24, first_k_dense_replace=1)

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
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    dict(_MLA, q_lora_rank=None, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
                         topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
                         rope_parameters=YARN_V2),
                    {}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(_MLA, q_lora_rank=24, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3,
                         n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                         attention_bias=True, rope_parameters=YARN_V3),
                    {}),
}


@dataclass
class Checkpoint:
    path: Path
    hf_model: torch.nn.Module  # the reference, float32, eager attention


def build_checkpoint(family: str, root: Path, seed: int = 0, **overrides) -> Checkpoint:
    """Save a random `family` checkpoint under root/family and return it with its HF model;
    `overrides`: config keys that differ from the family's here."""
    config_cls, model_cls, kwargs, save_kwargs = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**_COMMON, **kwargs, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    _spread(model)
    path = root / family
    model.save_pretrained(path, **save_kwargs)
    return Checkpoint(path, model)


def _spread(model: torch.nn.Module, others: float | None = None) -> None:
    """Random weights that differ from HF's initialisation where it leaves them uniform: norms
    around 1, biases and V3's routing bias (a saved buffer) around 0; `others`: every other weight
    drawn again with this deviation (a module HF's init never saw)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            elif others is not None:
                p.normal_(0, others)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))


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


SHARP_EMBED, SHARP_HEAD = 6.0, 1 / 3  # embeddings x6; the head reads them at x2


def checkpoint_path(family: str, root: Path, seed: int = 0, sharp: bool = False, **overrides) -> Path:
    """A tiny random `family` checkpoint with its tokenizer; returns its path.

    sharp: non-degenerate weights. Random layers make the next token hinge on near-ties that a
    rounding (bf16's ~0.4 % per operation, an FP8 KV cache's ~6 % per value) flips; here a strong
    embedding path (lm_head reads a permutation of the embeddings) sets a clear leader, while
    attention and experts (unchanged) still move the logits and the choice."""
    tag = "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
    ck = build_checkpoint(family, root / f"{family}-{seed}{tag}", seed=seed, **overrides)
    path = ck.path
    if sharp:
        m = ck.hf_model
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            emb = m.model.embed_tokens.weight
            emb.mul_(SHARP_EMBED)
            m.lm_head.weight.copy_(emb[torch.randperm(emb.shape[0], generator=g)] * SHARP_HEAD)
        path = path.with_name(path.name + "-sharp")
        m.save_pretrained(path)
    write_tokenizer(path, ck.hf_model.config.vocab_size)
    return path


def clear_prompts(reference, prompts: list[list[int]], n: int, tokens: int, min_margin: float
                  ) -> tuple[list[list[int]], list[list[int]]]:
    """The n `prompts` whose greedy continuation by `reference` (an Engine) is least ambiguous, and
    that continuation. Random weights give near-ties somewhere (a rounding then picks the other
    token, and the texts part): a check against the reference is meaningful where its top token
    leads the next one by a clear margin at every step, so that is asserted first."""
    from pdserve.protocol import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=2)
    ref = reference.generate(prompts, params)
    margin = [min(lp.top[0][1] - lp.top[1][1] for lp in c.logprobs) for c in ref]
    best = sorted(range(len(prompts)), key=lambda i: -margin[i])[:n]
    assert min(margin[i] for i in best) >= min_margin, sorted(margin)[-n:]
    return [prompts[i] for i in best], [ref[i].token_ids for i in best]


class HFMultiTokenPredictor(torch.nn.Module):
    """DeepSeek-V3's MTP layer built from transformers' own modules (its DeepseekV3ForCausalLM drops
    the layer): the oracle of pdserve.models.deepseek_mtp. `forward` takes the main model's last
    hidden states (after its final norm) and the tokens after each position."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

        h = config.hidden_size
        self.enorm = hf.DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
        self.hnorm = hf.DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        self.block = hf.DeepseekV3DecoderLayer(config, layer_idx=config.num_hidden_layers)
        self.norm = hf.DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
        self.head = torch.nn.Linear(h, config.vocab_size, bias=False)

    def forward(self, hf_model, hidden: torch.Tensor, next_ids: list[int]) -> torch.Tensor:
        """hidden [T, H] at positions 0..T-1, next_ids [T] -> draft logits [T, vocab]."""
        t = len(next_ids)
        embeds = hf_model.model.embed_tokens(torch.tensor(next_ids))
        embeds[0] = 0  # position 0's embedding is masked (vLLM's DeepSeekMultiTokenPredictorLayer)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], -1))[None]
        positions = torch.arange(t)[None]
        rope = hf_model.model.rotary_emb(x, positions)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        out = self.block(x, attention_mask=mask, position_ids=positions, position_embeddings=rope)
        out = out[0] if isinstance(out, tuple) else out
        return self.head(self.norm(out[0])).float()

    def hub_tensors(self, layer: int) -> dict[str, torch.Tensor]:
        """The layer's tensors as a DeepSeek-V3 checkpoint on the Hub names them: under
        model.layers.{layer}., one tensor per expert, and a copy of the shared embedding."""
        out = {}
        for name, t in self.state_dict().items():
            name = {"norm.weight": "shared_head.norm.weight", "head.weight": "shared_head.head.weight"}.get(
                name, name.removeprefix("block."))
            if name.endswith("experts.gate_up_proj"):
                prefix, inter = name.removesuffix("gate_up_proj"), t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter]
                    out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:]
            elif name.endswith("experts.down_proj"):
                prefix = name.removesuffix("down_proj")
                for e in range(t.shape[0]):
                    out[f"{prefix}{e}.down_proj.weight"] = t[e]
            else:
                out[name] = t
        return {f"model.layers.{layer}.{k}": v.contiguous().clone() for k, v in out.items()}


def mtp_checkpoint(root: Path, seed: int = 0, sharp: bool = False) -> tuple[Path, Checkpoint, HFMultiTokenPredictor]:
    """A tiny random DeepSeek-V3 checkpoint with one multi-token-prediction layer (config.json
    num_nextn_predict_layers 1, the layer's tensors after the last layer's, as on the Hub), its
    tokenizer; returns its path, the HF model and the MTP oracle. sharp: as checkpoint_path's."""
    from safetensors.torch import load_file, save_file

    path = checkpoint_path("deepseek_v3", root, seed=seed, sharp=sharp)
    ck = Checkpoint(path, transformers.DeepseekV3ForCausalLM.from_pretrained(path).eval())
    config = ck.hf_model.config
    torch.manual_seed(seed + 1)
    oracle = HFMultiTokenPredictor(config).eval()
    _spread(oracle, others=config.initializer_range)
    with torch.no_grad():
        if sharp:
            # An easy guess: the sharp model's next token follows mostly from the current one (its
            # head reads a permutation of the embeddings); here eh_proj passes the next token's
            # embedding on (strongly: the layer's random attention and experts still move it) and
            # the same head reads it, so the draft is the sharp model's token after the next.
            h = config.hidden_size
            oracle.eh_proj.weight.copy_(torch.cat([SHARP_EMBED * torch.eye(h), torch.zeros(h, h)], 1))
            oracle.head.weight.copy_(ck.hf_model.lm_head.weight)
    files = sorted(path.glob("*.safetensors"))
    assert len(files) == 1, files  # (one file: the MTP tensors go into it)
    tensors = load_file(files[0])
    tensors.update(oracle.hub_tensors(config.num_hidden_layers))
    tensors[f"model.layers.{config.num_hidden_layers}.embed_tokens.weight"] = \
        ck.hf_model.model.embed_tokens.weight.detach().clone()
    save_file(tensors, files[0], metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path, ck, oracle
