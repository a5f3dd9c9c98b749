"""What the prefill end's threads hand each other: the ops its posting thread takes, and the
per-request Transfer record they carry."""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from pdserve.kvtransfer.backend import Part
from pdserve.kvtransfer.wire import FirstLogprob, ReserveHandle


class State(Enum):
    """Where a Transfer is: open -> (finishing) -> done | failed."""

    OPEN = "open"  # layers are being posted
    FINISHING = "finishing"  # every layer posted; a completion thread waits for the copies
    DONE = "done"
    FAILED = "failed"


@dataclass
class Transfer:
    """One request's posts into a decode engine's blocks."""

    handle: ReserveHandle
    tokens: list = field(default_factory=list)  # the backend's handles of its posts
    notice: bytes | None = None  # the packed finish notice, set by finish(): sent the moment the copies end
    nbytes: int = 0
    started: float = field(default_factory=time.monotonic)  # when the caller posted its first layer
    state: State = State.OPEN


@dataclass
class PostLayers:
    """Layers of one request to post once `ready` (an event after the kernels that wrote them) is done."""

    request_id: str
    parts: list[Part]
    handle: ReserveHandle
    ready: torch.cuda.Event | None  # None where the KV is on the CPU
    nbytes: int  # KV bytes of the parts
    posted: float  # time.monotonic() of the caller's send: where the transfer's clock starts

    def then(self, later: "PostLayers") -> "PostLayers":
        """This post and the request's next as one; events complete in stream order, so waiting for
        the newer covers the older."""
        return PostLayers(self.request_id, self.parts + later.parts, later.handle, later.ready or self.ready,
                          self.nbytes + later.nbytes, self.posted)


@dataclass
class Opened:
    """Inline posting: the request's first post is on its way; here is its record."""

    request_id: str
    transfer: Transfer


@dataclass
class PostFailed:
    """Inline posting: the backend refused a post of this request."""

    request_id: str
    handle: ReserveHandle


@dataclass
class Finish:
    """Every layer of the request is posted: tell the decode end once they have landed."""

    request_id: str
    first_token: int
    first_logprob: FirstLogprob | None


@dataclass
class Release:
    """The prefill side aborts the request (handle: for one that posted nothing yet)."""

    request_id: str
    handle: ReserveHandle | None


@dataclass
class Settled:
    """The completion thread is through with this transfer: its tokens may be released."""

    request_id: str
    transfer: Transfer


@dataclass
class Call:
    """Run fn on the posting thread (backend calls stay on one thread); the caller waits for `done`."""

    fn: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as e:  # handed back to the caller
            self.error = e
        self.done.set()

    def wait(self) -> Any:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


@dataclass
class Died:
    """The completion thread died of `error`: the posting thread dies with it (no finished transfer
    would complete any more)."""

    error: BaseException


Op = PostLayers | Opened | PostFailed | Finish | Release | Settled | Call | Died
