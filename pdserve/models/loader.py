"""From a preset name or a HF model directory to a model with weights on the target device.

`load_model` reads config.json into ModelArgs, builds the family's module on the meta device,
allocates it once in the dtype on the device, and streams the safetensors files into it
(weight_stream.py). Dummy weights (`load_format: dummy`, or a preset) are the real shapes drawn by
one seeded generator in parameter order, so every rank of a sharded model holds exactly its slice
of the single-rank model. `model_fingerprint` names the weights for the KV handshake; what the load
took is `model.load_stats` (LoadStats)."""

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

import torch
from torch import nn

from pdserve.models.args import SUPPORTED_ARCHITECTURES, ModelArgs, resolve_model_args
from pdserve.models.decoder import DecoderLM
from pdserve.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from pdserve.models.layers import RMSNorm, SparseMoE
from pdserve.models.llama import LlamaForCausalLM
from pdserve.models.mixtral import MixtralForCausalLM
from pdserve.models.presets import PRESETS
from pdserve.models.qwen2 import Qwen2ForCausalLM
from pdserve.models.qwen2_moe import Qwen2MoeForCausalLM
from pdserve.models.qwen3 import Qwen3ForCausalLM
from pdserve.models.qwen3_moe import Qwen3MoeForCausalLM
from pdserve.models.tensor_parallel import check_tp_size, slice_full
from pdserve.models.weight_stream import LoadStats, stream_safetensors

MODEL_CLASSES: dict[str, type[DecoderLM]] = {
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}
assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES)

LOAD_FORMATS = ("auto", "dummy")


def load_model(path_or_preset: str, dtype: torch.dtype, device: torch.device | str, load_format: str = "auto",
               attn_backend=None, moe_backend=None, seed: int = 0, ep=None, norms=None, tp=None,
               log: Callable[[str], None] | None = None, mtp: bool = False) -> tuple[DecoderLM, ModelArgs]:
    """Build the model on `device` in `dtype`; weights from *.safetensors ("auto") or random ("dummy").

    Presets are always dummy. The model is built on the meta device and allocated once, directly
    in `dtype` on `device`; checkpoint files are streamed into the parameters (weight_stream.py).
    With `ep` (an EPExchange) only this rank's experts are allocated and read; with `tp` (a
    TensorParallel of more than one rank) only this rank's slice of each sharded weight. What it
    took is `model.load_stats` (LoadStats), and `log` hears it. With `mtp` the checkpoint's
    multi-token-prediction layer is built and loaded too (`model.mtp`; ValueError where it has none).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not supported; allowed: {', '.join(LOAD_FORMATS)}")
    t0 = time.perf_counter()
    args = resolve_model_args(path_or_preset)
    dummy = load_format == "dummy" or path_or_preset in PRESETS
    files = [] if dummy else safetensors_files(Path(path_or_preset))  # fail before allocating
    device = torch.device(device)
    model = build_model(args, dtype, attn_backend, moe_backend, norms, ep, tp, mtp)
    model.to_empty(device=device)
    model.rotary_emb.build_cache()  # to_empty left the RoPE tables uninitialised
    t1 = time.perf_counter()
    if dummy:
        init_dummy_weights(model, seed)
        size = sum(p.numel() * p.element_size() for p in model.parameters())
    else:
        size = stream_safetensors(model, files)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the dummy draws were only queued: the time is the weights' own
    t2 = time.perf_counter()
    model.requires_grad_(False).eval()
    if getattr(attn_backend, "fuse_qkv", False):
        model.fuse_qkv()
    if getattr(moe_backend, "fold_shared_experts", False):
        model.fold_shared_experts()
        if device.type == "cuda":  # the unfolded tensors' memory back to the device: the KV cache is sized on it
            with torch.cuda.device(device):
                torch.cuda.empty_cache()
    model.load_stats = LoadStats("dummy" if dummy else "safetensors", len(files), size, t2 - t1,
                                 time.perf_counter() - t0)
    if log:
        log(model.load_stats.describe())
    return model, args


def build_model(args: ModelArgs, dtype: torch.dtype, attn_backend=None, moe_backend=None, norms=None,
                ep=None, tp=None, mtp: bool = False) -> DecoderLM:
    """The family's module for `args`, its parameters in `dtype` on the meta device (no memory yet):
    with `ep`, this rank's experts only; with `tp`, this rank's slice of each sharded weight; with
    `mtp`, the checkpoint's multi-token-prediction layer beside it (DeepSeek-V3)."""
    with torch.device("meta"), _default_dtype(dtype):
        model = MODEL_CLASSES[args.architecture](args, attn_backend, moe_backend, norms)
        if mtp:
            model.add_mtp()
    if ep is not None:
        model.shard_experts(ep)
    if tp is not None and tp.size > 1:
        if ep is not None:
            raise ValueError("tp_size > 1 and ep_size > 1 in one replica are not supported together")
        check_tp_size(args, tp.size)
        model.shard_tensor_parallel(tp)
    return model


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's *.safetensors files: those the sharded index names, else all in the directory."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        for n in names:
            _check_shard_name(index, n)
        files = [model_dir / n for n in names]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{index} names {f.name}, which is not in {model_dir}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no weights in {model_dir}: expected model.safetensors, or shards listed "
                                f"in model.safetensors.index.json (or use load_format='dummy')")
    return files


def _check_shard_name(index: Path, name: str) -> None:
    """A shard the index names lies in the model directory: a checkpoint from elsewhere (a hub, a
    bucket) must not make the loader read any other file (`../secret`, `/dev/zero`). The name is
    judged as written, not resolved: a hub's cache links its shards to blobs outside the directory."""
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or "\\" in name:
        raise ValueError(f"{index} names the shard {name!r}, outside the model directory {index.parent}: "
                         f"a shard must be a file in that directory (no '..', no absolute path)")


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights as HF initialises them: normal(0, 0.02), norms 1, biases 0; deterministic per seed.

    Drawn on the parameters' device, so the same seed gives the same weights on the same device type.
    An expert- or tensor-parallel rank draws each tensor it holds part of whole and keeps its part (its
    experts, its slice), so that its weights, and every tensor drawn after them, are exactly the
    single-rank model's.
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for module, name, p in dummy_order(model):
        whole = single_rank_shape(module, name, p)
        if whole == tuple(p.shape):
            fill_dummy(module, name, p, gen)
        else:
            full = p.new_empty(whole)
            fill_dummy(module, name, full, gen)
            p.copy_(rank_share(module, name, full))


def dummy_order(model: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Parameter]]:
    """(module, name, parameter) in the order dummy weights are drawn: one generator's stream runs
    through them in this order, so a tensor's values depend on its place in it."""
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            yield module, name, p


def fill_dummy(module: nn.Module, name: str, t: torch.Tensor, gen: torch.Generator) -> None:
    """Set `t` (module's parameter `name`, or a tensor of its shape, dtype and device) as dummy weights
    are: norms 1, biases 0, the rest normal(0, 0.02) drawn from `gen`."""
    if isinstance(module, RMSNorm):
        t.fill_(1.0)
    elif name == "bias":
        t.zero_()
    else:
        t.normal_(0.0, 0.02, generator=gen)


def _holds_some_experts(module: nn.Module, name: str) -> bool:
    return isinstance(module, SparseMoE) and name in ("w13", "w2") and len(module.experts) != module.num_experts


def single_rank_shape(module: nn.Module, name: str, p: torch.Tensor) -> tuple[int, ...]:
    """The shape module.<name> has in the single-rank model: every expert, every TP rank's slice."""
    shape = list(p.shape)
    if _holds_some_experts(module, name):
        shape[0] = module.num_experts
    if (shard := getattr(module, "tp_shards", {}).get(name)) is not None:
        shape[shard[0]] = shard[2]
    return tuple(shape)


def rank_share(module: nn.Module, name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of module.<name>'s single-rank tensor `full`: its experts, then its slice."""
    if _holds_some_experts(module, name):
        full = full[module.experts]
    return slice_full(full, getattr(module, "tp_shards", {}).get(name))


def model_fingerprint(path_or_preset: str, args: ModelArgs, dtype: torch.dtype,
                      load_format: str = "auto", seed: int = 0) -> str:
    """16 hex digits naming the weights: architecture, shapes, dtype and the checkpoint (or dummy seed).

    Engines that would compute the same KV for the same tokens get the same fingerprint.
    """
    h = hashlib.sha256()
    h.update(json.dumps(dataclasses.asdict(args), sort_keys=True).encode())
    h.update(str(dtype).encode())
    if load_format == "dummy" or path_or_preset in PRESETS:
        h.update(f"dummy seed={seed}".encode())
    else:
        model_dir = Path(path_or_preset)
        h.update((model_dir / "config.json").read_bytes())
        for f in safetensors_files(model_dir):
            h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # Parameters are created in `dtype` (on meta), so to_empty allocates them in it straight away.
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
