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
)
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
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: 0 means no shared expert
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str = "bfloat16"  # the checkpoint's dtype, informative only

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` has routed experts (else a dense MLP), as transformers decides."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    def num_kv_bytes_per_token(self, dtype: "torch.dtype") -> int:
        """Bytes of K and V one token occupies over all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype.itemsize

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
        else:
            qkv_bias, o_bias = bias, bias

        eos = cfg.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=_need(cfg, "vocab_size"),
            hidden_size=hidden,
            num_layers=_need(cfg, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
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
        )


def _need(cfg: dict[str, Any], key: str) -> Any:
    if cfg.get(key) is None:
        raise ValueError(f"config.json has no {key!r}")
    return cfg[key]


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
    if arch not in _MOE_DEFAULTS:
        return {}
    out = {k: cfg[k] if cfg.get(k) is not None else v for k, v in _MOE_DEFAULTS[arch].items()}
    if cfg.get("num_experts") is None and cfg.get("num_local_experts") is not None:
        out["num_experts"] = cfg["num_local_experts"]
    out["decoder_sparse_step"] = cfg.get("decoder_sparse_step") or 1
    out["mlp_only_layers"] = list(cfg.get("mlp_only_layers") or [])
    return out


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
