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
from collections.abc import Callable

import ray
import torch

from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.messages import WorkerStartup
from pdserve.engine.warm_up import warm_up_attention
from pdserve.priority import back_to, yield_while_starting
from pdserve.worker.engine_worker import assigned_device
from pdserve.worker.tp_group import TPGroup, TPRank, join_tp_group

log = logging.getLogger(__name__)


class TPFollower:
    def __init__(self, name: str, engine_config: EngineConfig, me: TPRank, cpu_threads: int = 1):
        self._began = (time.time(), time.perf_counter())  # for startup(): the process is up, its imports done
        priority = yield_while_starting()  # as rank 0 (pdserve/priority.py): a slow rank slows every step
        if engine_config.device == "cpu":
            torch.set_num_threads(cpu_threads)
        self.name = name
        engine_config = engine_config.model_copy(update={"device": assigned_device(engine_config.device)})
        self.group = join_tp_group(me, engine_config.device)
        # Built in step with rank 0's: the KV cache's size is agreed and CUDA graphs are captured
        # bucket by bucket together (their warm-up forwards' all-reduces pair up).
        self.engine = Engine(engine_config, tp=self.group.tp)
        if engine_config.role == "prefill":
            self.group.stage_kv(self.engine)  # this rank's heads go to rank 0's staging cache each step
        if engine_config.warm_up if engine_config.warm_up is not None else self.engine.device.type == "cuda":
            warm_up_attention(self.engine)  # what rank 0's warm-up (EngineWorker._warm_up) compiles outside its steps
        self.steps = 0
        self.error: BaseException | None = None
        back_to(priority)  # every thread the start made; the follower's own is made after
        self._thread = threading.Thread(target=self._run, name=f"{name}-follow", daemon=True)
        self._thread.start()
        self._ready_s = time.perf_counter() - self._began[1]

    def _run(self) -> None:
        try:
            follow_steps(self.group, self.engine, self._stepped)
        except BaseException as e:
            log.exception("%s: the follower loop died", self.name)
            self.error = e
            if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
                sys.stderr.flush()
                os._exit(70)

    def _stepped(self) -> None:
        self.steps += 1

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


@torch.inference_mode()
def follow_steps(group: TPGroup, engine: Engine, stepped: Callable[[], None] = lambda: None) -> int:
    """Run every step rank 0 sends on this rank's engine until rank 0 says STOP (`stepped` called
    after each); how many steps ran."""
    if engine.device.type == "cuda":  # a thread starts on GPU 0; Triton launches on the current one
        torch.cuda.set_device(engine.device)
    steps = 0
    while True:
        batch = group.receive(engine.kv_cache, engine.layout.scales)
        if batch is None:
            continue  # rank 0 is idle
        if isinstance(batch, str):  # STOP
            return steps
        # Rank 0's path for the batch (a decode graph's replay, or eager): the same collectives.
        engine.runner.forward(batch)
        steps += 1
        stepped()
