"""The colocated worker (a Ray actor): one engine doing both phases (continuous batching, chunked
prefill), the baseline every disaggregated figure is compared with. A request goes
in whole; new tokens go back to each router once per step, as from a decode worker."""

from pdserve.config import EngineConfig
from pdserve.protocol import InvalidRequestError
from pdserve.worker.engine_loop import IDLE_S
from pdserve.messages import NewRequest, Refusal
from pdserve.worker.inbox import Abort, Generate
from pdserve.worker.engine_worker import EngineWorker
from pdserve.worker.router_streams import RouterStreams


class ColocatedWorker(EngineWorker):
    role = "colocated"

    def __init__(self, name: str, engine_config: EngineConfig, namespace: str, cpu_threads: int = 1, tp=None):
        """`tp`: a TPRank (rank 0) when the replica is tensor parallel (pdserve/worker/tp_group.py)."""
        super().__init__(name, engine_config, None, cpu_threads, tp=tp)  # no KV connector: its KV never leaves
        self.streams = RouterStreams(namespace, orphaned=self.abort)  # a dead router's requests stop
        self._start_loop()

    def generate(self, requests: list[NewRequest], router: str) -> list[Refusal | None]:
        """Queue requests whose output streams to `router`; returns at once, without waiting for
        a step. The engine queues what its KV cache cannot take yet, so a replica is never full:
        only a request that is unacceptable in itself is refused (its entry)."""
        answers = []
        for r in requests:
            answers.append(self._refusal(r))
            if answers[-1] is None:
                self.loop.submit(Generate(r.request, router))
        return answers

    def _take(self, item) -> None:
        match item:
            case Generate():
                self.streams.add(item.request_id, item.router)
                try:
                    self.engine.add(item.request)
                except InvalidRequestError as e:  # what only the engine knows, e.g. an id in use
                    self.streams.fail(item.request_id, str(e))
            case Abort() if self.streams.drop(item.request_id):
                self.engine.abort(item.request_id)
                self.aborted += 1

    def _held(self) -> int:
        return len(self.streams)

    def _step(self) -> float | None:
        if self.tp_group is not None:
            self.tp_group.keepalive()  # the followers' wait for a step has a deadline, steps or none
        if not self.engine.has_unfinished():
            return self.streams.flush_nap(IDLE_S)  # the last tokens may still wait for a router
        for out in self.engine.step():
            self.streams.output(out)
        return self.streams.flush_nap(None)
