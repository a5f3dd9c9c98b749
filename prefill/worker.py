"""The prefill worker (a Ray actor): the engine in its prefill role, streaming KV to decode workers."""

import torch

from kvtransfer import ReserveHandle, make_connector
from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine_loop import EngineLoop
from pdserve.messages import ReplicaStats
from prefill.kv_stream import KVStreamer


IDLE_S = 0.1  # nap of an idle worker; new work wakes it at once


class PrefillWorker:
    def __init__(self, name: str, engine_config: EngineConfig, kv_backend: str, cpu_threads: int = 1):
        if engine_config.device == "cpu":
            torch.set_num_threads(cpu_threads)  # several workers share the host's cores
        self.name = name
        self.engine = Engine(engine_config)
        self.connector = make_connector("prefill", kv_backend, name, self.engine.kv_cache, self.engine.layout,
                                        self.engine.fingerprint)
        self.streamer = KVStreamer(self.engine, self.connector)
        self.aborted = 0
        self.loop = EngineLoop(self._step, f"{name}-engine")

    def ready(self) -> bool:
        return self.loop.alive()

    def metadata(self) -> bytes:
        return self.connector.metadata()

    def add_peer(self, meta: bytes) -> str:
        return self.connector.add_peer(meta)

    def prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams, handle: bytes) -> None:
        """Prefill a request into the decode blocks its handle names; returns at once."""
        with self.loop.lock:
            self.streamer.add(request_id, prompt_ids, params, ReserveHandle.unpack(handle))
        self.loop.wake()

    def abort(self, request_id: str) -> None:
        with self.loop.lock:
            if request_id in self.streamer.handles:
                self.streamer.abort(request_id)
                self.aborted += 1

    def stats(self) -> ReplicaStats:
        e = self.engine
        return ReplicaStats(self.name, "prefill", len(e.scheduler.running), len(e.scheduler.waiting),
                            e.pool.num_free_blocks, e.pool.num_blocks, self.aborted)

    def _step(self) -> float | None:
        if not (self.streamer.busy() or self.engine.has_unfinished()):
            return IDLE_S
        self.streamer.step()  # waits a little itself when only transfers are left
        return None
