"""A router imports the workers' actor modules while they load, not when it starts serving."""

import sys

from pdserve.config import ClusterConfig, ModelConfig
from pdserve.control.launcher import WORKER_MODULES
from pdserve.decode.worker import DecodeWorker
from pdserve.prefill.worker import PrefillWorker
from pdserve.router.server import Router
from pdserve.worker.colocated import ColocatedWorker


def test_each_role_names_the_module_its_workers_class_lives_in():
    assert WORKER_MODULES == {"prefill": PrefillWorker.__module__, "decode": DecodeWorker.__module__,
                              "colocated": ColocatedWorker.__module__}


def test_a_router_imports_what_it_is_given_on_a_thread_and_survives_a_missing_module(tmp_path, monkeypatch):
    (tmp_path / "pdserve_preload_probe.py").write_text("LOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "pdserve_preload_probe" not in sys.modules
    router = Router("pdserve-router-0", ClusterConfig(model=ModelConfig(path="tiny-moe")), [], "pdserve-test",
                    preload=["pdserve_no_such_module", "pdserve_preload_probe"])
    router.preloaded.join(timeout=30)
    assert not router.preloaded.is_alive()
    assert sys.modules["pdserve_preload_probe"].LOADED
    del sys.modules["pdserve_preload_probe"]
