"""What Ray's own config knobs save an idle async actor: one actor per variant, started side by side
(the same window, the same noise), each with its RAY_* variables in its runtime_env, measured from
/proc. --calls-per-s N: each also calls another actor N times a second (a router's stats poll).

    python -m pdserve.benchmarks.ray_idle_knobs --calls-per-s 0 --seconds 60

The knobs' names are Ray 2.60's (strings of ray/_raylet.so: RAY_event_stats,
RAY_enable_metrics_collection, RAY_metrics_report_interval_ms, RAY_task_events_report_interval_ms);
Ray reads RAY_<name> when a worker process starts."""

import argparse
import asyncio
import os
import time

import ray

VARIANTS = {
    "default": {},
    "event_stats=0": {"RAY_event_stats": "0"},
    "metrics=0": {"RAY_enable_metrics_collection": "0"},
    "metrics_60s": {"RAY_metrics_report_interval_ms": "60000"},
    "task_events=0": {"RAY_task_events_report_interval_ms": "0"},
    "all": {"RAY_event_stats": "0", "RAY_enable_metrics_collection": "0", "RAY_task_events_report_interval_ms": "0"},
}


@ray.remote
class Target:
    async def stats(self):
        return {"a": 1}


@ray.remote
class Probe:
    def __init__(self, target, calls_per_s: float):
        self.target, self.every = target, (1.0 / calls_per_s if calls_per_s else None)

    async def start(self) -> int:
        if self.every:
            self._poll = asyncio.get_running_loop().create_task(self._calls())
        return os.getpid()

    async def _calls(self):
        while True:
            await self.target.stats.remote()
            await asyncio.sleep(self.every)


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls-per-s", type=float, default=0.0)
    p.add_argument("--seconds", type=float, default=60.0)
    args = p.parse_args()
    ray.init(include_dashboard=False, logging_level="WARNING")
    target = Target.options(num_cpus=0).remote()
    probes = {}
    for name, env in VARIANTS.items():
        a = Probe.options(num_cpus=0, runtime_env={"env_vars": env} if env else None).remote(target, args.calls_per_s)
        probes[name] = (a, ray.get(a.start.remote()))
    time.sleep(10)  # past their start
    before = {n: cpu_s(pid) for n, (_, pid) in probes.items()}
    time.sleep(args.seconds)
    for n, (_, pid) in probes.items():
        print(f"{n:16s} {100 * (cpu_s(pid) - before[n]) / args.seconds:5.2f} % of a core")
    ray.shutdown()


if __name__ == "__main__":
    main()
