"""DeepSeek-V3's multi-token-prediction layer as a drafter: its draft logits against an oracle built
from transformers' own modules (same weights), its loading, and speculative decoding with it."""

import pytest
import torch

from hf_checkpoints import mtp_checkpoint
from pdserve.forward.forward_batch import ForwardBatch
from pdserve.forward.kv_cache import KVLayout, allocate_kv_cache
from pdserve.models.loader import load_model

BLOCK = 16


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    return mtp_checkpoint(tmp_path_factory.mktemp("mtp"))


def one_prompt(ids: list[int], positions: range, kv: torch.Tensor, table: list[int]) -> ForwardBatch:
    long = dict(dtype=torch.long)
    pos = list(positions)
    return ForwardBatch(
        input_ids=torch.tensor(ids, **long), positions=torch.tensor(pos, **long),
        slot_mapping=torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in pos], **long),
        block_tables=torch.tensor([table], **long), query_start=[0, len(pos)], context_lens=[pos[-1] + 1],
        logits_indices=torch.arange(len(pos)), kv_cache=kv)


def test_draft_logits_match_transformers_modules(mtp_ckpt):
    path, ck, oracle = mtp_ckpt
    model, args = load_model(str(path), torch.float32, "cpu", mtp=True)
    assert args.num_nextn_predict_layers == 1 and model.mtp is not None
    kv = allocate_kv_cache(KVLayout.for_model(args, 8, BLOCK, torch.float32, extra_layers=1), torch.device("cpu"))
    table = [5, 2, 7]
    prompt = torch.randint(0, args.vocab_size, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        hf_hidden = ck.hf_model.model(torch.tensor([prompt])).last_hidden_state[0]
        want = oracle(ck.hf_model, hf_hidden[:-1], prompt[1:])
    with torch.inference_mode():
        hidden = model(one_prompt(prompt, range(len(prompt)), kv, table))
        torch.testing.assert_close(hidden, hf_hidden, rtol=1e-4, atol=1e-4 * hf_hidden.abs().max().item())
        # Whole, then in two chunks over the MTP layer's own KV (as a chunked prompt, then decode).
        got = model.mtp.compute_logits(model.mtp_forward(one_prompt(prompt[1:], range(36), kv, table), hidden[:-1]))
        a = model.mtp.compute_logits(model.mtp_forward(one_prompt(prompt[1:21], range(20), kv, table), hidden[:20]))
        b = model.mtp.compute_logits(model.mtp_forward(one_prompt(prompt[21:], range(20, 36), kv, table),
                                                       hidden[20:-1]))
    tol = 1e-4 * want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=tol)
    torch.testing.assert_close(torch.cat([a, b]), want, rtol=1e-4, atol=tol)
    assert kv[args.num_layers].abs().sum() > 0  # the MTP layer cached in the layer after the model's


def test_a_model_without_mtp_loads_as_before_and_mtp_is_refused_by_name(mtp_ckpt):
    path, _, _ = mtp_ckpt
    model, args = load_model(str(path), torch.float32, "cpu")
    assert model.mtp is None  # the layer's tensors are skipped
    with pytest.raises(ValueError, match="speculative.method 'mtp'.*Qwen3MoeForCausalLM has none"):
        load_model("tiny-moe", torch.float32, "cpu", mtp=True)
