"""The engine's own time to a first token for a lone prompt: the reference that a served lone
prompt's TTFT is put against (the serving path's share is the difference).

    python -m pdserve.benchmarks.lone_prompt cluster.yaml --prompt-len 4096 [128 ...] --reps 10

Builds the engine a colocated replica of cluster.yaml runs (same settings, in this process), then
for each overlap setting times `add_request` until the step that hands out the first token,
`--reps` times one prompt at a time (distinct random prompts: no prefix-cache hits), each after
`--gap-s` idle seconds. Overlapped
(a GPU's default), the first token is handed out only once the next step is queued: that step's
host work is part of the engine's own first-token time. `bench-engine`'s prefill figure is the
prefill step alone. `--after-load N` times the same again in the same engine after N requests at
once (what a load run leaves it: its blocks cached, its free runs scattered), then once more with
the prefix cache emptied; `--cached-prefix C ...` times each prompt again with its first C tokens
cached (what a shared system prompt or an earlier turn leaves). Each figure also counts the garbage
collector's passes during it.
"""

import argparse
import gc
import json
import random
import statistics
import time

import torch

from pdserve.config import load_cluster_config
from pdserve.engine.engine import Engine
from pdserve.protocol import SamplingParams


def first_token_ms(engine: Engine, ids: list[int], rid: str, gap_s: float = 0.0) -> float:
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    time.sleep(gap_s)  # the device and the host idle as between a served light load's requests
    t0 = time.perf_counter()
    engine.add_request(rid, ids, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    while not any(o.request_id == rid for o in engine.step()):
        pass
    ms = (time.perf_counter() - t0) * 1e3
    while engine.has_unfinished():  # let it finish: the next prompt starts on an idle engine
        engine.step()
    return ms


class _Collections:
    """The garbage collector's passes while it is on: how many, their longest and their sum (ms)."""

    def __init__(self):
        self.times: list[float] = []
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.times.append((time.perf_counter() - self._t0) * 1e3)

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)

    def summary(self) -> dict:
        return {"n": len(self.times), "max_ms": round(max(self.times, default=0), 2), "sum_ms": round(sum(self.times), 2)}


def _cached_first_token_ms(engine: Engine, ids: list[int], rid: str, cached: int, gap_s: float) -> float:
    """first_token_ms of `ids` after a request of its first `cached` tokens put them in the prefix cache."""
    if cached:
        first_token_ms(engine, ids[:cached], f"{rid}-primer")
    return first_token_ms(engine, ids, rid, gap_s)


def _lone(engine: Engine, a: argparse.Namespace, rng: random.Random, key: str, cached: int = 0) -> dict:
    out = {}
    vocab = engine.args.vocab_size
    for n in a.prompt_len:
        if cached >= n:
            continue
        engine.profile.reset()  # (the load before: not these prompts' steps)
        with _Collections() as collections:
            times = [_cached_first_token_ms(engine, [rng.randrange(3, vocab) for _ in range(n)], f"r{n}-{key}-{i}",
                                            cached, a.gap_s)
                     for i in range(a.reps + 2)][2:]  # two warm-ups
        # The engine's own step figures (what a served worker reports in its stats' profile too):
        # a served lone prompt's steps against these say whether the serving path slows the steps
        # themselves or only adds time around them.
        steps = {f"{phase}_{size}": round(1e3 * row[2] / row[0], 2)
                 for phase in ("prefill", "decode") for size, row in engine.profile.snapshot()[phase].items()}
        k = key + ("" if len(a.prompt_len) == 1 else f"_{n}")
        out[k] = {"p50": round(statistics.median(times), 2), "min": round(min(times), 2), "step_mean_ms": steps,
                  "gc": collections.summary()}
        print(k, out[k], flush=True)
    return out


def _load(engine: Engine, n: int, rng: random.Random, prompt_len: int = 256, answer_len: int = 256) -> None:
    """n requests at once, each of prompt_len random tokens and answer_len tokens, until all end."""
    t0 = time.perf_counter()
    vocab = engine.args.vocab_size
    for i in range(n):
        engine.add_request(f"load-{i}", [rng.randrange(3, vocab) for _ in range(prompt_len)],
                           SamplingParams(max_tokens=answer_len, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    print(f"load of {n} requests served in {time.perf_counter() - t0:.1f} s; {engine.pool.num_free_blocks} of "
          f"{engine.pool.num_blocks} blocks free, {len(engine.pool.cached)} cached", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[4096], help="one or more prompt lengths")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--gap-s", type=float, default=0.0,
                    help="idle seconds before each prompt (1: as `pdserve bench --rate 1` leaves the engine between "
                         "requests; a GPU idle that long starts its next kernels slower)")
    ap.add_argument("--overlap", choices=["on", "off", "both"], default="both",
                    help="overlap scheduling (on: a GPU's default); both: on, then off, one engine after the other")
    ap.add_argument("--after-load", type=int, default=0, metavar="N",
                    help="then N requests at once (256-token prompts and answers) and the lone prompts again; then "
                         "once more with the prefix cache emptied")
    ap.add_argument("--cached-prefix", type=int, nargs="*", default=[], metavar="TOKENS",
                    help="also each prompt with its first TOKENS tokens cached (a request of those first: the step "
                         "then reads its keys through the block tables, the varlen path), one figure per count")
    ap.add_argument("--json")
    a = ap.parse_args()
    cfg = load_cluster_config(a.config)
    base = cfg.engine_config("colocated")
    rng = random.Random(0)
    out: dict = {}
    for overlap in {"on": (True,), "off": (False,), "both": (True, False)}[a.overlap]:
        engine = Engine(base.model_copy(update={"overlap_scheduling": overlap}))
        key = f"overlap_{'on' if overlap else 'off'}_ms"
        out.update(_lone(engine, a, rng, key))
        for cached in a.cached_prefix:
            out.update(_lone(engine, a, rng, f"{key}_cached{cached}", cached))
        if a.after_load:
            # What a load run leaves (its blocks cached, the pool's free runs scattered) against the same
            # engine fresh: a served lone prompt after the bench's streams is timed in such an engine.
            _load(engine, a.after_load, rng)
            out.update(_lone(engine, a, rng, key + "_after_load"))
            engine.pool.reset_prefix_cache()
            out.update(_lone(engine, a, rng, key + "_after_load_cache_emptied"))
        # The next engine needs the memory this one's KV cache holds: its graphs and hooks keep it in
        # reference cycles, which only a collection frees (without it the second engine ran out of
        # memory on an H200).
        del engine
        gc.collect()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    print(json.dumps(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"prompt_len": a.prompt_len if len(a.prompt_len) > 1 else a.prompt_len[0], **out}, f)


if __name__ == "__main__":
    main()
