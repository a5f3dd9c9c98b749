"""Configuration, validated on load: a wrong key or value fails naming the key and what is allowed."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Strict):
    path: str = "tiny-moe"  # a preset name or a directory with config.json + *.safetensors
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    load_format: Literal["auto", "dummy"] = "auto"
    seed: int = 0  # for dummy weights
    max_model_len: int | None = Field(default=None, ge=1)  # default: the model's context length


class EngineConfig(_Strict):
    """One engine core; `role` selects what it does with a request."""

    model: ModelConfig = ModelConfig()
    role: Literal["colocated", "prefill", "decode"] = "colocated"
    device: str = "cpu"
    block_size: int = Field(default=16, ge=1)
    num_kv_blocks: int | None = Field(default=None, ge=1)  # default: from kv_cache_gb
    kv_cache_gb: float | None = Field(default=None, gt=0)  # default: 1 on CPU, 90 % of free memory on GPU
    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int = Field(default=8192, ge=1)  # token budget of one step
    chunk_size: int = Field(default=2048, ge=1)  # most prompt tokens of one request in one step
    enable_prefix_cache: bool = True
    attention_backend: Literal["auto", "torch"] = "auto"
    moe_backend: Literal["auto", "torch"] = "auto"

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v != "cpu" and not v.startswith("cuda"):
            raise ValueError(f"must be 'cpu' or 'cuda[:N]', got {v!r}")
        return v
