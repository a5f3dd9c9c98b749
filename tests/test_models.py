"""Model families against transformers (same weights), the loader, presets and ModelArgs parsing."""

import json

import pytest
import torch
import transformers

from hf_checkpoints import FAMILIES, LLAMA3_ROPE, build_checkpoint, write_old_layout
from pdserve.forward.forward_batch import ForwardBatch
from pdserve.forward.kv_cache import KVLayout, allocate_kv_cache
from pdserve.models import PRESETS, SUPPORTED_ARCHITECTURES, ModelArgs, resolve_model_args
from pdserve.models.loader import MODEL_CLASSES, load_model, model_fingerprint
from pdserve.models.decoder import WeightPlacer
from pdserve.models.layers import RotaryEmbedding

BLOCK = 16
PROMPT_LENS = [5, 21, 37]
# Each sequence's blocks, deliberately scattered and interleaved with the others'.
TABLES = [[9, 3, 6], [1, 7, 4], [8, 0, 5]]
NUM_BLOCKS = 10


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    cks = {family: build_checkpoint(family, root) for family in FAMILIES}
    write_old_layout(cks["llama"].path, root / "llama_old")
    return cks


@pytest.fixture(scope="session")
def prompts():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def make_batch(chunks: list[tuple[list[int], int]], kv_cache: torch.Tensor, layer_done=None) -> ForwardBatch:
    """chunks[i] = (sequence i's tokens this step, position of the first); blocks from TABLES."""
    ids, positions, slots, starts, ctx = [], [], [], [0], []
    for (tokens, start), table in zip(chunks, TABLES):
        pos = range(start, start + len(tokens))
        ids += tokens
        positions += pos
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in pos]
        starts.append(starts[-1] + len(tokens))
        ctx.append(start + len(tokens))
    long = dict(dtype=torch.long)
    return ForwardBatch(
        input_ids=torch.tensor(ids, **long), positions=torch.tensor(positions, **long),
        slot_mapping=torch.tensor(slots, **long), block_tables=torch.tensor(TABLES, **long),
        query_start=starts, context_lens=ctx, logits_indices=torch.arange(len(ids)),
        kv_cache=kv_cache, layer_done=layer_done)


def new_cache(args: ModelArgs) -> torch.Tensor:
    return allocate_kv_cache(KVLayout.for_model(args, NUM_BLOCKS, BLOCK, torch.float32), torch.device("cpu"))


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    tol = 1e-4 * ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= tol, f"max abs error {err:.3g} > {tol:.3g}"


def hf_logits(ck, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ck.hf_model(torch.tensor([tokens])).logits[0].float()


def run(model, batch) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(model(batch)[batch.logits_indices])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_matches_transformers(family, checkpoints, prompts):
    ck = checkpoints[family]
    model, args = load_model(str(ck.path), torch.float32, "cpu")
    assert args.architecture == ck.hf_model.config.architectures[0]
    kv = new_cache(args)
    done = []

    # Prefill all three prompts in one batch.
    logits = run(model, make_batch([(p, 0) for p in prompts], kv, layer_done=done.append))
    assert done == list(range(args.num_layers))
    rows = logits.split(PROMPT_LENS)
    for p, ours in zip(prompts, rows):
        assert_close(ours, hf_logits(ck, p))

    # Decode one token per sequence against the cache.
    nxt = [int(r[-1].argmax()) for r in rows]
    logits = run(model, make_batch([([t], len(p)) for p, t in zip(prompts, nxt)], kv))
    for i, (p, t) in enumerate(zip(prompts, nxt)):
        assert_close(logits[i], hf_logits(ck, p + [t])[-1])

    # Chunked prefill into a fresh cache equals the one-shot prefill.
    kv2 = new_cache(args)
    cuts = [3, 16, 20]
    first = run(model, make_batch([(p[:c], 0) for p, c in zip(prompts, cuts)], kv2))
    second = run(model, make_batch([(p[c:], c) for p, c in zip(prompts, cuts)], kv2))
    firsts, seconds = first.split(cuts), second.split([n - c for n, c in zip(PROMPT_LENS, cuts)])
    for ours_a, ours_b, ref in zip(firsts, seconds, rows):
        assert_close(torch.cat([ours_a, ours_b]), ref)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3"])
def test_fused_expert_names(family, checkpoints):
    """transformers 5's in-memory names (fused gate_up_proj/down_proj, Mixtral's `mlp`) load too."""
    ck = checkpoints[family]
    ref, _ = load_model(str(ck.path), torch.float32, "cpu")
    fused = list(ck.hf_model.state_dict().items())
    assert any(n.endswith("experts.gate_up_proj") for n, _ in fused)
    for transpose in (False, True):  # [E, 2I, H] as transformers 5, and the [E, H, 2I] orientation
        model = MODEL_CLASSES[ref.args.architecture](ref.args)
        model.load_weights((n, t.transpose(1, 2) if transpose and ".experts." in n else t) for n, t in fused)
        for (name, a), (_, b) in zip(model.named_parameters(), ref.named_parameters()):
            assert torch.equal(a, b), name


def test_sharded_checkpoint_uses_index(checkpoints):
    path = checkpoints["qwen3_moe"].path
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1


def test_old_config_layout_loads_identically(checkpoints, prompts):
    new, old = checkpoints["llama"].path, checkpoints["llama"].path.parent / "llama_old"
    assert "rope_theta" in json.loads((old / "config.json").read_text())
    args_new, args_old = resolve_model_args(str(new)), resolve_model_args(str(old))
    assert args_old == args_new
    assert args_new.rope_scaling["rope_type"] == "llama3" and args_new.o_proj_bias
    m_new, _ = load_model(str(new), torch.float32, "cpu")
    m_old, _ = load_model(str(old), torch.float32, "cpu")
    chunks = [(p, 0) for p in prompts]
    assert torch.equal(run(m_new, make_batch(chunks, new_cache(args_new))),
                       run(m_old, make_batch(chunks, new_cache(args_old))))


def test_family_args(checkpoints):
    qwen2_moe = resolve_model_args(str(checkpoints["qwen2_moe"].path))
    assert qwen2_moe.attention_bias and not qwen2_moe.o_proj_bias
    assert [qwen2_moe.is_moe_layer(i) for i in range(2)] == [False, True]
    assert qwen2_moe.shared_expert_intermediate_size == 80
    qwen3_moe = resolve_model_args(str(checkpoints["qwen3_moe"].path))
    assert [qwen3_moe.is_moe_layer(i) for i in range(3)] == [True, False, True]
    assert qwen3_moe.qk_norm and qwen3_moe.head_dim == 32
    mixtral = resolve_model_args(str(checkpoints["mixtral"].path))
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.norm_topk_prob) == (6, 96, True)
    assert resolve_model_args(str(checkpoints["qwen2"].path)).tie_word_embeddings


def test_deepseek_args(checkpoints):
    v2 = resolve_model_args(str(checkpoints["deepseek_v2"].path))
    assert v2.is_mla and v2.q_lora_rank is None and v2.rope_interleave
    assert (v2.head_dim, v2.rotary_dim, v2.v_head_dim, v2.num_kv_heads) == (24, 8, 12, 4)
    assert [v2.is_moe_layer(i) for i in range(3)] == [False, True, True]  # first_k_dense_replace 1
    assert (v2.scoring_func, v2.topk_method, v2.n_group, v2.topk_group) == ("softmax", "group_limited_greedy", 4, 2)
    assert (v2.shared_expert_intermediate_size, v2.shared_expert_gate, v2.routed_scaling_factor) == (48, False, 1.5)
    assert v2.rope_scaling["rope_type"] == "yarn" and v2.rope_scaling["mscale_all_dim"] == 0.8
    v3 = resolve_model_args(str(checkpoints["deepseek_v3"].path))
    assert v3.q_lora_rank == 24 and v3.attention_bias and v3.norm_topk_prob
    assert (v3.scoring_func, v3.topk_method, v3.num_experts_per_tok) == ("sigmoid", "noaux_tc", 3)
    # transformers' V3 config writes no topk_method; a Hub V3 config says noaux_tc, and nothing else is taken
    with pytest.raises(ValueError, match="topk_method 'greedy' is not supported for DeepseekV3ForCausalLM"):
        ModelArgs.from_hf_config({**json.loads((checkpoints["deepseek_v3"].path / "config.json").read_text()),
                                  "topk_method": "greedy"})
    with pytest.raises(ValueError, match="n_group 3"):
        ModelArgs.from_hf_config({**json.loads((checkpoints["deepseek_v2"].path / "config.json").read_text()),
                                  "n_group": 3})


def test_mla_caches_one_latent_per_token(checkpoints):
    """The point of MLA: per token and layer the cache holds kv_lora_rank + qk_rope_head_dim values
    (no V plane), fewer than a GQA model of the same width holds in K and V."""
    mla = resolve_model_args(str(checkpoints["deepseek_v2"].path))
    layout = KVLayout.for_model(mla, 8, BLOCK, torch.bfloat16)
    assert (layout.kind, layout.num_planes) == ("latent", 1)
    assert layout.shape == (3, 1, 8, BLOCK, 1, 32 + 8)
    assert layout.bytes_per_token == (32 + 8) * 3 * 2 == mla.num_kv_bytes_per_token(torch.bfloat16)
    assert layout.bytes_per_block == BLOCK * (32 + 8) * 2  # one layer's block: what every backend moves
    gqa = resolve_model_args(str(checkpoints["llama"].path))  # hidden 64 too: 2 KV heads of 16
    assert gqa.hidden_size == mla.hidden_size
    gqa_layout = KVLayout.for_model(gqa, 8, BLOCK, torch.bfloat16)
    assert (gqa_layout.kind, gqa_layout.num_planes) == ("kv", 2)
    per_layer = {name: lay.bytes_per_token // lay.num_layers for name, lay in (("mla", layout), ("gqa", gqa_layout))}
    assert per_layer == {"mla": 40 * 2, "gqa": 2 * 2 * 16 * 2}
    # Full size: DeepSeek-V2-Lite against Qwen3-30B-A3B, both 2048 wide. Per layer and token MLA
    # caches 576 values, Qwen3's GQA (4 KV heads of 128) 1024, and V2-Lite's 16 heads as plain
    # MHA would cache 16 * (192 + 128) = 5120.
    lite, qwen = resolve_model_args("deepseek-v2-lite"), resolve_model_args("qwen3-30b-a3b")
    assert lite.hidden_size == qwen.hidden_size == 2048
    assert lite.num_kv_bytes_per_token(torch.bfloat16) == 27 * 576 * 2 == 31104
    assert qwen.num_kv_bytes_per_token(torch.bfloat16) == 48 * 1024 * 2
    assert lite.num_heads * (lite.head_dim + lite.v_head_dim) == 5120


def test_mla_refuses_backends_without_mla(checkpoints):
    """An attention backend that cannot attend over a latent cache (no `supports_mla`) is refused
    when the model is built, naming model and backend, rather than compute garbage; both of ours can."""
    from pdserve.ops.attention import TorchAttention

    triton_attention = pytest.importorskip("pdserve.ops.triton_attention")
    assert TorchAttention.supports_mla and triton_attention.TritonAttention.supports_mla
    path = str(checkpoints["deepseek_v3"].path)
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM uses Multi-head Latent Attention.*backend object"):
        load_model(path, torch.float32, "cpu", attn_backend=object())


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_mla_fused_projections(family, checkpoints, prompts):
    """MLAttention.fuse_qkv (the GPU path's one GEMM for q, or V3's q_a with its bias, beside kv_a):
    the parameters become views of the stacked weight and the logits stay the model's."""
    path = str(checkpoints[family].path)
    ref, args = load_model(path, torch.float32, "cpu")
    fused, _ = load_model(path, torch.float32, "cpu")
    fused.fuse_qkv()
    attn = fused.layers[0].self_attn
    weight, bias = attn.q_kv_a
    first = attn.q_proj if attn.q_proj is not None else attn.q_a_proj
    assert first.weight.data_ptr() == weight.data_ptr() and (bias is not None) == args.attention_bias
    chunks = [(p, 0) for p in prompts[:2]]
    assert_close(run(fused, make_batch(chunks, new_cache(args))), run(ref, make_batch(chunks, new_cache(args))))


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_deepseek_shared_experts_fold_into_the_routed_ones(family, checkpoints, prompts):
    """DeepseekMoE.fold_shared_experts (the GPU path's, asked for by the MoE backend): the shared
    MLP (n x moe_intermediate_size wide; V2 n = 2, V3 n = 1) becomes n expert slots after the
    routed ones, routed to by every token at weight 1; the logits stay the model's. Here on
    TorchMoE, which computes any slots it is given."""
    from pdserve.ops.moe import TorchMoE

    path = str(checkpoints[family].path)
    ref, args = load_model(path, torch.float32, "cpu")
    folding = TorchMoE()
    folding.fold_shared_experts = True
    folded, _ = load_model(path, torch.float32, "cpu", moe_backend=folding)
    n = args.shared_expert_intermediate_size // args.moe_intermediate_size
    for moe, ref_moe in zip(folded.moe_layers(), ref.moe_layers()):
        assert moe.shared_expert is None and moe.num_shared_slots == n
        assert moe.w13.shape == (args.num_experts + n, 2 * args.moe_intermediate_size, args.hidden_size)
        e = args.num_experts
        assert torch.equal(moe.w13[:e], ref_moe.w13) and torch.equal(moe.w2[:e], ref_moe.w2)
        x = torch.randn(5, args.hidden_size, generator=torch.Generator().manual_seed(3))
        with torch.inference_mode():
            weights, ids = moe.route(x)
            assert torch.equal(ids[:, args.num_experts_per_tok:], torch.arange(args.num_experts, args.num_experts + n)
                               .expand(5, n)) and (weights[:, args.num_experts_per_tok:] == 1).all()
            assert_close(moe(x), ref_moe(x))
    assert sum(p.numel() for p in folded.parameters()) == sum(p.numel() for p in ref.parameters())
    chunks = [(p, 0) for p in prompts[:2]]
    assert_close(run(folded, make_batch(chunks, new_cache(args))), run(ref, make_batch(chunks, new_cache(args))))


def test_deepseek_v3_skips_multi_token_prediction_layers(checkpoints):
    """Hub V3 checkpoints carry the MTP module as a layer past the last (model.layers.61): not read."""
    ck = checkpoints["deepseek_v3"]
    ref, args = load_model(str(ck.path), torch.float32, "cpu")
    extra = [(f"model.layers.{args.num_layers}.self_attn.kv_b_proj.weight", torch.zeros(1)),
             (f"model.layers.{args.num_layers}.eh_proj.weight", torch.zeros(1))]
    placer = WeightPlacer(ref)  # not even read
    assert all(placer.place(n, tuple(t.shape)) is None for n, t in extra)
    model = MODEL_CLASSES[args.architecture](args)
    model.load_weights([*ck.hf_model.state_dict().items(), *extra])
    for (name, a), (_, b) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(a, b), name


def test_checkpoint_tensor_errors(checkpoints):
    ck = checkpoints["qwen2"]
    args = resolve_model_args(str(ck.path))
    weights = dict(ck.hf_model.state_dict())
    with pytest.raises(ValueError, match="model.layers.0.mlp.extra.weight"):
        MODEL_CLASSES[args.architecture](args).load_weights(
            [*weights.items(), ("model.layers.0.mlp.extra.weight", torch.zeros(1))])
    del weights["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.k_proj\.bias"):
        MODEL_CLASSES[args.architecture](args).load_weights(weights.items())
    weights = dict(checkpoints["qwen3_moe"].hf_model.state_dict())
    del weights["model.layers.2.mlp.experts.down_proj"]
    args = resolve_model_args(str(checkpoints["qwen3_moe"].path))
    with pytest.raises(ValueError, match=r"layers\.2\.mlp\.w2"):
        MODEL_CLASSES[args.architecture](args).load_weights(weights.items())


# -- RoPE --------------------------------------------------------------------------------------

@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 500000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    LLAMA3_ROPE,
    {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 128},
], ids=lambda r: r["rope_type"])
def test_rope_matches_transformers(rope):
    config = transformers.LlamaConfig(hidden_size=512, num_attention_heads=4, max_position_embeddings=512,
                                      rope_parameters=dict(rope))
    args = ModelArgs.from_hf_config({**config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    ours = RotaryEmbedding(args.head_dim, args.max_position_embeddings, args.rope_theta, args.rope_scaling)
    positions = torch.arange(512)
    cos, sin = ours(positions, torch.float32)
    ref_cos, ref_sin = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)(
        torch.zeros(1), positions[None])
    torch.testing.assert_close(cos[:, 0], ref_cos[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(sin[:, 0], ref_sin[0], rtol=0, atol=1e-5)


# -- ModelArgs parsing ---------------------------------------------------------------------------

def _hf(arch: str, **kw) -> dict:
    return {"architectures": [arch], "vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 96, "max_position_embeddings": 4096, **kw}


def test_sliding_window_caps_context():
    qwen2 = "Qwen2ForCausalLM"
    assert ModelArgs.from_hf_config(_hf(qwen2, sliding_window=1024)).max_position_embeddings == 4096
    used = _hf(qwen2, sliding_window=1024, use_sliding_window=True)
    assert ModelArgs.from_hf_config(used).max_position_embeddings == 1024
    full = {**used, "layer_types": ["full_attention"] * 2}
    assert ModelArgs.from_hf_config(full).max_position_embeddings == 4096
    mixtral = _hf("MixtralForCausalLM", sliding_window=2048)
    assert ModelArgs.from_hf_config(mixtral).max_position_embeddings == 2048


def test_head_dim_and_defaults():
    assert ModelArgs.from_hf_config(_hf("LlamaForCausalLM", head_dim=None)).head_dim == 16
    assert ModelArgs.from_hf_config(_hf("Qwen3ForCausalLM")).head_dim == 128  # transformers' default
    args = ModelArgs.from_hf_config(_hf("Qwen2MoeForCausalLM", eos_token_id=[3, 4]))
    assert args.attention_bias and args.num_experts == 60 and args.eos_token_ids == [3, 4]
    assert ModelArgs.from_hf_config(_hf("MixtralForCausalLM")).rope_theta == 1e6


def test_unsupported_architecture(tmp_path):
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*Qwen3MoeForCausalLM"):
        ModelArgs.from_hf_config(_hf("GPT2LMHeadModel"))
    (tmp_path / "config.json").write_text(json.dumps(_hf("GPT2LMHeadModel")))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_unsupported_rope_type():
    with pytest.raises(ValueError, match="rope_scaling.rope_type 'dynamic'.*llama3"):
        ModelArgs.from_hf_config(_hf("LlamaForCausalLM", rope_scaling={"type": "dynamic", "factor": 2.0}))


# -- loader errors, presets, dummy weights, fingerprint -----------------------------------------

def test_missing_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_hf("LlamaForCausalLM")))
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}.*model.safetensors"):
        load_model(str(tmp_path), torch.float32, "cpu")
    model, _ = load_model(str(tmp_path), torch.float32, "cpu", load_format="dummy")  # no files needed


def test_missing_model_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-model.*tiny-moe"):
        resolve_model_args("no-such-model")
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_args(str(tmp_path))


def test_bad_load_format():
    with pytest.raises(ValueError, match="load_format 'pt'.*dummy"):
        load_model("tiny-moe", torch.float32, "cpu", load_format="pt")


def test_presets():
    assert set(PRESETS) == {"tiny-moe", "qwen3-30b-a3b", "deepseek-v2-lite"}
    tiny = resolve_model_args("tiny-moe")
    assert (tiny.vocab_size, tiny.bos_token_id, tiny.eos_token_ids) == (512, 256, [257])
    big = resolve_model_args("qwen3-30b-a3b")
    assert big.eos_token_ids == [151645, 151643] and big.num_kv_bytes_per_token(torch.bfloat16) == 98304
    with torch.device("meta"):
        model = MODEL_CLASSES[big.architecture](big)
    assert 30.4e9 < sum(p.numel() for p in model.parameters()) < 30.6e9
    assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES)
    lite = resolve_model_args("deepseek-v2-lite")  # 15.7B parameters, as DeepSeek states
    assert (lite.num_layers, lite.hidden_size, lite.num_heads, lite.kv_lora_rank, lite.q_lora_rank) == (27, 2048, 16, 512, None)
    assert (lite.num_experts, lite.num_experts_per_tok, lite.shared_expert_intermediate_size) == (64, 6, 2 * 1408)
    assert lite.eos_token_ids == [100001] and [lite.is_moe_layer(i) for i in range(2)] == [False, True]
    with torch.device("meta"):
        model = MODEL_CLASSES[lite.architecture](lite)
    assert 15.6e9 < sum(p.numel() for p in model.parameters()) < 15.8e9


def test_dummy_weights_are_seeded():
    a, args = load_model("tiny-moe", torch.float32, "cpu", seed=0)
    b, _ = load_model("tiny-moe", torch.float32, "cpu", seed=0)
    c, _ = load_model("tiny-moe", torch.float32, "cpu", seed=1)
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert not torch.equal(pa["layers.0.mlp.w13"], pc["layers.0.mlp.w13"])
    assert torch.all(pa["norm.weight"] == 1) and torch.all(pa["layers.1.self_attn.q_norm.weight"] == 1)
    assert abs(pa["layers.0.mlp.w13"].std().item() - 0.02) < 1e-3
    assert pa["embed_tokens.weight"].dtype == torch.float32
    c.load_weights(a.state_dict().items())  # our own names (fused w13/w2) load too
    assert all(torch.equal(pa[n], p) for n, p in c.named_parameters())
    bf16, _ = load_model("tiny-moe", torch.bfloat16, "cpu")
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    assert bf16.rotary_emb.cos.dtype == torch.float32  # RoPE tables stay float32
    logits = run(a, make_batch([([1, 2, 3], 0)], new_cache(args)))
    assert logits.shape == (3, 512) and torch.isfinite(logits).all()


def test_fingerprint(checkpoints):
    tiny = resolve_model_args("tiny-moe")
    fp = model_fingerprint("tiny-moe", tiny, torch.float32)
    assert fp == model_fingerprint("tiny-moe", resolve_model_args("tiny-moe"), torch.float32)
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert fp != model_fingerprint("tiny-moe", tiny, torch.bfloat16)
    assert fp != model_fingerprint("tiny-moe", tiny, torch.float32, seed=1)
    paths = [str(checkpoints[f].path) for f in ("llama", "qwen2")]
    fps = [model_fingerprint(p, resolve_model_args(p), torch.float32) for p in paths]
    assert fps[0] != fps[1] and fps[0] == model_fingerprint(paths[0], resolve_model_args(paths[0]), torch.float32)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "sub/../../outside.safetensors", "/dev/zero", "ABSOLUTE"])
def test_index_naming_a_file_outside_the_model_directory_is_refused(checkpoints, tmp_path, shard):
    """A checkpoint's index may only name files in its directory: `../x` and absolute paths (a real
    safetensors file elsewhere, which would otherwise load) are refused naming the index and the shard."""
    src = checkpoints["llama"].path
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            (model_dir / f.name).write_bytes(f.read_bytes())
    weights = sorted(src.glob("*.safetensors"))[0]
    (tmp_path / "outside.safetensors").write_bytes(weights.read_bytes())
    if shard == "ABSOLUTE":
        shard = str(tmp_path / "outside.safetensors")
    index = model_dir / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"model.embed_tokens.weight": shard}}))
    with pytest.raises(ValueError, match=f"{index}.*{shard}.*outside the model directory"):
        load_model(str(model_dir), torch.float32, "cpu")
