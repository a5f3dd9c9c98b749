"""Requests held out of the scheduler while their grammar compiles (engine/grammar.py, on its pool).

A request under a grammar cannot be sampled before its matcher exists, and building the matcher of a
large JSON schema takes seconds: built on the step path, it stalled every sequence of the step. So
the engine starts the compile as the request arrives (`Engine.add`, `Engine.reserve`) and holds it here
instead of queueing it: a request to compute (`Engine.add`) joins the scheduler's queue, and a decode
reservation whose KV has arrived starts decoding (`Engine.start_decode`), at the first step boundary
after its compile ends; the other requests step meanwhile. One whose grammar does not compile ends
there with an error output (its blocks freed, its router told why); a prefill engine's then releases
its decode reservation (prefill/kv_stream.py).
"""

from collections.abc import Callable

from pdserve.engine.grammar import Grammars
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sequence import FinishReason, Sequence
from pdserve.protocol import TokenLogprob

NAP_S = 0.005  # an engine with only compiles to wait for naps this long a step (never spins a core)


class GrammarGate:
    def __init__(self, grammars: Grammars, admit: Callable[[Sequence], None],
                 start: Callable[[str, int, TokenLogprob | None], None], drop: Callable[[str], None]):
        """admit(seq): queue it in the scheduler; start(request id, first token, its logprob): a decode
        reservation starts (Engine.start_decode); drop(request id): free a request that cannot run."""
        self._grammars = grammars
        self._admit, self._start, self._drop = admit, start, drop
        self._adds: dict[str, Sequence] = {}  # request id -> its sequence, to queue once compiled
        self._starts: dict[str, tuple[Sequence, int, TokenLogprob | None]] = {}  # to start decoding once compiled

    def __bool__(self) -> bool:
        """Requests are held here (the engine has work: a step lets them in or naps for them)."""
        return bool(self._adds or self._starts)

    def holds(self, seq: Sequence) -> bool:
        """Hold a request to compute until its grammar compiled; False: it may be queued now."""
        if not self._grammars.compiling(seq.request_id):
            return False
        self._adds[seq.request_id] = seq
        return True

    def holds_start(self, seq: Sequence, first_token: int, first_logprob: TokenLogprob | None) -> bool:
        """Hold a decode reservation whose KV is in place until its grammar compiled (its first token
        must be consumed by the matcher); False: it may start now."""
        if not self._grammars.compiling(seq.request_id):
            return False
        self._starts[seq.request_id] = (seq, first_token, first_logprob)
        return True

    def forget(self, request_id: str) -> None:
        """The request ended (aborted, released): nothing to let in."""
        self._adds.pop(request_id, None)
        self._starts.pop(request_id, None)

    def let_in(self) -> list[RequestOutput]:
        """At a step boundary: queue (or start) every held request whose grammar compiled, in arrival
        order; returns the error outputs of those whose grammar did not."""
        failed = []
        for rid in [r for r in self._adds if self._grammars.compiled(r)]:
            seq = self._adds.pop(rid)
            if (error := self._grammars.install(seq)) is None:
                self._admit(seq)
            else:
                failed.append(self._fail(seq, error))
        for rid in [r for r in self._starts if self._grammars.compiled(r)]:
            seq, token, logprob = self._starts.pop(rid)
            if (error := self._grammars.install(seq, then=(token,))) is None:
                self._start(rid, token, logprob)
            else:
                failed.append(self._fail(seq, error))
        return failed

    def nap(self) -> None:
        """Nothing else to step: wait (without the GIL) until a compile ends, at most NAP_S."""
        self._grammars.wait(NAP_S)

    def _fail(self, seq: Sequence, error: str) -> RequestOutput:
        self._drop(seq.request_id)
        return RequestOutput(seq.request_id, [], "", finished=True, finish_reason=FinishReason.ERROR,
                             num_prompt_tokens=seq.num_prompt_tokens, error=error)
