"""Named model shapes that need no files: loaded with random (dummy) weights.

Written as HF config.json dicts and parsed like a checkpoint's, so a preset is exactly the model
whose config it copies.
"""

from typing import Any

# CPU-sized Qwen3-MoE for tests and development. Ids 0..255 are bytes, 256+ special tokens
# (bos 256, eos 257), for the byte-level tokenizer presets use.
_TINY_MOE: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
    "intermediate_size": 512, "moe_intermediate_size": 256,
    "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [],
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False, "attention_bias": False,
    "bos_token_id": 256, "eos_token_id": 257, "dtype": "float32",
}

# Qwen/Qwen3-30B-A3B's config.json (pre-transformers-5 layout), eos ids from its generation_config.json.
_QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [],
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "rope_scaling": None,
    "use_sliding_window": False, "sliding_window": None, "max_window_layers": 48,
    "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
    "bos_token_id": 151643, "eos_token_id": [151645, 151643], "torch_dtype": "bfloat16",
}

# deepseek-ai/DeepSeek-V2-Lite's config.json (its own, pre-transformers-5 layout): Multi-head Latent
# Attention (no q_lora_rank; a 512 + 64 latent cached per token and layer), one dense layer, then
# 64 routed experts (top-6, greedy) beside 2 shared ones; YaRN to 160k positions.
_DEEPSEEK_V2_LITE: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "vocab_size": 102400, "hidden_size": 2048, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 10944,
    "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "moe_intermediate_size": 1408,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
    "scoring_func": "softmax", "norm_topk_prob": False, "routed_scaling_factor": 1.0,
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
    "bos_token_id": 100000, "eos_token_id": 100001, "torch_dtype": "bfloat16",
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-moe": _TINY_MOE,
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    "deepseek-v2-lite": _DEEPSEEK_V2_LITE,
}
