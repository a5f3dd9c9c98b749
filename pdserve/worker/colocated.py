"""The colocated worker (a Ray actor): one engine doing both phases (continuous batching, chunked
prefill), the baseline every disaggregated figure is compared with. A request goes
in whole; new tokens go back to each router once per step, as from a decode worker."""

from pdserve.config import EngineConfig
from pdserve.hop_trace import hop
from pdserve.worker.engine_loop import IDLE_S
from pdserve.worker.engine_worker import EngineWorker
from pdserve.worker.inbox import Abort, Generate
from pdserve.worker.router_streams import RouterStreams
from pdserve.worker.whole_requests import WholeRequests


class ColocatedWorker(WholeRequests, EngineWorker):
    role = "colocated"

    def __init__(self, name: str, engine_config: EngineConfig, namespace: str, cpu_threads: int = 1, tp=None,
                 cluster_token: str | None = None):
        """`tp`: a TPRank (rank 0) when the replica is tensor parallel (pdserve/worker/tp_group.py).
        `cluster_token`: what routers prove over the direct channel."""
        super().__init__(name, engine_config, None, cpu_threads, tp=tp,  # no KV connector: its KV never leaves
                         cluster_token=cluster_token)
        self.streams = RouterStreams(namespace, orphaned=self.abort)  # a dead router's requests stop
        self._start_loop()

    def _take(self, item) -> None:
        match item:
            case Generate():
                self._take_whole(item)
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
        hop("outputs")
        return self.streams.flush_nap(None)
