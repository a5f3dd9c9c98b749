"""DeepSeek-V3's multi-token-prediction layer as a drafter: its draft logits against an oracle built
from transformers' own modules (same weights), its loading, and speculative decoding with it."""

import pytest
import torch

from hf_checkpoints import mtp_checkpoint
from pdserve.forward.forward_batch import ForwardBatch
from pdserve.forward.kv_cache import KVLayout, allocate_kv_cache
from pdserve.models.loader import load_model
from pdserve.ops.backends import make_backends

BLOCK = 16


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    return mtp_checkpoint(tmp_path_factory.mktemp("mtp"))


def one_prompt(ids: list[int], positions: range, kv: torch.Tensor, table: list[int]) -> ForwardBatch:
    long = dict(dtype=torch.long, device=kv.device)
    pos = list(positions)
    return ForwardBatch(
        input_ids=torch.tensor(ids, **long), positions=torch.tensor(pos, **long),
        slot_mapping=torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in pos], **long),
        block_tables=torch.tensor([table], **long), query_start=[0, len(pos)], context_lens=[pos[-1] + 1],
        logits_indices=torch.arange(len(pos), device=kv.device), kv_cache=kv,
        context_lens_t=torch.tensor([pos[-1] + 1], dtype=torch.int32, device=kv.device),
        query_start_t=torch.tensor([0, len(pos)], dtype=torch.int32, device=kv.device))


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_draft_logits_match_transformers_modules(mtp_ckpt, device):
    """On the CPU with the torch reference kernels; on a GPU with the Triton ones (float32 both)."""
    path, ck, oracle = mtp_ckpt
    backends = make_backends("auto", "auto", torch.device(device))
    model, args = load_model(str(path), torch.float32, device, attn_backend=backends[0], moe_backend=backends[1],
                             norms=backends[2], mtp=True)
    assert args.num_nextn_predict_layers == 1 and model.mtp is not None
    kv = allocate_kv_cache(KVLayout.for_model(args, 8, BLOCK, torch.float32, extra_layers=1), torch.device(device))
    table = [5, 2, 7]
    prompt = torch.randint(0, args.vocab_size, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        hf_hidden = ck.hf_model.model(torch.tensor([prompt])).last_hidden_state[0]
        want = oracle(ck.hf_model, hf_hidden[:-1], prompt[1:])
    with torch.inference_mode():
        hidden = model(one_prompt(prompt, range(len(prompt)), kv, table))
        torch.testing.assert_close(hidden.cpu(), hf_hidden, rtol=1e-4, atol=1e-4 * hf_hidden.abs().max().item())
        # Whole, then in two chunks over the MTP layer's own KV (as a chunked prompt, then decode).
        got = model.mtp.compute_logits(model.mtp_forward(one_prompt(prompt[1:], range(36), kv, table), hidden[:-1]))
        a = model.mtp.compute_logits(model.mtp_forward(one_prompt(prompt[1:21], range(20), kv, table), hidden[:20]))
        b = model.mtp.compute_logits(model.mtp_forward(one_prompt(prompt[21:], range(20, 36), kv, table),
                                                       hidden[20:-1]))
    tol = 1e-4 * want.abs().max().item()
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=tol)
    torch.testing.assert_close(torch.cat([a, b]).cpu(), want, rtol=1e-4, atol=tol)
    assert kv[args.num_layers].abs().sum() > 0  # the MTP layer cached in the layer after the model's


def test_a_model_without_mtp_loads_as_before_and_mtp_is_refused_by_name(mtp_ckpt):
    path, _, _ = mtp_ckpt
    model, args = load_model(str(path), torch.float32, "cpu")
    assert model.mtp is None  # the layer's tensors are skipped
    with pytest.raises(ValueError, match="speculative.method 'mtp'.*Qwen3MoeForCausalLM has none"):
        load_model("tiny-moe", torch.float32, "cpu", mtp=True)


# -- speculative decoding with the MTP layer -------------------------------------------------------

from test_spec_decode import engine, run, tokens  # noqa: E402  (one engine builder, one step loop)

from pdserve.config import EngineConfig, ModelConfig  # noqa: E402
from pdserve.engine.engine import Engine  # noqa: E402
from pdserve.protocol import SamplingParams  # noqa: E402

MTP = {"method": "mtp"}


@pytest.fixture(scope="module")
def sharp(tmp_path_factory) -> str:
    """A checkpoint whose greedy answers hold clear leaders (rounding does not flip them) and whose
    MTP head reads the embeddings as the model's head does."""
    return str(mtp_checkpoint(tmp_path_factory.mktemp("mtp-sharp"), sharp=True)[0])


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [[5, 6, 7, 8] * 6, [9, 10, 11] * 5 + [3], [1, 2], torch.randint(0, 128, (40,), generator=g).tolist()]


def test_greedy_tokens_are_identical_and_drafts_are_accepted(sharp):
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    off, on = engine(sharp), engine(sharp, speculative=MTP)
    assert on.layout.num_layers == off.layout.num_layers + 1  # the MTP layer's KV, in the same blocks
    assert tokens(run(on, prompts(), params)) == tokens(run(off, prompts(), params))  # (run: blocks back idle)
    p = on.profile
    assert 0 < p.spec_accepted_tokens <= p.spec_draft_tokens
    # Every decode step carries its one draft (the prompt's step left the first), but a sequence's
    # last where max_tokens leaves no room: 31 tokens after the first, one a draft accepted.
    assert p.spec_draft_tokens + p.spec_accepted_tokens >= len(prompts()) * (31 - 1)


@pytest.mark.parametrize("kw", [
    {"num_kv_blocks": 9, "enable_prefix_cache": False},  # preemption by recompute among drafts
    {"max_num_batched_tokens": 12, "chunk_size": 7},  # chunked prompts, drafts within a small budget
])
def test_greedy_tokens_are_identical_under_other_schedules(sharp, kw):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = tokens(run(engine(sharp), prompts(), params))
    on = engine(sharp, speculative=MTP, **kw)
    assert tokens(run(on, prompts(), params)) == want
    assert on.profile.spec_accepted_tokens > 0
    if "num_kv_blocks" in kw:
        assert on.scheduler.num_preemptions > 0


def test_seeded_sampling_is_reproducible_and_an_opted_out_request_is_not_drafted(sharp):
    off, on = engine(sharp), engine(sharp, speculative=MTP)
    seeded = [SamplingParams(max_tokens=20, temperature=0.8, seed=s, ignore_eos=True) for s in (3, 3, 4)]
    a, b, c = (x.token_ids for x in on.generate([prompts()[0]] * 3, seeded))
    assert a == b != c
    drafted = on.profile.spec_draft_tokens
    out = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, speculative=False)
    assert tokens(run(on, prompts(), out)) == tokens(run(off, prompts(), out))
    assert on.profile.spec_draft_tokens == drafted


def test_abort_during_a_step_frees_every_block(sharp):
    on = engine(sharp, speculative=MTP)
    idle = on.pool.num_free_blocks
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    on.add_request("a", prompts()[0], params)
    on.add_request("b", prompts()[1], params)
    aborted = []

    def abort_in_verify(layer, scheduled):  # inside the step's forward: the MTP layer runs after it
        if layer == 0 and any(s.draft for s in scheduled) and not aborted:
            aborted.append(on.abort("a"))

    on.layer_hook = abort_in_verify
    while on.has_unfinished():
        on.step()
    assert aborted == [True]
    assert on.pool.num_free_blocks == idle


@GPU
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_greedy_tokens_are_identical_and_drafts_are_accepted(sharp, dtype):
    """On a GPU (Triton kernels, plain decode steps from CUDA graphs, verify steps eager)."""
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    kw = dict(device="cuda", model=ModelConfig(path=sharp, dtype=dtype), num_kv_blocks=256)
    off, on = Engine(EngineConfig(**kw)), Engine(EngineConfig(**kw, speculative=MTP))
    assert tokens(run(on, prompts(), params)) == tokens(run(off, prompts(), params))
    assert on.profile.spec_accepted_tokens > 0


def test_mtp_on_a_model_without_the_layer_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="speculative.method 'mtp'"):
        engine(speculative=MTP)


def test_a_prefill_engine_computes_and_hands_on_the_mtp_layers_kv(sharp):
    """What moves to the decode replica: the prefill engine's MTP layer KV of a prompt, heard by its
    layer hook after the model's layers, equals what a colocated engine computes for it."""
    prompt = prompts()[3]
    params = SamplingParams(max_tokens=1, temperature=0)
    pre = engine(sharp, speculative=MTP, role="prefill")
    heard = []
    pre.layer_hook = lambda layer, scheduled: heard.append(layer)
    pre.add_request("p", prompt, params)
    out = pre.step()
    L = pre.args.num_layers
    assert heard == list(range(L + 1)) and out[0].finished
    col = engine(sharp, speculative=MTP)
    col.add_request("c", prompt, SamplingParams(max_tokens=2, temperature=0))
    col.step()  # the prompt's step (colocated: also the MTP layer's over it)
    assert out[0].token_ids == col.seqs["c"].token_ids[len(prompt):]
    n = len(prompt)
    mine = pre.kv_cache[L, :, out[0].kv_block_ids].flatten(1, 2)[:, :n]
    theirs = col.kv_cache[L, :, col.seqs["c"].block_ids].flatten(1, 2)[:, :n]
    assert mine.abs().sum() > 0
    torch.testing.assert_close(mine, theirs)
    pre.release("p")


def test_a_prefill_engine_flipped_to_decode_drafts_with_its_mtp_layer(sharp):
    pre = engine(sharp, speculative=MTP, role="prefill")
    assert not pre.speculative and pre.scheduler.drafter is None
    pre.change_role(pre.config.model_copy(update={"role": "colocated"}))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    assert tokens(run(pre, prompts(), params)) == tokens(run(engine(sharp), prompts(), params))
    assert pre.profile.spec_accepted_tokens > 0


def test_disaggregated_greedy_text_equals_colocated(sharp, tmp_path):
    """`pdserve up` with one prefill and one decode replica (NIXL), the decode one drafting with the
    MTP layer: the prefill replica computes the layer's KV of each prompt, which moves with the
    rest; the decode replica drafts from its second step on. Same greedy text as one engine alone,
    blocks back idle, drafts accepted (vLLM's counters in /metrics)."""
    import openai

    from serving_cluster import Cluster, until

    ref = engine(sharp)
    c = Cluster(tmp_path, model={"path": sharp}, decode={"speculative": MTP})
    try:
        c.wait_ready()
        oa = openai.OpenAI(base_url=f"{c.url}/v1", api_key="unused", max_retries=0)
        for p in prompts():
            want = ref.generate([p], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0].text
            r = oa.completions.create(model=sharp, prompt=p, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True})
            assert r.choices[0].text == want
        assert all(s["used"] == 0 for s in c.wait_idle().values())

        def counter(name: str, text: str | None = None) -> float:
            text = c.metrics() if text is None else text
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))

        until(lambda: counter("vllm:spec_decode_num_accepted_tokens_total") > 0, 10, "accepted drafts in /metrics")
        text = c.metrics()  # both from one scrape: the counters move between two
        assert counter("vllm:spec_decode_num_draft_tokens_total", text) >= counter(
            "vllm:spec_decode_num_accepted_tokens_total", text)
    finally:
        assert c.stop() == 0, c.output()


def test_config_errors_name_their_keys(sharp, tmp_path):
    import yaml

    from pdserve.config import ClusterConfig, ConfigError, load_cluster_config
    from pdserve.control.model_fit import check_model_fit
    from pdserve.models import resolve_model_args

    def refused(raw: dict) -> str:
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump(raw))
        with pytest.raises(ConfigError) as e:
            load_cluster_config(str(path))
        return str(e.value)

    assert "decode.speculative" in refused({"decode": {"speculative": {"method": "mtp", "num_tokens": 3}}})
    assert "num_tokens 3 with method 'mtp'" in refused({"decode": {"speculative": {"method": "mtp", "num_tokens": 3}}})
    assert "expert-parallel" in refused({"decode": {"ep_size": 2, "speculative": {"method": "mtp"}}})
    cfg = ClusterConfig.model_validate({"decode": {"speculative": MTP}})
    assert cfg.engine_config("prefill").speculative.mtp  # the prefill side computes the layer's KV
    assert cfg.engine_config("decode").speculative.draft_tokens == 1
    assert not ClusterConfig.model_validate({"decode": {"speculative": SPEC_NGRAM}}).engine_config(
        "prefill").speculative.method
    check_model_fit(cfg, resolve_model_args(sharp))
    with pytest.raises(ConfigError, match=r"decode.speculative.method: 'mtp' is not allowed — the model"):
        check_model_fit(cfg, resolve_model_args("tiny-moe"))
    tp = ClusterConfig.model_validate({"colocated": {"replicas": 1, "tp_size": 2, "speculative": MTP}})
    with pytest.raises(ConfigError, match=r"colocated.speculative.method: 'mtp' is not allowed with colocated.tp_size"):
        check_model_fit(tp, resolve_model_args(sharp))


SPEC_NGRAM = {"method": "ngram"}
