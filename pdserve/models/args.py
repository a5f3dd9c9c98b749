"""ModelArgs: everything the engine needs about a model's shape, parsed from a HF config.json."""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.models.presets import PRESETS

if TYPE_CHECKING:  # the router reads model shapes and must not import torch
    import torch

SUPPORTED_ARCHITECTURES = (
    "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM",
    "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
)
# Multi-head Latent Attention families: the KV cache holds one latent vector per token and layer.
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# "dynamic" is left out on purpose: its frequencies depend on the length of the running sequence,
# so a key cached early would not match one computed later. "longrope" is Phi-3 only.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# MoE config keys a checkpoint may omit, with transformers' defaults for that family.
_MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "Qwen3MoeForCausalLM": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                            "norm_topk_prob": False},
    "Qwen2MoeForCausalLM": {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                            "norm_topk_prob": False, "shared_expert_intermediate_size": 5632},
}


@dataclass
class ModelArgs:
    """Shape and hyper-parameters of a decoder-only model (one of SUPPORTED_ARCHITECTURES)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP layers
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None for plain RoPE; else {"rope_type": ..., params}
    max_position_embeddings: int  # capped at the sliding window when one is in use
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias
    o_proj_bias: bool = False  # Llama/Qwen3 `attention_bias` also puts one on o_proj
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    num_experts: int = 0  # 0: dense model
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalize the top-k routing weights to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE, DeepSeek: 0 means no shared expert
    shared_expert_gate: bool = True  # Qwen2-MoE gates its shared expert (sigmoid); DeepSeek does not
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    first_k_dense_replace: int = 0  # DeepSeek: layers [0, k) are dense
    # Routing beyond softmax + top-k (DeepSeek): scores by "softmax" or "sigmoid"; "greedy" top-k,
    # "group_limited_greedy" (top-k within the topk_group best of n_group expert groups, a group
    # scored by its best expert) or "noaux_tc" (the same with sigmoid scores plus a learned
    # e_score_correction_bias for choosing, a group scored by its best two); the weights are then
    # multiplied by routed_scaling_factor.
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # Multi-head Latent Attention (DeepSeek-V2/V3), on when kv_lora_rank > 0: keys and values are
    # up-projected from a per-token latent (kv_lora_rank) plus one shared RoPE key
    # (qk_rope_head_dim), and those are what the KV cache holds. head_dim is then the q/k head
    # width (qk_nope_head_dim + qk_rope_head_dim); values are v_head_dim wide.
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None  # None: q projected directly (V2-Lite); else through a rank-r bottleneck
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # RoPE on (even, odd) pairs rather than on halves (DeepSeek)
    # DeepSeek-V3: multi-token-prediction layers stored after the last (pdserve.models.deepseek_mtp),
    # a drafter for speculative decoding; not part of the model's forward.
    num_nextn_predict_layers: int = 0
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str = "bfloat16"  # the checkpoint's dtype, informative only

    @property
    def is_mla(self) -> bool:
        """Multi-head Latent Attention: the KV cache holds latents, not keys and values."""
        return self.kv_lora_rank > 0

    @property
    def rotary_dim(self) -> int:
        """Width RoPE rotates: the head (MHA/GQA), or MLA's rope part of q and of the shared key."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` has routed experts (else a dense MLP), as transformers decides."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and layer_idx >= self.first_k_dense_replace
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    def kv_cache_entry(self) -> tuple[str, int, int, int]:
        """What the KV cache holds per token and layer: (kind, planes, heads, dim).

        ("kv", 2, kv_heads, head_dim): a K and a V plane. ("latent", 1, 1, kv_lora_rank +
        qk_rope_head_dim): MLA's one plane, the normalised latent c_kv followed by the roped shared
        key; no V. pdserve.forward.kv_cache.KVLayout is built from this."""
        if self.is_mla:
            return "latent", 1, 1, self.kv_lora_rank + self.qk_rope_head_dim
        return "kv", 2, self.num_kv_heads, self.head_dim

    def num_kv_bytes_per_token(self, dtype: "torch.dtype") -> int:
        """Bytes of KV cache one token occupies over all layers (K and V, or MLA's latent)."""
        _, planes, heads, dim = self.kv_cache_entry()
        return self.num_layers * planes * heads * dim * dtype.itemsize

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        """Parse a HF config.json, in the transformers 5 layout or the older one."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if len(archs) == 1 else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"config.json architectures {archs!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json hidden_act {cfg['hidden_act']!r} is not supported; allowed: 'silu'")
        if cfg.get("mlp_bias"):
            raise ValueError("config.json mlp_bias=true is not supported")

        hidden, heads = _need(cfg, "hidden_size"), _need(cfg, "num_attention_heads")
        max_pos = _need(cfg, "max_position_embeddings")
        # transformers' Qwen3 (dense) config defaults head_dim to 128; the others derive it.
        head_dim = cfg.get("head_dim") or (128 if arch == "Qwen3ForCausalLM" else hidden // heads)
        mla = _parse_mla(cfg, arch)
        if mla:  # DeepSeek configs set head_dim to the rope width; ours is the q/k head
            head_dim = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
        rope_theta, rope_scaling = _parse_rope(cfg, arch, max_pos)
        window = _sliding_window(cfg, arch)
        if window is not None and window < max_pos:
            # We attend to the whole context, so stay within the window where the two agree.
            max_pos = window

        bias = bool(cfg.get("attention_bias", False))
        if arch == "Qwen2ForCausalLM":
            qkv_bias, o_bias = True, False
        elif arch == "Qwen2MoeForCausalLM":
            qkv_bias, o_bias = bool(cfg.get("qkv_bias", True)), False
        elif arch == "MixtralForCausalLM":
            qkv_bias, o_bias = False, False
        elif arch in MLA_ARCHITECTURES:  # `attention_bias` is on q_a_proj, kv_a_proj_with_mqa and o_proj
            qkv_bias, o_bias = bias, bias
        else:
            qkv_bias, o_bias = bias, bias

        eos = cfg.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=_need(cfg, "vocab_size"),
            hidden_size=hidden,
            num_layers=_need(cfg, "num_hidden_layers"),
            num_heads=heads,
            # MLA: every head gets its own key and value, up-projected from the latent.
            num_kv_heads=heads if mla else cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            intermediate_size=_need(cfg, "intermediate_size"),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
            torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            **_parse_moe(cfg, arch),
            **mla,
        )


def _need(cfg: dict[str, Any], key: str) -> Any:
    if cfg.get(key) is None:
        raise ValueError(f"config.json has no {key!r}")
    return cfg[key]


def _parse_mla(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """The MLA fields of ModelArgs (DeepSeek-V2/V3, transformers' defaults); empty for other families."""
    if arch not in MLA_ARCHITECTURES:
        return {}
    v3 = arch == "DeepseekV3ForCausalLM"
    out = {"kv_lora_rank": cfg.get("kv_lora_rank") or 512,
           "q_lora_rank": cfg.get("q_lora_rank") if "q_lora_rank" in cfg else 1536,
           "qk_nope_head_dim": cfg.get("qk_nope_head_dim") or 128,
           "qk_rope_head_dim": cfg.get("qk_rope_head_dim") or 64,
           "v_head_dim": cfg.get("v_head_dim") or 128,
           # transformers' V2 rotates pairs (as complex numbers), always; V3 unless told otherwise.
           "rope_interleave": bool(cfg.get("rope_interleave", True)) if v3 else True}
    if v3:
        out["num_nextn_predict_layers"] = int(cfg.get("num_nextn_predict_layers") or 0)
    if out["qk_rope_head_dim"] % 2:
        raise ValueError(f"config.json qk_rope_head_dim {out['qk_rope_head_dim']} must be even")
    return out


def _parse_rope(cfg: dict[str, Any], arch: str, max_pos: int) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    default_theta = 1e6 if arch == "MixtralForCausalLM" else 1e4
    theta = float(params.pop("rope_theta", None) or cfg.get("rope_theta") or default_theta)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"config.json rope_scaling.rope_type {rope_type!r} is not supported; "
                         f"allowed: {', '.join(SUPPORTED_ROPE_TYPES)}")
    prf = params.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 1.0
    if prf != 1.0:
        raise ValueError(f"config.json partial_rotary_factor {prf} is not supported; allowed: 1.0")
    if rope_type == "default":
        return theta, None
    if rope_type in ("llama3", "yarn"):
        # transformers falls back to the (uncapped) max_position_embeddings, and so do we.
        params.setdefault("original_max_position_embeddings", max_pos)
    if rope_type == "yarn" and params.get("factor") is None:
        params["factor"] = max_pos / params["original_max_position_embeddings"]
    if rope_type in ("linear", "llama3") and params.get("factor") is None:
        raise ValueError(f"config.json rope_scaling of type {rope_type!r} needs a 'factor'")
    return theta, {"rope_type": rope_type, **params}


def _sliding_window(cfg: dict[str, Any], arch: str) -> int | None:
    """The attention window if any layer uses one (conservatively: when in doubt, assume it does)."""
    window = cfg.get("sliding_window")
    if not window or arch == "LlamaForCausalLM":
        return None
    if arch == "MixtralForCausalLM":
        return int(window)
    if not cfg.get("use_sliding_window", False):
        return None
    layer_types = cfg.get("layer_types")
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def _parse_moe(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """The MoE fields of ModelArgs; empty for dense families."""
    if arch == "MixtralForCausalLM":
        # Mixtral's experts are as wide as `intermediate_size`; it always renormalizes top-k.
        return {"num_experts": cfg.get("num_local_experts") or 8,
                "num_experts_per_tok": cfg.get("num_experts_per_tok") or 2,
                "moe_intermediate_size": _need(cfg, "intermediate_size"),
                "norm_topk_prob": True}
    if arch in MLA_ARCHITECTURES:
        return _parse_deepseek_moe(cfg, arch)
    if arch not in _MOE_DEFAULTS:
        return {}
    out = {k: cfg[k] if cfg.get(k) is not None else v for k, v in _MOE_DEFAULTS[arch].items()}
    if cfg.get("num_experts") is None and cfg.get("num_local_experts") is not None:
        out["num_experts"] = cfg["num_local_experts"]
    out["decoder_sparse_step"] = cfg.get("decoder_sparse_step") or 1
    out["mlp_only_layers"] = list(cfg.get("mlp_only_layers") or [])
    return out


_TOPK_METHODS = {"DeepseekV2ForCausalLM": ("greedy", "group_limited_greedy"), "DeepseekV3ForCausalLM": ("noaux_tc",)}


def _parse_deepseek_moe(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """DeepSeek's MoE: routed experts from layer first_k_dense_replace on, each with shared experts
    (ungated, n_shared_experts times moe_intermediate_size wide) and grouped top-k routing."""
    v3 = arch == "DeepseekV3ForCausalLM"
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    if method not in _TOPK_METHODS[arch]:
        raise ValueError(f"config.json topk_method {method!r} is not supported for {arch}; "
                         f"allowed: {', '.join(_TOPK_METHODS[arch])}")
    scoring = cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    if scoring != ("sigmoid" if v3 else "softmax"):
        raise ValueError(f"config.json scoring_func {scoring!r} is not supported for {arch}; "
                         f"allowed: {'sigmoid' if v3 else 'softmax'!r}")
    if (cfg.get("moe_layer_freq") or 1) != 1:
        raise ValueError(f"config.json moe_layer_freq {cfg['moe_layer_freq']} is not supported; allowed: 1")
    experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or (256 if v3 else 64)
    inter = cfg.get("moe_intermediate_size") or (2048 if v3 else 1407)
    grouped = method != "greedy"
    n_group = (cfg.get("n_group") or (8 if v3 else 1)) if grouped else 1
    topk_group = (cfg.get("topk_group") or (4 if v3 else n_group)) if grouped else 1
    if experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"config.json n_group {n_group} / topk_group {topk_group} do not fit "
                         f"{experts} routed experts (n_group must divide them, 1 <= topk_group <= n_group)")
    top_k = cfg.get("num_experts_per_tok") or (8 if v3 else 6)
    if top_k > experts // n_group * topk_group:
        raise ValueError(f"config.json num_experts_per_tok {top_k} exceeds the experts of "
                         f"topk_group {topk_group} groups of {experts // n_group}")
    first_dense = cfg.get("first_k_dense_replace")
    return {"num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": inter,
            # As DeepSeek's own code has it. (transformers 5's V2 ignores the flag and never
            # renormalises; every public V2 checkpoint has it false, where the two agree.)
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", v3)),
            "shared_expert_intermediate_size": inter * (cfg.get("n_shared_experts") or 0),
            "shared_expert_gate": False,
            "first_k_dense_replace": (3 if v3 else 0) if first_dense is None else first_dense,
            "scoring_func": scoring, "topk_method": method, "n_group": n_group, "topk_group": topk_group,
            "routed_scaling_factor": float(cfg.get("routed_scaling_factor") or (2.5 if v3 else 1.0))}


def resolve_model_args(path_or_preset: str) -> ModelArgs:
    """ModelArgs of a preset, or of a directory's config.json (eos ids merged from generation_config.json)."""
    if path_or_preset in PRESETS:
        return ModelArgs.from_hf_config(PRESETS[path_or_preset])
    model_dir = Path(path_or_preset)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model {path_or_preset!r} is neither a preset ({', '.join(PRESETS)}) "
                                f"nor a directory")
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: a model directory holds config.json and *.safetensors")
    try:
        args = ModelArgs.from_hf_config(json.loads(config_path.read_text()))
    except ValueError as e:
        raise ValueError(f"{config_path}: {e}") from e
    # Chat models often stop on more ids than config.json names (Qwen3: <|im_end|> and <|endoftext|>).
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        for t in [] if eos is None else [eos] if isinstance(eos, int) else eos:
            if t not in args.eos_token_ids:
                args.eos_token_ids.append(t)
    return args
