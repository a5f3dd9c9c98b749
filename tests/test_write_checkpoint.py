"""`pdserve write-checkpoint` and the streaming loader: a written checkpoint is the dummy model of the
same seed (pdserve reads it back exactly; transformers, the oracle, computes the same logits), its
files are what the Hub publishes (safetensors, the index, config.json, tokenizer), and both of the
loader's readers put every byte where it belongs."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hf_checkpoints import _COMMON, FAMILIES
from pdserve.cli import main as cli
from pdserve.models import resolve_model_args
from pdserve.models.checkpoint_writer import parse_size, write_checkpoint
from pdserve.models.layers import SparseMoE
from pdserve.models.loader import build_model, init_dummy_weights, load_model, safetensors_files
from pdserve.models.tensor_parallel import TensorParallel
from pdserve.models import weight_stream
from pdserve.models.weight_stream import ChunkedReader, HostReader, stream_safetensors
from pdserve.tokenizer import ByteTokenizer, load_tokenizer
from test_models import assert_close, make_batch, new_cache, run

SHARD = 3 * 10**6  # tiny-moe in float32 is 28.9 MB: ten shards and a short one


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """tiny-moe, float32, seed 3, through the command as a user runs it."""
    out = tmp_path_factory.mktemp("ck") / "tiny-moe"
    assert cli(["write-checkpoint", "tiny-moe", str(out), "--dtype", "float32", "--shard-size", "3MB",
                "--seed", "3"]) == 0
    return out


def params(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_written_checkpoint_is_the_dummy_model(written, tmp_path, dtype):
    dummy, dummy_args = load_model("tiny-moe", dtype, "cpu", seed=3)
    if dtype == torch.float32:
        path = written
    else:  # drawn in bfloat16, as dummy loading draws it: not float32 rounded
        path = tmp_path / "bf16"
        write_checkpoint("tiny-moe", path, torch.bfloat16, SHARD, seed=3)
    model, args = load_model(str(path), dtype, "cpu")
    assert model.load_stats.source == "safetensors" and model.load_stats.files == len(safetensors_files(path))
    ours, ref = params(model), params(dummy)
    assert ours.keys() == ref.keys()
    assert all(torch.equal(ours[n], ref[n]) for n in ref)
    # The same model: only the eos ids differ (generation_config.json adds <|im_end|>, as the byte
    # tokenizer stops on it) and the dtype written.
    a, b = dataclasses.asdict(args), dataclasses.asdict(dummy_args)
    assert a.pop("eos_token_ids") == b.pop("eos_token_ids") + [259]
    assert a.pop("torch_dtype") == str(dtype).removeprefix("torch.")
    b.pop("torch_dtype")
    assert a == b
    if dtype == torch.float32:
        batch = [([256, 72, 105, 33], 0)]
        assert torch.equal(run(model, make_batch(batch, new_cache(args))), run(dummy, make_batch(batch, new_cache(args))))
    other, _ = load_model("tiny-moe", dtype, "cpu", seed=4)
    assert not torch.equal(params(other)["layers.0.mlp.w13"], ours["layers.0.mlp.w13"])


def test_index_names_every_shard_and_shards_respect_the_size(written):
    index = json.loads((written / "model.safetensors.index.json").read_text())
    shards = sorted(written.glob("*.safetensors"))
    assert len(shards) == 11 and sorted(set(index["weight_map"].values())) == [f.name for f in shards]
    assert all(f.name == f"model-{i + 1:05d}-of-00011.safetensors" for i, f in enumerate(shards))
    total = 0
    for f in shards:
        with safe_open(f, "pt") as st:  # the safetensors library reads every file
            names = list(st.keys())
            sizes = [st.get_slice(n).get_shape() for n in names]
            assert st.metadata()["format"] == "pt"
        assert all(index["weight_map"][n] == f.name for n in names)
        nbytes = sum(4 * torch.Size(s).numel() for s in sizes)
        assert nbytes <= SHARD or len(names) == 1, (f.name, nbytes)
        total += nbytes
    assert total == index["metadata"]["total_size"] == 28878848
    # Hub names: one tensor per expert and projection, `model.` before all but the head.
    assert "model.layers.3.mlp.experts.7.down_proj.weight" in index["weight_map"]
    assert "lm_head.weight" in index["weight_map"] and not any(".w13" in n for n in index["weight_map"])


def test_transformers_reads_the_checkpoint(written):
    """HF is the oracle: its model from the written files computes our logits; its tokenizer
    encodes as the byte tokenizer does."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(written, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    model, args = load_model(str(written), torch.float32, "cpu")
    prompt = ByteTokenizer().encode("Hello, world")
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    assert_close(run(model, make_batch([(prompt, 0)], new_cache(args))), ref)
    hf_tok = transformers.AutoTokenizer.from_pretrained(written)
    for text in ["Hello, world", "ünï 漢字 🎉\t\n", "<|im_start|>user\nhi<|im_end|>"]:
        assert hf_tok(text)["input_ids"] == ByteTokenizer().encode(text)


def test_tokenizer_files_load_as_the_byte_tokenizer(written):
    tok, byte = load_tokenizer(str(written), resolve_model_args(str(written)).eos_token_ids), ByteTokenizer()
    assert (tok.bos_token_id, tok.eos_token_ids) == (byte.bos_token_id, byte.eos_token_ids)
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat) == byte.apply_chat_template(chat)
    for text in ["plain text", "<|bos|>x<|eos|>", "naïve café", "<|token_300|>"]:
        ids = byte.encode(text)
        assert tok.encode(text) == ids and tok.decode(ids) == byte.decode(ids)
    assert tok.decode([300, 65, 511]) == byte.decode([300, 65, 511]) == "<|token_300|>A<|token_511|>"


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3", "mixtral"])
def test_other_families_hub_names(family, tmp_path):
    """Families whose Hub names differ from ours (DeepSeek's shared_experts and routing bias,
    Mixtral's block_sparse_moe and w1/w3/w2): written from a config.json, read by transformers."""
    config_cls, model_cls, kwargs, _ = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**_COMMON, **kwargs}, architectures=[model_cls]).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "ck"
    write_checkpoint(str(tmp_path / "config.json"), out, torch.float32, 10**5, seed=1)
    model, args = load_model(str(out), torch.float32, "cpu")
    dummy, _ = load_model(str(tmp_path), torch.float32, "cpu", load_format="dummy", seed=1)
    assert all(torch.equal(p, params(dummy)[n]) for n, p in params(model).items())
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    if family == "deepseek_v3":  # the routing bias was drawn, not zero: transformers reads it too
        bias = hf.model.layers[1].mlp.gate.e_score_correction_bias
        assert torch.equal(bias, params(model)["layers.1.mlp.e_score_correction_bias"]) and bias.abs().sum() > 0
    prompt = [1, 5, 9, 33, 2, 7]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    assert_close(run(model, make_batch([(prompt, 0)], new_cache(args))), ref)


@pytest.mark.parametrize("chunk, batch, gap", [(4093, 100_003, 1), (2**20, 64 * 2**20, 2**20)],
                         ids=["small-pieces", "defaults"])
@pytest.mark.parametrize("experts", [None, [1, 6]], ids=["all-experts", "two-experts"])
def test_both_readers_put_every_byte_in_place(written, monkeypatch, chunk, batch, gap, experts):
    """Both readers (the GPU's logic run on CPU): chunks and scatter reads of any size (tensors
    split across chunks), a rank's experts only (the others skipped, or read through where the gap
    is short), conversion to another dtype."""
    monkeypatch.setattr(weight_stream, "BATCH_BYTES", batch)
    monkeypatch.setattr(weight_stream, "GAP_BYTES", gap)
    args = resolve_model_args(str(written))
    files = safetensors_files(written)
    full, _ = load_model(str(written), torch.float32, "cpu")
    for dtype in (torch.float32, torch.bfloat16):
        loaded = []
        # the GPU reader with one thread, and with three over the files at once (buffers shared)
        for reader in (HostReader(), ChunkedReader(torch.device("cpu"), chunk, 2, readers=1),
                       ChunkedReader(torch.device("cpu"), chunk, 2, readers=3)):
            model = build_model(args, dtype)
            if experts:
                for moe in model.moe_layers():
                    moe.hold_experts(experts)
            model.to_empty(device="cpu")
            stream_safetensors(model, files, reader)
            loaded.append(params(model))
        for name, p in params(full).items():
            want = p[experts] if experts and name.endswith((".w13", ".w2")) else p
            assert all(torch.equal(got[name], want.to(dtype)) for got in loaded), name


def rank_model(args, dtype: torch.dtype, rank: int, experts: list[int] | None):
    """Tensor-parallel rank `rank` of 2, holding `experts` only where given (expert parallel too:
    load_model refuses both in one replica, the placement of each is still checked together)."""
    model = build_model(args, dtype, tp=TensorParallel(rank, 2))
    if experts:
        for moe in model.moe_layers():
            moe.hold_experts(experts)
    model.to_empty(device="cpu")
    model.rotary_emb.build_cache()
    return model


def rank_slices(full: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """What each parameter of the rank `model` must hold: its experts' and its indices' part of the
    single-rank model's tensor (tensor_parallel.py's contract)."""
    shards, out = model.tp_shard_map(), {}
    for prefix, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            key = f"{prefix}.{name}" if prefix else name
            t = full[key]
            if isinstance(module, SparseMoE) and name in ("w13", "w2") and len(module.experts) != module.num_experts:
                t = t[module.experts]
            if key in shards:
                dim, index, _ = shards[key]
                t = t.index_select(dim, index)
            out[key] = t
    assert len(shards) > 0 and out.keys() == params(model).keys()
    return out


def fused_checkpoint(written: Path, out: Path) -> list[Path]:
    """The written model with every MoE layer's experts fused as transformers 5 names them, gate_up_proj
    transposed ([E, H, 2I], as some converters write it; down_proj is square here, which reads in
    transformers' orientation): one file."""
    full, _ = load_model(str(written), torch.float32, "cpu")
    tensors = {}
    for name, p in params(full).items():
        if name.endswith(".w13"):
            tensors[f"model.{name.removesuffix('.w13')}.experts.gate_up_proj"] = p.transpose(1, 2).contiguous()
        elif name.endswith(".w2"):
            tensors[f"model.{name.removesuffix('.w2')}.experts.down_proj"] = p
        else:
            tensors[full.hub_name(name)] = p
    out.mkdir()
    save_file(tensors, out / "model.safetensors")
    return [out / "model.safetensors"]


@pytest.mark.parametrize("experts", [None, [1, 6]], ids=["all-experts", "two-experts"])
def test_tensor_parallel_ranks_read_their_slices(written, tmp_path, monkeypatch, experts):
    """Each TP rank of 2 reads its slice of every sharded tensor, exactly the single-rank model's:
    both readers (small chunks and scatter reads, no gap read through, so only this rank's rows of
    a column-parallel tensor are read), another dtype, expert parallel at once; per-expert tensors
    (the written checkpoint) and fused ones in either orientation (read whole, sliced)."""
    monkeypatch.setattr(weight_stream, "BATCH_BYTES", 100_003)
    monkeypatch.setattr(weight_stream, "GAP_BYTES", 1)
    args = resolve_model_args(str(written))
    full = params(load_model(str(written), torch.float32, "cpu")[0])
    whole = json.loads((written / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    sources = {"per-expert": safetensors_files(written), "fused": fused_checkpoint(written, tmp_path / "fused")}
    for source, files in sources.items():
        for rank in (0, 1):
            for dtype, reader in ((torch.float32, HostReader()), (torch.bfloat16, ChunkedReader(torch.device("cpu"), 4093, 2))):
                model = rank_model(args, dtype, rank, experts)
                read = stream_safetensors(model, files, reader)
                want = rank_slices(full, model)
                for name, p in params(model).items():
                    assert torch.equal(p, want[name].to(dtype)), (source, rank, str(dtype), name)
                if source == "per-expert":  # the other rank's rows of q/k/v, gate and up are skipped
                    assert read < (whole if experts is None else 0.6 * whole), (read, whole)
            # Tensors handed over whole (load_weights: HF's in-memory state dicts) are sliced alike.
            model = rank_model(args, torch.float32, rank, experts)
            model.load_weights((n, t) for f in files for n, t in load_file(f).items())
            want = rank_slices(full, model)
            assert all(torch.equal(p, want[n]) for n, p in params(model).items()), (source, rank)


@pytest.mark.parametrize("experts", [None, [1, 6]], ids=["all-experts", "two-experts"])
def test_tensor_parallel_ranks_draw_their_slice_of_the_dummy_weights(experts):
    """A TP rank's dummy weights are its slice of the single-rank model's (drawn whole, sliced), with
    expert parallel at once too: so a TP replica on dummy weights computes what one rank does, and
    a written checkpoint (the single-rank dummy model) reads into every rank as its dummy weights."""
    args = resolve_model_args("tiny-moe")
    full = params(load_model("tiny-moe", torch.float32, "cpu", seed=3)[0])
    for rank in (0, 1):
        model = rank_model(args, torch.float32, rank, experts)
        init_dummy_weights(model, 3)
        want = rank_slices(full, model)
        assert all(torch.equal(p, want[n]) for n, p in params(model).items()), rank


def test_broken_files_are_named(written, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in written.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    last = sorted(broken.glob("*.safetensors"))[-1]
    last.write_bytes(last.read_bytes()[:-100])
    with pytest.raises(ValueError, match=f"{last.name}.*claims bytes"):
        load_model(str(broken), torch.float32, "cpu")
    last.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{nope")
    with pytest.raises(ValueError, match=f"{last.name}: not a safetensors file"):
        load_model(str(broken), torch.float32, "cpu")
    # the GPU reader's threads: the one that meets the broken file stops the load, nothing hangs
    model = build_model(resolve_model_args(str(written)), torch.float32)
    model.to_empty(device="cpu")
    with pytest.raises(ValueError, match=f"{last.name}: not a safetensors file"):
        stream_safetensors(model, safetensors_files(broken), ChunkedReader(torch.device("cpu"), 4093, 2, readers=3))


def test_bad_arguments(tmp_path, written, capsys):
    assert parse_size("5GB") == 5 * 10**9 and parse_size("512MiB") == 512 * 2**20 and parse_size("1000") == 1000
    for size in ["5 parsecs", "0GB", "GB"]:
        with pytest.raises(ValueError, match="--shard-size"):
            parse_size(size)
    assert cli(["write-checkpoint", "tiny-moe", str(written)]) == 2
    assert "holds a checkpoint already" in capsys.readouterr().err
    assert cli(["write-checkpoint", "no-such-model", str(tmp_path / "x")]) == 2
    assert "neither a preset" in capsys.readouterr().err
    assert cli(["write-checkpoint", "tiny-moe", str(tmp_path / "y"), "--num-layers", "9"]) == 2
    assert "--num-layers 9: the model has 4 layers" in capsys.readouterr().err
