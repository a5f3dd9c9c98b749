"""A preset's dummy weights written as an HF checkpoint directory (`pdserve write-checkpoint`), so
that loading is measured at full size without downloading anything.

The directory is what the Hub publishes: model-0000i-of-0000N.safetensors shards (the Hub's tensor
names: per-expert projections, `model.` prefixes), model.safetensors.index.json naming every
tensor's shard, config.json (the preset's HF config with its `model_type` and the written dtype),
and the byte-level tokenizer as HF tokenizer files (`tokenizer.byte_tokenizer_as_hf`).

The weights are exactly those `load_format: dummy` gives for the seed and dtype on the device they
are drawn on: each parameter is drawn by the same code (`loader.fill_dummy`), in the same order,
from the same generator. Memory stays at one parameter (a MoE layer's stacked experts at most):
every header is planned from the shapes before anything is drawn, then each parameter is drawn,
written to its shard and dropped.
"""

import json
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.models.args import ModelArgs
from pdserve.models.decoder import DecoderLM, WeightPlacer
from pdserve.models.layers import SparseMoE
from pdserve.models.loader import build_model, dummy_order, fill_dummy
from pdserve.models.presets import PRESETS
from pdserve.models.safetensors_format import header_bytes

# config.json's model_type per architecture: what transformers' Auto classes read.
MODEL_TYPES = {
    "Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe", "MixtralForCausalLM": "mixtral",
    "LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
    "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3",
}
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """Bytes of "5GB" (10**9, as the Hub's max_shard_size counts), "512MiB" (2**20), or a plain number."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if m is None or m[2].upper() not in _UNITS:
        raise ValueError(f"--shard-size {text!r}: expected a number with a unit, e.g. 5GB or 512MiB "
                         f"(units: {', '.join(u for u in _UNITS if u)})")
    size = int(float(m[1]) * _UNITS[m[2].upper()])
    if size <= 0:
        raise ValueError(f"--shard-size {text!r}: must be above 0 bytes")
    return size


@dataclass
class HubTensor:
    """One tensor of the checkpoint: its Hub name and how it is cut from the parameter drawn."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    cut: Callable[[torch.Tensor], torch.Tensor]  # the drawn parameter -> this tensor (a contiguous view)

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * _numel(self.shape)


@dataclass
class Shard:
    file: str
    tensors: list[HubTensor]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def hub_tensors(model: DecoderLM, module: torch.nn.Module, prefix: str, name: str, p: torch.Tensor) -> list[HubTensor]:
    """The Hub checkpoint's tensors for parameter `name` of `module` (at `prefix`): itself, or per
    expert its gate, up and down projections (the stacked w13 [E, 2I, H] and w2 [E, H, I])."""
    if isinstance(module, SparseMoE) and name in ("w13", "w2"):
        e, rows, cols = p.shape
        if name == "w2":
            return [HubTensor(model.hub_expert_name(prefix, i, "down_proj"), p.dtype, (rows, cols),
                              lambda t, i=i: t[i]) for i in range(e)]
        inter = rows // 2
        return [HubTensor(model.hub_expert_name(prefix, i, proj), p.dtype, (inter, cols),
                          lambda t, i=i, half=half: t[i, half * inter:(half + 1) * inter])
                for i in range(e) for half, proj in enumerate(("gate_proj", "up_proj"))]
    full = f"{prefix}.{name}" if prefix else name
    return [HubTensor(model.hub_name(full), p.dtype, tuple(p.shape), lambda t: t)]


def plan_shards(model: DecoderLM, shard_bytes: int) -> list[Shard]:
    """Shards in drawing order, each holding tensors up to `shard_bytes` (a larger tensor alone), as
    the Hub's max_shard_size does; checked to load back into every parameter of `model`."""
    prefixes = {id(m): n for n, m in model.named_modules()}
    shards: list[list[HubTensor]] = [[]]
    size = 0
    for module, name, p in dummy_order(model):
        for t in hub_tensors(model, module, prefixes[id(module)], name, p):
            if shards[-1] and size + t.nbytes > shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(t)
            size += t.nbytes
    placer = WeightPlacer(model)  # every name reads back into its place, and nothing is left unset
    for t in (t for s in shards for t in s):
        target = placer.place(t.name, t.shape)
        assert target is not None, f"{t.name} would not be read back"
        placer.done(target)
    placer.finish()
    n = len(shards)
    return [Shard(f"model-{i + 1:05d}-of-{n:05d}.safetensors", s) for i, s in enumerate(shards)]


def write_checkpoint(model: str, out_dir: Path, dtype: torch.dtype = torch.bfloat16, shard_bytes: int = 5 * 10**9,
                     seed: int = 0, device: str = "cpu", num_layers: int | None = None,
                     log: Callable[[str], None] | None = None) -> list[Path]:
    """Write dummy weights (seed, dtype, drawn on `device`) of `model` — a preset, or a config.json
    (or a directory holding one) — as an HF checkpoint in `out_dir` (created; it must not hold a
    checkpoint already), with `num_layers` layers where given. Returns the shard files."""
    config = checkpoint_config(model, num_layers)
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists() or any(out_dir.glob("*.safetensors")):
        raise ValueError(f"{out_dir} holds a checkpoint already; name a new or empty directory")
    args = ModelArgs.from_hf_config(config)
    meta = build_model(args, dtype)  # on the meta device: shapes and order only
    shards = plan_shards(meta, shard_bytes)
    total = sum(s.nbytes for s in shards)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "config.json", hf_config(config, dtype))
    from pdserve.tokenizer import byte_tokenizer_as_hf

    for name, content in byte_tokenizer_as_hf(args.vocab_size, args.max_position_embeddings).items():
        _write_json(out_dir / name, content)
    if log:
        log(f"writing {model} ({args.num_layers} layers, {str(dtype).removeprefix('torch.')}, seed {seed}, drawn on "
            f"{device}): {total / 1e9:.2f} GB in {len(shards)} shards to {out_dir}")
    origin = f"pdserve dummy weights of {model}, seed {seed}, drawn on {torch.device(device).type}"
    files = _write_shards(out_dir, meta, shards, _drawn(meta, torch.device(device), seed), origin, total, log)
    weight_map = {t.name: s.file for s in shards for t in s.tensors}
    _write_json(out_dir / "model.safetensors.index.json",
                {"metadata": {"total_size": total, "total_parameters": sum(p.numel() for p in meta.parameters())},
                 "weight_map": weight_map})
    return files


def checkpoint_config(model: str, num_layers: int | None = None) -> dict:
    """The HF config of a preset, or of a config.json (a file, or a directory holding one); with
    `num_layers`, cut to that many layers."""
    if model in PRESETS:
        config = dict(PRESETS[model])
    else:
        path = Path(model)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"{model!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json "
                                    f"(or a directory holding one)")
        config = json.loads(path.read_text())
    if num_layers is not None:
        if not 1 <= num_layers <= config["num_hidden_layers"]:
            raise ValueError(f"--num-layers {num_layers}: the model has {config['num_hidden_layers']} layers; "
                             f"from 1 to that many")
        config["num_hidden_layers"] = num_layers
        if "max_window_layers" in config:
            config["max_window_layers"] = min(config["max_window_layers"], num_layers)
    ModelArgs.from_hf_config(config)  # a config pdserve cannot serve fails here, before anything is written
    return config


def hf_config(config: dict, dtype: torch.dtype) -> dict:
    """The preset's config.json as the Hub has it, with its model_type and the dtype written."""
    out = {"model_type": MODEL_TYPES[config["architectures"][0]], **config}  # (a config's own model_type stays)
    out["torch_dtype" if "torch_dtype" in config else "dtype"] = str(dtype).removeprefix("torch.")
    return out


def _drawn(model: DecoderLM, device: torch.device, seed: int) -> Iterator[torch.Tensor]:
    """Each parameter's dummy values, in drawing order, on the host: one at a time."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for module, name, p in dummy_order(model):
        yield _draw(module, name, p, device, gen)  # (no local keeps it: the next is drawn after it is dropped)


def _draw(module: torch.nn.Module, name: str, p: torch.Tensor, device: torch.device,
          gen: torch.Generator) -> torch.Tensor:
    t = torch.empty(p.shape, dtype=p.dtype, device=device)
    fill_dummy(module, name, t, gen)
    return t.cpu()


def _write_shards(out_dir: Path, model: DecoderLM, shards: list[Shard], drawn: Iterator[torch.Tensor],
                  origin: str, total: int, log) -> list[Path]:
    # Tensors come parameter by parameter in drawing order, and the shards hold them in that order:
    # one parameter drawn at a time fills the shard being written, then the next.
    order = iter([(s, t) for s in shards for t in s.tensors])
    prefixes = {id(m): n for n, m in model.named_modules()}
    files: list[Path] = []
    f, current, done, t0 = None, None, 0, time.perf_counter()
    for (module, name, p), values in zip(dummy_order(model), drawn):
        for expected in hub_tensors(model, module, prefixes[id(module)], name, p):
            shard, t = next(order)
            assert t.name == expected.name, (t.name, expected.name)
            if shard is not current:
                if f is not None:
                    files.append(_close(f))
                    done += current.nbytes
                    _progress(log, current, done, total, t0)
                current = shard
                f = open(out_dir / shard.file, "wb")
                f.write(header_bytes([(x.name, x.dtype, x.shape) for x in shard.tensors],
                                     {"format": "pt", "origin": origin}))
            _write_tensor(f, t, t.cut(values))
        del values  # before the next parameter is drawn
    files.append(_close(f))
    _progress(log, current, done + current.nbytes, total, t0)
    return files


def _write_tensor(f, t: HubTensor, data: torch.Tensor) -> None:
    assert data.is_contiguous() and tuple(data.shape) == t.shape and data.dtype == t.dtype, t.name
    f.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))


def _close(f) -> Path:
    """Finish a shard: on disk (fsync), then out of the page cache, so that writing a checkpoint
    larger than memory leaves no pile of dirty pages and a later load reads from the disk."""
    f.flush()
    os.fsync(f.fileno())
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    f.close()
    return Path(f.name)


def _progress(log, shard: Shard, done: int, total: int, t0: float) -> None:
    if log:
        rate = done / max(time.perf_counter() - t0, 1e-9) / 1e9
        log(f"{shard.file}: {shard.nbytes / 1e9:.2f} GB written ({done / 1e9:.2f} of {total / 1e9:.2f} GB, "
            f"{rate:.2f} GB/s)")


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
