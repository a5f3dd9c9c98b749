"""The channel's frames: a 4-byte big-endian length, then one msgpack array whose first element
names the frame. Every frame carries the typed messages of pdserve/messages.py, flattened to
arrays here and rebuilt on the other side, so neither end passes loose dicts on.

Over TCP (across hosts) every frame after the hello is sealed (AES-256-GCM, pdserve/frame_seal.py,
the KV TCP backend's sealing): the length, then the msgpack array encrypted and its tag, under a
key per direction derived from the cluster's token and the hello's two nonces (the worker's and
the router's), so a frame replayed, reordered, injected or changed does not open. A Unix socket
(one host) carries them as they are: no other host sees its bytes, and its 0700 directory keeps the
host's other users from connecting.

Router -> worker: HELLO (once: its name, a proof of the cluster token over both nonces, its nonce),
CALLS (one turn's requests or aborts for one worker, batched), TAKEN (a DELTAS frame was delivered:
the worker sends the next; meanwhile it joins the steps' output), BEAT. Worker -> router: WELCOME (the
hello's answer), ANSWERS (one per answered CALLS), DELTAS (one engine step's output for that
router's requests, or the joined output of the steps since the router took the last), BEAT."""

import asyncio
import hashlib
import hmac
import struct
from collections.abc import Callable
from dataclasses import fields

import msgpack

from pdserve.frame_seal import Sealer, session_key
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


def hello_proof(token: str | None, nonces: bytes, router: str, worker: str) -> str:
    """What a router sends to prove it holds the cluster's token (an HMAC: the token never travels);
    nonces: the worker's, then the router's."""
    return hmac.new((token or "").encode(), b"pdserve-channel:" + nonces + f"{router}>{worker}".encode(),
                    hashlib.sha256).hexdigest()


def session_keys(token: str | None, nonces: bytes, router: str, worker: str) -> tuple[bytes, bytes]:
    """The keys of one TCP connection's sealed frames: (router to worker, worker to router)."""
    label = b"pdserve-channel-session:"
    return session_key(token, label, nonces, router, worker), session_key(token, label, nonces, worker, router)


def pack(*parts) -> bytes:
    """One frame's body (before any sealing)."""
    return msgpack.packb(parts, use_bin_type=True)


def frame(*parts) -> bytes:
    """One frame as it goes unsealed (the hello and its answer; a Unix socket's frames)."""
    body = pack(*parts)
    return LEN.pack(len(body)) + body


class Link:
    """One connection's frames after the hello, either end: sealed both ways over TCP (`keys`: ours,
    then the peer's), as they are over a Unix socket (None). Written on the connection's loop only:
    a frame's number is its place in the stream."""

    def __init__(self, writer: asyncio.StreamWriter, keys: tuple[bytes, bytes] | None):
        self.writer = writer
        self._out, self._in = (Sealer(keys[0]), Sealer(keys[1])) if keys else (None, None)

    def write(self, body: bytes) -> None:
        """Send one frame's body (pack()'s), sealed where the connection is."""
        self.writer.write(self.framed(body))

    def framed(self, body: bytes) -> bytes:
        """One frame's bytes as they go on the connection (sealed where it is): call in the order
        the frames are sent, a sealed frame's number is its place in the stream."""
        if self._out is not None:
            body = self._out.seal(body)
        return LEN.pack(len(body)) + body

    def send(self, *parts) -> None:
        self.write(pack(*parts))

    def write_if_open(self, body: bytes) -> None:
        if not self.writer.is_closing():
            self.write(body)

    def open(self, data: bytes) -> bytes:
        """The body of the frame in `data` (what followed its length), for unframe(); raises
        frame_seal.BadSeal where a sealed frame is not the peer's next as sent."""
        return self._in.open(data) if self._in is not None else data


BEAT_S = 1.0  # each side sends at least one frame this often
DEAD_S = 5.0  # a peer silent this long is gone (a host cut off: a killed process closes at once)


async def beat(link: Link, heard: Callable[[], float], reading: asyncio.Task) -> None:
    """Beat every BEAT_S over `link`; once the peer has been silent for DEAD_S (`heard`: the loop
    time of its last frame), stop `reading`, the task serving the connection."""
    loop, body = asyncio.get_running_loop(), pack(BEAT)
    while not link.writer.is_closing():
        if loop.time() - heard() > DEAD_S:
            reading.cancel()
            return
        link.write(body)
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


_new_tuple = tuple.__new__


def unpack_delta(a: list) -> RequestDelta:
    rid, text, ids, reason, error, lp, stop_reason = a
    logprobs = [TokenLogprob(t, p, [tuple(x) for x in top], s, texts) for t, p, top, s, texts in lp] if lp else ()
    # Built as the tuple it is: a router takes one per stream per step, and the NamedTuple's own
    # __new__ (keywords, defaults) costs a third of this call. Every field given, in its order.
    return _new_tuple(RequestDelta, (rid, text, ids, reason, error, logprobs, False, stop_reason))
