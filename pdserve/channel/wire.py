"""The channel's frames: a 4-byte big-endian length, then one msgpack array whose first element
names the frame. Every frame carries the typed messages of pdserve/messages.py, flattened to
arrays here and rebuilt on the other side, so neither end passes loose dicts on.

Router -> worker: HELLO (once, proving the cluster token over the worker's nonce), CALLS (one
turn's requests or aborts for one worker, batched), TAKEN (a DELTAS frame was delivered: the
worker sends the next; meanwhile it joins the steps' output), BEAT. Worker -> router: WELCOME (the
hello's answer), ANSWERS (one per answered CALLS), DELTAS (one engine step's output for that
router's requests, or the joined output of the steps since the router took the last), BEAT."""

import asyncio
import hashlib
import hmac
import struct
from collections.abc import Callable
from dataclasses import fields

import msgpack

from pdserve.messages import NewRequest, Refusal, Request, RequestDelta, ReserveResult, Unpaired
from pdserve.protocol import SamplingParams, TokenLogprob

LEN = struct.Struct(">I")
NONCE_BYTES = 16
MAX_HELLO_BYTES = 4096  # a hello is a name and a proof: anything longer is not a pdserve peer
MAX_FRAME_BYTES = 256 * 1024 * 1024  # a frame longer than this is a broken peer, not a big batch

HELLO, WELCOME, CALLS, ANSWERS, DELTAS, TAKEN, BEAT = "hello", "welcome", "calls", "answers", "deltas", "taken", "beat"
# Calls a router makes; ANSWERS come back for all but ABORT.
PREFILL, RESERVE, GENERATE, ABORT = "prefill", "reserve", "generate", "abort"
CALL_KINDS = (PREFILL, RESERVE, GENERATE, ABORT)

_PARAMS = [f.name for f in fields(SamplingParams)]


class ChannelClosed(ConnectionError):
    """The channel to a peer closed (its process died, its host is cut off, or it refused us)."""


class BadFrame(ValueError):
    """A frame that is not the channel's (garbage, or an unknown kind)."""


def hello_proof(token: str | None, nonce: bytes, router: str, worker: str) -> str:
    """What a router sends to prove it holds the cluster's token (an HMAC: the token never travels)."""
    return hmac.new((token or "").encode(), b"pdserve-channel:" + nonce + f"{router}>{worker}".encode(),
                    hashlib.sha256).hexdigest()


def frame(*parts) -> bytes:
    body = msgpack.packb(parts, use_bin_type=True)
    return LEN.pack(len(body)) + body


BEAT_S = 1.0  # each side sends at least one frame this often
DEAD_S = 5.0  # a peer silent this long is gone (a host cut off: a killed process closes at once)


async def beat(writer: asyncio.StreamWriter, heard: Callable[[], float], reading: asyncio.Task) -> None:
    """Beat every BEAT_S over `writer`; once the peer has been silent for DEAD_S (`heard`: the loop
    time of its last frame), stop `reading`, the task serving the connection."""
    loop, frame_ = asyncio.get_running_loop(), frame(BEAT)
    while not writer.is_closing():
        if loop.time() - heard() > DEAD_S:
            reading.cancel()
            return
        writer.write(frame_)
        await asyncio.sleep(BEAT_S)


def unframe(body: bytes) -> list:
    try:
        parts = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as e:
        raise BadFrame(f"not a msgpack frame ({type(e).__name__})") from None
    if not isinstance(parts, list) or not parts or not isinstance(parts[0], str):
        raise BadFrame("not a channel frame")
    return parts


# -- typed messages, flattened ---------------------------------------------------------------------

def pack_request(r: NewRequest) -> list:
    q = r.request
    return [q.request_id, q.prompt_ids, [getattr(q.params, n) for n in _PARAMS], q.output_ids, q.priority,
            q.session, r.handle, r.prefill_id]


def unpack_request(a: list) -> NewRequest:
    rid, prompt, params, output, priority, session, handle, prefill_id = a
    return NewRequest(Request(rid, prompt, SamplingParams(*params), output, priority, session), handle, prefill_id)


def pack_answer(a) -> list | None:
    match a:
        case None:
            return None
        case Refusal():
            return ["refusal", a.param, a.message]
        case Unpaired():
            return ["unpaired", a.worker, a.peer]
        case ReserveResult():
            return ["reserve", a.handle, pack_answer(a.refused), pack_answer(a.unpaired)]
    raise TypeError(f"no channel encoding for an answer of type {type(a).__name__}")


def unpack_answer(a: list | None):
    if a is None:
        return None
    match a[0]:
        case "refusal":
            return Refusal(a[1], a[2])
        case "unpaired":
            return Unpaired(a[1], a[2])
        case "reserve":
            return ReserveResult(a[1], unpack_answer(a[2]), unpack_answer(a[3]))
    raise BadFrame(f"unknown answer {a[0]!r}")


def pack_delta(d: RequestDelta) -> list:
    lp = [[t.token_id, t.logprob, t.top, t.text, t.top_texts] for t in d.logprobs] if d.logprobs else None
    return [d.request_id, d.text, d.token_ids, d.finish_reason, d.error, lp, d.stop_reason]


def unpack_delta(a: list) -> RequestDelta:
    rid, text, ids, reason, error, lp, stop_reason = a
    logprobs = [TokenLogprob(t, p, [tuple(x) for x in top], s, texts) for t, p, top, s, texts in lp] if lp else ()
    return RequestDelta(rid, text, ids, reason, error, logprobs, stop_reason=stop_reason)
