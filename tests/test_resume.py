"""Resuming a request from the tokens it generated already (Request.output_ids: the router
migrating a request whose decode replica died). With greedy sampling the resumed request's tokens
and text go on exactly where the undisturbed run's stopped, at every split point: those where the
client's text ended in held-back bytes of an unfinished character (tiny-moe's byte-level tokenizer
makes many), a stop string across the split, max_tokens reached; on a colocated engine, across a
prefill and a decode engine, and through a colocated worker."""

import threading
import time

import pytest
from kv_pair import loopback_pair
from test_engine import make_engine

from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import FinishReason
from pdserve.messages import NewRequest, Request
from pdserve.protocol import InvalidRequestError, SamplingParams
from pdserve.worker.colocated import ColocatedWorker

PROMPT = "Once upon a time"
GREEDY = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
overlapped = pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])


def undisturbed(params: SamplingParams) -> tuple[list[int], list[str], FinishReason]:
    """The request run whole: its tokens, each token's text as streamed, how it ended."""
    outs = []
    make_engine().generate([PROMPT], params, on_output=outs.append)
    assert all(len(o.token_ids) == 1 for o in outs)
    return [o.token_ids[0] for o in outs], [o.text for o in outs], outs[-1].finish_reason


def held_splits(texts: list[str]) -> list[int]:
    """Split points k where the client's text after k tokens ends in held-back bytes."""
    return [k for k in range(1, len(texts)) if texts[k - 1] == ""]


def collect(outputs, got: dict) -> None:
    """Each request's tokens, text and finish reason (None until it finished) from step outputs."""
    for o in outputs:
        tokens, text, _ = got.get(o.request_id, ([], "", None))
        got[o.request_id] = (tokens + o.token_ids, text + o.text, o.finish_reason)


def resume_colocated(engine: Engine, params: SamplingParams, tokens: list[int], splits) -> dict:
    """One request per split point k, resumed from the first k tokens, all in one batch:
    {k: (tokens after them, their text, finish reason)}."""
    ids = engine.tokenize(PROMPT)
    for k in splits:
        engine.add_request(f"k{k}", ids, params, tokens[:k])
    got: dict = {}
    while engine.has_unfinished():
        collect(engine.step(), got)
    return {k: got[f"k{k}"] for k in splits}


def check(got: dict, tokens: list[int], texts: list[str], reason: FinishReason) -> None:
    for k, (rest, text, r) in got.items():
        assert rest == tokens[k:], f"split {k}"
        assert "".join(texts[:k]) + text == "".join(texts), f"split {k}"
        assert r == reason, f"split {k}"


@overlapped
def test_a_resumed_request_goes_on_exactly_as_the_undisturbed_one(overlap):
    tokens, texts, reason = undisturbed(GREEDY)
    assert reason == FinishReason.LENGTH and len(held_splits(texts)) >= 3  # the hard case is there
    engine = make_engine(overlap_scheduling=overlap)
    # Every split: held-back bytes at many, and the last leaves one token to max_tokens.
    got = resume_colocated(engine, GREEDY, tokens, range(1, GREEDY.max_tokens))
    check(got, tokens, texts, reason)
    assert engine.pool.num_free_blocks == 256


@overlapped
def test_a_stop_string_across_the_split_is_found_as_in_the_undisturbed_run(overlap):
    tokens, texts, _ = undisturbed(GREEDY)
    text = "".join(texts)
    # A stop string from two characters before a split whose bytes were held back to one after it
    # (where it first occurs): the resumed request must find it with the client's last characters.
    for k in held_splits(texts):
        end = len("".join(texts[:k]))
        stop = text[end - 2: end + 1]
        if end >= 2 and text.find(stop) == end - 2:
            break
    else:
        pytest.fail("no split to put a stop string across")
    params = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0, ignore_eos=True, stop=[stop])
    stopped, stopped_texts, reason = undisturbed(params)
    assert reason == FinishReason.STOP and "".join(stopped_texts) == text[: end - 2] and len(stopped) > k
    got = resume_colocated(make_engine(overlap_scheduling=overlap), params, stopped, range(1, len(stopped)))
    check(got, stopped, stopped_texts, reason)


@overlapped
def test_a_request_resumed_across_a_prefill_and_a_decode_engine_goes_on_exactly(overlap):
    """The prefill engine computes the KV of prompt + output_ids and samples the next token; all
    those blocks go to the decode engine (through the real connectors), which starts from it."""
    tokens, texts, reason = undisturbed(GREEDY)
    prefill, decode = make_engine(role="prefill"), make_engine(role="decode", overlap_scheduling=overlap)
    decode.pool.allocate(37)  # a different free layout: destination ids differ from the source's
    streamer, intake = loopback_pair(prefill, decode)
    schedule, decoded = decode.scheduler.schedule, set()

    def schedule_seen():
        scheduled = schedule()
        decoded.update(s.num_new_tokens for s in scheduled)
        return scheduled

    decode.scheduler.schedule = schedule_seen
    ids = prefill.tokenize(PROMPT)
    splits = range(1, GREEDY.max_tokens)
    got: dict = {}
    try:
        for k in splits:
            handle = intake.reserve(Request(f"k{k}", ids, GREEDY, tokens[:k]))
            # Blocks for every token so far: the prefill engine sends the KV of all of them.
            assert len(handle.block_ids) == -(-(len(ids) + k) // decode.config.block_size)
            streamer.add(Request(f"k{k}", ids, GREEDY, tokens[:k]), handle)
        deadline = time.monotonic() + 120
        while len(got) < len(splits) or any(r is None for _, _, r in got.values()):
            assert time.monotonic() < deadline, "the decode engine did not finish"
            streamer.step()
            assert intake.poll() == []
            collect(decode.step(), got)
    finally:
        streamer.connector.close()
        intake.connector.close()
    check({k: got[f"k{k}"] for k in splits}, tokens, texts, reason)
    assert decoded == {1}  # the KV of prompt and output_ids came whole: the decode engine recomputes none
    assert prefill.pool.num_free_blocks == 256 and decode.pool.num_free_blocks == 256 - 37


def test_a_colocated_worker_resumes_from_the_requests_output_ids():
    tokens, texts, reason = undisturbed(GREEDY)
    k = held_splits(texts)[0]
    worker = ColocatedWorker("resume-test", EngineConfig(model=ModelConfig(path="tiny-moe"), num_kv_blocks=64),
                             namespace="unused")
    worker.streams.flush_nap = lambda nap: nap  # no router here to send tokens to
    got: dict = {}
    done = threading.Event()
    real_output = worker.streams.output

    def output(out):
        real_output(out)
        collect([out], got)
        if out.finished:
            done.set()

    worker.streams.output = output
    try:
        ids = worker.engine.tokenize(PROMPT)
        over = NewRequest(Request("over", ids, GREEDY, output_ids=tokens))  # nothing left to generate
        assert [r and r.param for r in worker.generate([NewRequest(Request("r", ids, GREEDY, output_ids=tokens[:k])), over],
                                                       "router")] == [None, "output_ids"]
        assert done.wait(60), "the request did not finish"
    finally:
        worker.loop.stop()
    check({k: got["r"]}, tokens, texts, reason)


@pytest.mark.parametrize("role", ["colocated", "decode"])
def test_a_resume_that_can_never_run_is_refused_naming_the_field(role):
    engine = Engine(EngineConfig(model=ModelConfig(path="tiny-moe", max_model_len=64), num_kv_blocks=64, role=role))
    add = engine.reserve if role == "decode" else engine.add
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for prompt, output_ids, param, match in [
        ([1, 2], [3] * 8, "output_ids", "max_tokens is 8"),  # max_tokens reached: nothing to resume
        ([1, 2], [3] * 9, "output_ids", "max_tokens is 8"),
        (list(range(60)), [3, 4, 5, 6], "output_ids", "make 64 tokens.*context is 64"),  # together over the context
        (list(range(64)), [3], "prompt", "context is 64"),  # the prompt alone
        ([1, 2], [3, 512], "output_ids", r"token ids must be in \[0, 512\)"),
    ]:
        with pytest.raises(InvalidRequestError, match=match) as e:
            add(Request("x", prompt, params, output_ids))
        assert e.value.param == param
    assert not engine.seqs and engine.pool.num_free_blocks == 64
    if role == "colocated":  # the context counts the tokens generated before too: one more fits
        engine.add_request("fits", list(range(60)), params, [3, 4, 5])
        out = []
        while engine.has_unfinished():
            out += engine.step()
        assert [(len(o.token_ids), o.finish_reason) for o in out] == [(1, FinishReason.LENGTH)]


def test_a_resume_whose_kv_can_never_fit_is_refused_naming_output_ids():
    engine = Engine(EngineConfig(model=ModelConfig(path="tiny-moe"), num_kv_blocks=3))  # 48 tokens
    params = SamplingParams(max_tokens=32, temperature=0)
    engine.check_request(Request("r", list(range(30)), params, [3] * 17))  # 47 tokens and the next one: 3 blocks
    with pytest.raises(InvalidRequestError, match="make 48 tokens, which need 4 KV blocks") as e:
        engine.check_request(Request("r", list(range(30)), params, [3] * 18))
    assert e.value.param == "output_ids"
