"""Backend selection (EngineConfig.attention_backend / moe_backend): 'auto' is torch on the CPU."""

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.ops.attention import TorchAttention
from pdserve.ops.backends import make_backends
from pdserve.ops.moe import TorchMoE
from pdserve.ops.norms import TorchNorms


def test_auto_and_torch_on_cpu():
    for choice in ("auto", "torch"):
        attn, moe, norms = make_backends(choice, choice, torch.device("cpu"))
        assert isinstance(attn, TorchAttention) and isinstance(moe, TorchMoE) and isinstance(norms, TorchNorms)


@pytest.mark.parametrize("which", ["attention", "moe"])
def test_triton_on_cpu_is_refused(which):
    choice = {"attention": ("triton", "auto"), "moe": ("auto", "triton")}[which]
    with pytest.raises(ValueError, match=f"{which}_backend='triton' needs a CUDA device"):
        make_backends(*choice, torch.device("cpu"))


def test_config_accepts_triton():
    assert EngineConfig(attention_backend="triton", moe_backend="triton").moe_backend == "triton"
    with pytest.raises(ValueError):
        EngineConfig(attention_backend="flash")
