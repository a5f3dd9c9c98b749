"""The decoder-only transformer every family shares: layer loop, logits, checkpoint loading.

A family file subclasses `DecoderLM` and changes only what differs: which MLP a layer gets
(`make_mlp`), which attention (`make_attention`: Multi-head Latent Attention for DeepSeek) and how
its checkpoint names tensors (`checkpoint_name`). Attention differences within MHA/GQA (biases,
q/k norm) are flags in ModelArgs, read by `Attention`.
"""

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.forward.forward_batch import ForwardBatch
from pdserve.models.args import ModelArgs
from pdserve.models.layers import Attention, GatedMLP, RMSNorm, RotaryEmbedding, SparseMoE
from pdserve.models.tensor_parallel import TensorParallel, slice_full
from pdserve.ops.attention import TorchAttention
from pdserve.ops.moe import TorchMoE
from pdserve.ops.norms import TorchNorms

# Names after `checkpoint_name`. One tensor per expert (what checkpoints on the Hub hold) ...
_EXPERT = re.compile(r"((?:mtp\.mtp_block|layers\.\d+)\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
# ... or all experts fused, as transformers 5 holds them in memory.
_FUSED = re.compile(r"((?:mtp\.mtp_block|layers\.\d+)\.mlp)\.experts\.(gate_up_proj|down_proj)")


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)).

    The residual stream travels beside the block's output instead of being added at its end: the
    next norm adds it (one fused kernel on the GPU path, `norms.add_rms_norm`)."""

    def __init__(self, args: ModelArgs, attn: nn.Module, mlp: nn.Module, norms):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, norms)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, norms)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope, batch: ForwardBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) [T, hidden] -> (mlp output, residual); the layer's output is their sum.
        The first layer gets residual None: x is the embedding."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, rope, batch), residual)
        return self.mlp(h), residual


class DecoderLM(nn.Module):
    """A Llama-shaped causal LM over the paged KV cache; parameter names follow HF's, minus `model.`."""

    def __init__(self, args: ModelArgs, attn_backend=None, moe_backend=None, norms=None):
        super().__init__()
        self.args = args
        self.tp: TensorParallel | None = None  # set by shard_tensor_parallel
        self.attn_backend = attn_backend or TorchAttention()
        self.moe_backend = moe_backend or TorchMoE()
        self.norms = norms or TorchNorms()
        # Given its (uninitialised) weight, not drawn: the loader sets every parameter, and a normal_
        # draw on the meta device imports torch._dynamo, a cost on every worker's start.
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size,
                                         _weight=torch.empty(args.vocab_size, args.hidden_size))
        self.layers = nn.ModuleList(
            DecoderLayer(args, self.make_attention(i), self.make_mlp(i), self.norms) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, self.norms)
        # Tied: the embedding matrix is the head, and there is no second parameter to keep in sync.
        self.lm_head = (None if args.tie_word_embeddings
                        else nn.Linear(args.hidden_size, args.vocab_size, bias=False))
        self.rotary_emb = RotaryEmbedding(args.rotary_dim, args.max_position_embeddings,
                                          args.rope_theta, args.rope_scaling)
        # A drafting layer beside the model, where the family has one and the engine drafts with it
        # (DeepSeek-V3's MTP layer: add_mtp); its decoder layer is sharded and fused as the others.
        self.mtp: nn.Module | None = None

    def add_mtp(self) -> None:
        raise ValueError(f"speculative.method 'mtp' needs a checkpoint with a multi-token-prediction layer "
                         f"(DeepSeek-V3's); {self.args.architecture} has none: use method 'ngram'")

    def all_layers(self) -> list[DecoderLayer]:
        """The model's decoder layers, then the MTP layer's (where built)."""
        return list(self.layers) + ([self.mtp.mtp_block] if self.mtp is not None else [])

    def make_attention(self, layer_idx: int) -> nn.Module:
        """The attention of layer `layer_idx`: MHA/GQA over a K/V cache here; MLA families override."""
        return Attention(self.args, layer_idx, self.attn_backend, self.norms)

    def make_mlp(self, layer_idx: int) -> nn.Module:
        """The MLP of layer `layer_idx`: dense SwiGLU here; MoE families override."""
        return GatedMLP(self.args.hidden_size, self.args.intermediate_size)

    def moe_layers(self) -> list[SparseMoE]:
        return [layer.mlp for layer in self.all_layers() if isinstance(layer.mlp, SparseMoE)]

    def shard_experts(self, exchange) -> None:
        """Expert parallel: keep only this rank's experts (on the meta device, before allocation);
        the MoE layers exchange tokens with the ranks holding the others (an EPExchange)."""
        for moe in self.moe_layers():
            moe.hold_experts(exchange.placement.local_experts)
            moe.exchange = exchange

    def shard_tensor_parallel(self, tp: TensorParallel) -> None:
        """Tensor parallel: keep this rank's heads and intermediate width in every layer (on the
        meta device, before allocation); embedding, norms, routers and LM head stay whole."""
        self.tp = tp
        for layer in self.all_layers():
            layer.self_attn.shard_tp(tp)
            layer.mlp.shard_tp(tp)

    def tp_shard_map(self) -> dict[str, tuple[int, torch.Tensor, int]]:
        """Parameter name -> (dim, this rank's indices, whole length) for every sharded parameter."""
        return {f"{prefix}.{name}" if prefix else name: shard
                for prefix, module in self.named_modules() for name, shard in getattr(module, "tp_shards", {}).items()}

    def fuse_qkv(self) -> None:
        """Every attention layer's q/k/v projections as one GEMM (`Attention.fuse_qkv`)."""
        for layer in self.all_layers():
            layer.self_attn.fuse_qkv()

    def fold_shared_experts(self) -> None:
        """Every MoE layer's ungated shared experts into its routed experts' weights, where the
        family can (DeepseekMoE.fold_shared_experts); a no-op for the others."""
        for moe in self.moe_layers():
            if hasattr(moe, "fold_shared_experts"):
                moe.fold_shared_experts()

    @torch.inference_mode()
    def join_expert_exchanges(self) -> None:
        """Take part in every MoE layer's exchange with no tokens: an expert-parallel rank without
        requests in a step still serves its experts to the other ranks. Nothing else has work."""
        x = self.embed_tokens.weight.new_empty(0, self.args.hidden_size)
        for moe in self.moe_layers():
            # As wide as the other ranks' routing: the collectives' rows must agree.
            ids = torch.empty(0, moe.top_k + moe.num_shared_slots, dtype=torch.long, device=x.device)
            weights = torch.empty(ids.shape, dtype=torch.float32, device=x.device)
            moe.exchange.forward(x, moe.w13, moe.w2, weights, ids, moe.backend)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for the batch's flattened tokens."""
        x = self.embed_tokens(batch.input_ids)
        rope = self.rope_inputs(batch.positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, batch)
        return self.norm(x, residual)[0]

    def rope_inputs(self, positions: torch.Tensor, dtype: torch.dtype):
        """What every layer's attention reads for RoPE, computed once per forward (the norms
        backend's form: cos/sin tables for the reference, what its kernel takes on the GPU)."""
        return self.norms.rope_inputs(self.rotary_emb, positions, dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32."""
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, head).float()

    # -- checkpoint loading ----------------------------------------------------------------------

    def checkpoint_name(self, hf_name: str) -> str | None:
        """This model's name for a HF checkpoint tensor; None for tensors to skip."""
        name = hf_name.removeprefix("model.")
        if name.endswith("rotary_emb.inv_freq"):
            return None  # old checkpoints saved RoPE's buffer; we compute it
        if name == "lm_head.weight" and self.lm_head is None:
            return None  # tied: some checkpoints still carry a copy of the embedding
        return name

    def hub_name(self, name: str) -> str:
        """The name a Hub checkpoint gives our parameter `name` (not the fused experts: hub_expert_name)."""
        return name if name == "lm_head.weight" else f"model.{name}"

    def hub_expert_name(self, moe_prefix: str, expert: int, proj: str) -> str:
        """The Hub name of one expert's projection (`proj`: gate_proj, up_proj, down_proj)."""
        return f"model.{moe_prefix}.experts.{expert}.{proj}.weight"

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the parameters, one at a time; every parameter must be covered."""
        placer = WeightPlacer(self)
        for hf_name, tensor in weights:
            if (target := placer.place(hf_name, tuple(tensor.shape))) is not None:
                target.copy(tensor)
                placer.done(target)
        placer.finish()

    def _moe(self, prefix: str, hf_name: str) -> SparseMoE:
        try:
            moe = self.get_submodule(prefix)
        except AttributeError:
            moe = None
        if not isinstance(moe, SparseMoE):
            raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {self.args.architecture} "
                             f"({prefix} is not a MoE layer)")
        return moe


# A tensor-parallel shard of a parameter, as `tp_shards` records it: (dim, this rank's indices along
# it, the whole length).
Shard = tuple[int, torch.Tensor, int]


@dataclass
class Placement:
    """Where one checkpoint tensor goes: `dst`, which it fills exactly (after `prepare`, where set:
    a fused expert tensor transposed or cut to this rank's experts, a tensor-parallel rank's slice
    taken). `rows`, where set, are the tensor's rows [start, stop) that `prepare` keeps, as they
    stand: a reader may read only those (`rows_only`) and skip the other ranks' bytes."""

    hf_name: str
    dst: torch.Tensor
    pieces: list[str]  # what it sets (WeightPlacer.finish checks that every piece was set)
    prepare: Callable[[torch.Tensor], torch.Tensor] | None = None
    rows: tuple[int, int] | None = None

    @property
    def verbatim(self) -> bool:
        """The file's bytes are the destination's: they can be read straight into it."""
        return self.prepare is None and self.dst.is_contiguous()

    def rows_only(self) -> "Placement":
        """This placement for a tensor of `rows` alone (what a reader that read only them holds)."""
        return Placement(self.hf_name, self.dst, self.pieces)

    def copy(self, tensor: torch.Tensor) -> None:
        _copy(self.dst, tensor if self.prepare is None else self.prepare(tensor), self.hf_name)


class WeightPlacer:
    """Checkpoint tensors to parameters, by name and shape, before their bytes are read; then
    whether every parameter was set. One per load.

    Checkpoints hold the single-rank model's tensors: an expert-parallel rank skips the other ranks'
    experts, a tensor-parallel rank keeps its slice of each sharded tensor (`tp_shards`)."""

    def __init__(self, model: DecoderLM):
        self.model = model
        self.params = dict(model.named_parameters())
        self.shards = model.tp_shard_map()
        self.loaded: set[str] = set()  # parameter names, or `name[expert].part` for fused experts
        self._row_ranges: dict[tuple[int, int], tuple[int, int] | None] = {}  # (dim, id(index)): every expert shares one

    def place(self, hf_name: str, shape: tuple[int, ...]) -> Placement | None:
        """Where the tensor `hf_name` of `shape` goes; None for one to skip (not used, or another
        expert-parallel rank's expert). Raises ValueError for a tensor with no place or the wrong shape."""
        name = self.model.checkpoint_name(hf_name)
        if name is None:
            return None
        if m := _EXPERT.fullmatch(name):
            return self._expert(m[1], int(m[2]), m[3], shape, hf_name)
        if m := _FUSED.fullmatch(name):
            return self._fused_experts(m[1], m[2], shape, hf_name)
        if name in self.params:
            p = self.params[name]
            return self._sharded(Placement(hf_name, p, _pieces(name, p)), self.shards.get(name), shape)
        raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {self.model.args.architecture}")

    def done(self, target: Placement) -> None:
        self.loaded.update(target.pieces)

    def finish(self) -> None:
        """Raise if a parameter (or a fused parameter's expert part) was not set."""
        expected = {piece for name, p in self.params.items() for piece in _pieces(name, p)}
        missing = sorted(expected - self.loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise ValueError(f"checkpoint does not set {len(missing)} parameter(s): {shown}")

    def _expert(self, prefix: str, expert: int, proj: str, shape: tuple[int, ...], hf_name: str) -> Placement | None:
        moe = self.model._moe(prefix, hf_name)
        if not 0 <= expert < moe.num_experts:
            raise ValueError(f"checkpoint tensor {hf_name!r}: expert {expert} out of range "
                             f"(the model has {moe.num_experts})")
        if expert not in moe.experts:
            return None  # another rank's expert (expert parallel): not even read
        slot = moe.experts.index(expert)
        inter = moe.w2.shape[2]  # this rank's share of the intermediate width (all of it without TP)
        # Tensor parallel: every expert keeps the same share of its intermediate width (w2's shard),
        # the rows of gate_proj and up_proj [I, H], the columns of down_proj [H, I].
        shard = getattr(moe, "tp_shards", {}).get("w2")
        if proj == "down_proj":
            target = Placement(hf_name, moe.w2[slot], [f"{prefix}.w2[{slot}].down"])
            return self._sharded(target, None if shard is None else (1, shard[1], shard[2]), shape)
        rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
        target = Placement(hf_name, moe.w13[slot, rows], [f"{prefix}.w13[{slot}].{proj.removesuffix('_proj')}"])
        return self._sharded(target, None if shard is None else (0, shard[1], shard[2]), shape)

    def _fused_experts(self, prefix: str, proj: str, shape: tuple[int, ...], hf_name: str) -> Placement:
        # transformers 5 stores gate_up_proj [E, 2I, H] (gate rows, then up rows) and down_proj
        # [E, H, I], i.e. our layout; some converters write the transpose. A square tensor is
        # ambiguous and read in transformers' orientation.
        moe = self.model._moe(prefix, hf_name)
        param = "w13" if proj == "gate_up_proj" else "w2"
        dst = getattr(moe, param)
        shard = getattr(moe, "tp_shards", {}).get(param)  # the file holds every rank's share
        expected = _whole(dst.shape, shard)  # this rank's experts, every TP rank's share of each
        full = (moe.num_experts, *expected[1:])
        transpose = shape != full and len(shape) == 3 and (shape[0], shape[2], shape[1]) == full
        shape = full if transpose else shape
        # Expert parallel: this rank's experts (the file is read whole).
        experts = list(moe.experts) if shape == full and len(moe.experts) != moe.num_experts else None
        if experts is not None:
            shape = (len(experts), *full[1:])
        prepare = None
        if transpose or experts is not None or shard is not None:
            prepare = partial(_fused_view, transpose, experts, shard)
        return _checked(Placement(hf_name, dst, _pieces(f"{prefix}.{param}", dst), prepare), shape, expected)

    def _sharded(self, target: Placement, shard: Shard | None, shape: tuple[int, ...]) -> Placement:
        """`target` for a checkpoint tensor of `shape` that holds every TP rank's share of `shard`'s
        dimension (the single-rank model's tensor): this rank's share taken, read alone where it is
        a run of whole rows."""
        if shard is not None:
            target.prepare = partial(slice_full, shard=shard)
            key = (shard[0], id(shard[1]))  # (the index lives in the model's tp_shards: the id holds)
            if key not in self._row_ranges:
                self._row_ranges[key] = _row_range(shard)
            target.rows = self._row_ranges[key]
        return _checked(target, shape, _whole(target.dst.shape, shard))


def _fused_view(transpose: bool, experts: list[int] | None, shard: Shard | None, t: torch.Tensor) -> torch.Tensor:
    t = t.transpose(1, 2) if transpose else t
    t = t if experts is None else t[experts]
    return slice_full(t, shard)


def _whole(shape: torch.Size | tuple[int, ...], shard: Shard | None) -> tuple[int, ...]:
    """The single-rank shape of a tensor whose local shape is `shape`."""
    whole = list(shape)
    if shard is not None:
        whole[shard[0]] = shard[2]
    return tuple(whole)


def _row_range(shard: Shard) -> tuple[int, int] | None:
    """[start, stop) where the shard is a run of rows (dim 0, consecutive indices), else None."""
    dim, index, _ = shard
    if dim != 0 or len(index) == 0:
        return None
    start, stop = int(index[0]), int(index[-1]) + 1
    return (start, stop) if stop - start == len(index) and bool((index.diff() == 1).all()) else None


def _checked(target: Placement, shape: tuple[int, ...], expected: tuple[int, ...]) -> Placement:
    """`target`, if the checkpoint's `shape` is the `expected` one (the single-rank model's)."""
    if tuple(expected) != tuple(shape):
        raise ValueError(f"checkpoint tensor {target.hf_name!r} has shape {tuple(shape)}, "
                         f"the model expects {tuple(expected)}")
    return target


def _pieces(name: str, param: torch.Tensor) -> list[str]:
    """What must be loaded to set a parameter: itself, or each expert's part of a fused one."""
    if name.endswith(".w13"):
        return [f"{name}[{e}].{part}" for e in range(param.shape[0]) for part in ("gate", "up")]
    if name.endswith(".w2"):
        return [f"{name}[{e}].down" for e in range(param.shape[0])]
    return [name]


def _copy(dst: torch.Tensor, src: torch.Tensor, hf_name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor {hf_name!r} has shape {tuple(src.shape)}, "
                         f"the model expects {tuple(dst.shape)}")
    dst.copy_(src)
