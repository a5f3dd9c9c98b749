"""`decode.speculative` / `colocated.speculative` (EngineConfig.speculative): speculative decoding's
settings, validated on load like the rest of the configuration (pdserve/config.py)."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError


class SpeculativeConfig(BaseModel):
    """Speculative decoding (vLLM's speculative_config): each decoding sequence's next tokens are
    guessed and the guesses checked in the same target step; the output is unchanged (greedy: the
    same tokens; sampled: the same distribution, by rejection sampling). Off by default."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # ngram: prompt lookup (vLLM's "ngram"): the tokens that followed the latest earlier occurrence
    # of the sequence's last n tokens, n from prompt_lookup_max down to prompt_lookup_min.
    # mtp: DeepSeek-V3's multi-token-prediction layer (vLLM's "deepseek_mtp"), where the checkpoint
    # has one (config.json num_nextn_predict_layers): one draft a step, from the target's own
    # hidden state (pdserve/models/deepseek_mtp.py).
    method: Literal["ngram", "mtp"] | None = None
    num_tokens: int = Field(default=4, ge=1, le=16)  # draft tokens per sequence per step (vLLM's num_speculative_tokens)
    prompt_lookup_max: int = Field(default=4, ge=1)
    prompt_lookup_min: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _lookup_range(self) -> "SpeculativeConfig":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise PydanticCustomError(
                "lookup_range", "prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})",
                {"lo": self.prompt_lookup_min, "hi": self.prompt_lookup_max})
        if self.method == "mtp" and "num_tokens" in self.model_fields_set and self.num_tokens != 1:
            raise PydanticCustomError(
                "mtp_tokens", "num_tokens {n} with method 'mtp': its one layer drafts one token a step "
                              "(not run again on its own output); leave num_tokens out or set it to 1",
                {"n": self.num_tokens})
        return self

    @property
    def draft_tokens(self) -> int:
        """The most draft tokens of a sequence's step."""
        return 1 if self.method == "mtp" else self.num_tokens

    @property
    def mtp(self) -> bool:
        return self.method == "mtp"
