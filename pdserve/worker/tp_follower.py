"""A rank > 0 of a tensor-parallel replica (a Ray actor): its slice of the model and its heads' KV
cache, and a thread that runs each forward rank 0 broadcasts (pdserve/worker/tp_group.py). It takes
no requests and answers no router: rank 0 is the replica. If its loop dies (rank 0 gone, a
collective past its deadline), the process exits, so rank 0's next collective fails and the
controller replaces the whole replica."""

import logging
import os
import sys
import threading
import time

import ray
import torch

from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.messages import WorkerStartup
from pdserve.worker.tp_group import TPRank, join_tp_group

log = logging.getLogger(__name__)


class TPFollower:
    def __init__(self, name: str, engine_config: EngineConfig, me: TPRank, cpu_threads: int = 1):
        self._began = (time.time(), time.perf_counter())  # for startup(): the process is up, its imports done
        if engine_config.device == "cpu":
            torch.set_num_threads(cpu_threads)
        self.name = name
        self.group = join_tp_group(me)
        self.engine = Engine(engine_config, tp=self.group.tp)
        if engine_config.role == "prefill":
            self.group.stage_kv(self.engine)  # this rank's heads go to rank 0's staging cache each step
        self.steps = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"{name}-follow", daemon=True)
        self._thread.start()
        self._ready_s = time.perf_counter() - self._began[1]

    @torch.inference_mode()
    def _run(self) -> None:
        try:
            while True:
                step = self.group.receive()
                if step is None:
                    continue  # rank 0 is idle
                batch = step.forward_batch(self.engine.kv_cache, self.engine.layout.scales)
                self.group.follow(batch)
                self.engine.model(batch)
                self.steps += 1
        except BaseException as e:
            log.exception("%s: the follower loop died", self.name)
            self.error = e
            if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
                sys.stderr.flush()
                os._exit(70)

    def ready(self) -> bool:
        return self._thread.is_alive()

    def startup(self) -> WorkerStartup:
        """What this rank's start took (its slice of the weights, its engine), as a replica's workers say."""
        w = self.engine.load_stats
        return WorkerStartup(self.name, self._began[0], w.source, w.files, w.bytes, w.weights_s, w.total_s,
                             self.engine.graphs_s, self._ready_s)

    def node(self) -> dict:
        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address()}

    def info(self) -> dict:
        return {"steps": self.steps, "alive": self._thread.is_alive(), "error": repr(self.error)}
