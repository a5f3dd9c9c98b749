"""The prefill worker (a Ray actor): the engine in its prefill role, streaming KV to decode workers."""

from pdserve.kvtransfer import ReserveHandle
from pdserve.config import EngineConfig
from pdserve.messages import NewRequest, Refusal, Unpaired
from pdserve.protocol import InvalidRequestError
from pdserve.worker.engine_loop import IDLE_S
from pdserve.worker.inbox import Abort, Prefill
from pdserve.worker.engine_worker import EngineWorker
from pdserve.prefill.kv_stream import KVStreamer

RECENT_TRANSFERS = 1024  # transfer records kept for readers of stats()


class PrefillWorker(EngineWorker):
    role = "prefill"

    def __init__(self, name: str, engine_config: EngineConfig, kv_backend: str, cpu_threads: int = 1,
                 cluster_token: str | None = None, tp=None, engine=None):
        """`tp`: a TPRank (rank 0) when the replica is tensor parallel (pdserve/worker/tp_group.py).
        `engine`: a decode worker's, taken over by a flip (EngineWorker)."""
        super().__init__(name, engine_config, kv_backend, cpu_threads, cluster_token=cluster_token, tp=tp,
                         engine=engine)
        self.streamer = KVStreamer(self.engine, self.connector)
        self._transfers: list[tuple[int, float]] = []
        self._transfers_total = 0
        self._start_loop()

    def prefill(self, requests: list[NewRequest]) -> list[Refusal | Unpaired | None]:
        """Prefill requests into the decode blocks their handles name; returns at once, without
        waiting for a step (per request None, why this replica can never run it, or Unpaired)."""
        answers = []
        for r in requests:
            answers.append(self._refusal(r))
            handle = ReserveHandle.unpack(r.handle)
            if answers[-1] is None and handle.engine_id not in self.connector.peers:
                # No handshake with the decode worker holding its blocks: its KV could not move. Said
                # at once (the router aborts the reservation and places the request over another pair).
                answers[-1] = Unpaired(self.name, handle.engine_id)
            if answers[-1] is None:
                self.loop.submit(Prefill(r.request, handle))
        return answers

    def _take(self, item) -> None:
        match item:
            case Prefill():
                try:
                    self.streamer.add(item.request, item.handle)
                except InvalidRequestError:  # what only the engine knows, e.g. an id in use:
                    self.connector.release(item.request_id, item.handle)  # the decode side fails it
            case Abort() if item.request_id in self.streamer.handles:
                self.streamer.abort(item.request_id)
                self.aborted += 1

    def stats(self):
        done = self.connector.delivered()
        self._transfers = (self._transfers + done)[-RECENT_TRANSFERS:]
        self._transfers_total += len(done)
        s = super().stats()
        s.transfers, s.transfers_total = list(self._transfers), self._transfers_total
        return s

    def _cut_off(self, left: list) -> None:
        # Releasing a handle tells its decode end: the lease fails (KV_FAILED), the router moves it.
        for item in left:
            if isinstance(item, Prefill):
                self.connector.release(item.request_id, item.handle)
        for rid in list(self.streamer.handles):
            self.streamer.abort(rid)

    def _held(self) -> int:
        return len(self.streamer.handles)  # until their KV is delivered (or failed)

    def _step(self) -> float | None:
        if self.tp_group is not None:
            self.tp_group.keepalive()  # the followers' wait for a step has a deadline, steps or none
        if not (self.streamer.busy() or self.engine.has_unfinished()):
            return IDLE_S
        self.streamer.step()  # waits a little itself when only transfers are left
        return None
