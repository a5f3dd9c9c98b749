"""Streams a prefill engine's KV to decode workers layer by layer, as each layer is computed.

Installs itself as the engine's layer hook. A block is sent once, when it is full (or when it is
the prompt's last block), so a chunked prefill never writes the same block twice: two writes of
one block could land out of order. The leading blocks the decode engine holds already (its prefix
cache: the handle's `cached_blocks`) are computed here as the rest (where this engine's own prefix
cache does not hold them) but never sent.
"""

from pdserve.engine.engine import Engine
from pdserve.engine.outputs import RequestOutput
from pdserve.messages import Request
from pdserve.engine.scheduler import ScheduledSeq

from pdserve.kvtransfer import PrefillConnector, ReserveHandle


class KVStreamer:
    def __init__(self, engine: Engine, connector: PrefillConnector):
        assert engine.config.role == "prefill"
        self.engine = engine
        self.connector = connector
        self.handles: dict[str, ReserveHandle] = {}
        self._sent: dict[str, int] = {}  # blocks already queued, per request
        self._step_ranges: dict[str, tuple[int, int]] = {}
        engine.layer_hook = self._on_layer

    def add(self, request: Request, handle: ReserveHandle) -> None:
        """Prefill a request whose decode-side blocks are reserved (handle). A resumed request's
        `output_ids` are prefilled after the prompt, and their blocks streamed with its."""
        self.engine.add(request)
        self.handles[request.request_id] = handle
        self._sent[request.request_id] = handle.cached_blocks  # the decode side has those

    def abort(self, request_id: str) -> None:
        """Stop a request here and on its decode worker; frees our blocks."""
        handle = self.handles.pop(request_id, None)
        if handle is not None:
            self._sent.pop(request_id, None)
            self.engine.abort(request_id)
            self.connector.release(request_id, handle)

    def step(self) -> tuple[list[RequestOutput], list[str], list[str]]:
        """One engine step, then: (prefill outputs, requests delivered, requests failed)."""
        self._step_ranges.clear()
        if self.handles and not self.engine.has_unfinished():
            self.connector.wait(0.005)  # only transfers left: wait without holding the GIL
        outputs = self.engine.step()
        for out in outputs:
            if out.error is not None and out.request_id in self.handles:
                # It cannot run (its grammar did not compile): the decode side fails it (KV_FAILED).
                self._sent.pop(out.request_id, None)
                self.connector.release(out.request_id, self.handles.pop(out.request_id))
            elif out.request_id in self.handles:
                # The first token's logprob (where asked for) goes with it: the decode side streams it.
                lp = out.logprobs[0] if out.logprobs else None
                self.connector.finish(out.request_id, out.token_ids[0],
                                      None if lp is None else (lp.logprob, lp.top))
        done, failed = self.connector.poll()
        for rid in done + failed:
            if self.handles.pop(rid, None) is not None:
                self._sent.pop(rid, None)
                self.engine.release(rid)  # our copy of the KV is no longer needed
        return outputs, done, failed

    def busy(self) -> bool:
        return bool(self.handles)

    def _on_layer(self, layer: int, scheduled: list[ScheduledSeq]) -> None:
        if layer == 0:
            self._plan(scheduled)
        for s in scheduled:
            r = self._step_ranges.get(s.seq.request_id)
            if r is not None:
                lo, hi = r
                self.connector.send_layer(s.seq.request_id, layer, s.seq.block_ids[lo:hi],
                                          self.handles[s.seq.request_id], first=lo)

    def _plan(self, scheduled: list[ScheduledSeq]) -> None:
        """Which blocks of each request become complete in this step."""
        bs = self.engine.config.block_size
        for s in scheduled:
            rid = s.seq.request_id
            if rid not in self.handles:
                continue
            end = s.seq.num_computed_tokens + s.num_new_tokens
            hi = -(-end // bs) if s.samples else end // bs
            lo = self._sent[rid]
            if hi > lo:
                self._step_ranges[rid] = (lo, hi)
                self._sent[rid] = hi
