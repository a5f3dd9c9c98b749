"""A large JSON schema's compile against the engine's steps: does it stall the other sequences?

    python -m pdserve.benchmarks.grammar_compile [--model tiny-moe] [--device cpu] [--batch 8]
                                                 [--groups 30] [--fields 250] [--repeat 3] [--threads 1]

B free sequences decode; then a request under a big schema (`--groups` objects of `--fields` optional
string fields, each its own pattern: llguidance's compile grows with fields squared) arrives. Printed:
the schema's compile alone (the router's grammar build + check, and the engine's matcher, each timed
on its own), the median step of the free batch before it arrived (the reference), and the longest step
from its arrival until its first token: with the compile on the step path that step carries the
whole compile; compiled ahead (engine/grammar_gate.py) it stays a plain step. Torch runs `--threads`
threads, as a worker's engine does (`cpu_threads`, 1 by default): the compile's thread takes another core.
Uses only the engine's public calls, so the same script measures an older checkout (the figure before)."""

import argparse
import datetime
import statistics
import time

import torch

from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.protocol import SamplingParams
from pdserve.structured_outputs import json_schema_grammar


def wide_schema(groups: int, fields: int) -> dict:
    return {"type": "object", "additionalProperties": False, "required": [f"g{j}" for j in range(groups)],
            "properties": {f"g{j}": {"type": "object", "additionalProperties": False, "properties": {
                f"f{j}_{i}": {"type": "string", "pattern": f"^[a-z]{{1,{3 + i % 9}}}-[0-9]{{{1 + i % 4}}}$"}
                for i in range(fields)}} for j in range(groups)}}


def _timed_step(engine: Engine, gaps: list[float]) -> list:
    t = time.perf_counter()
    outs = engine.step()
    gaps.append(time.perf_counter() - t)
    return outs


def run(engine: Engine, grammar: str, batch: int, k: int) -> tuple[float, float, float]:
    """(median free step, longest step from the schema request's arrival to its first token, that wait)."""
    free = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"free-{k}-{i}", f"free sequence {i}", free)
    before: list[float] = []
    for _ in range(30):
        _timed_step(engine, before)
    rid = f"schema-{k}"
    arrived = time.perf_counter()
    engine.add_request(rid, "answer in JSON", SamplingParams(max_tokens=2, temperature=0, grammar=grammar))
    during: list[float] = []
    while not any(o.request_id == rid for o in _timed_step(engine, during)):
        pass
    waited = time.perf_counter() - arrived
    for i in range(batch):
        engine.abort(f"free-{k}-{i}")
    while engine.has_unfinished():
        engine.step()
    return statistics.median(before[10:]), max(during), waited


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-moe")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--groups", type=int, default=30)
    ap.add_argument("--fields", type=int, default=250)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    engine = Engine(EngineConfig(model=ModelConfig(path=a.model), device=a.device, num_kv_blocks=1024))
    schema = wide_schema(a.groups, a.fields)
    t = time.perf_counter()
    grammar = json_schema_grammar("json", schema)
    router_s = time.perf_counter() - t
    engine.generate(["warm"], SamplingParams(max_tokens=2, temperature=0, grammar=json_schema_grammar(
        "json", {"type": "object"})))  # (the tokenizer's llguidance side, built once per engine)
    print(f"{datetime.date.today()} {a.model} on {a.device} ({a.threads} torch threads), batch {a.batch}, schema {a.groups} x {a.fields} "
          f"optional fields ({len(grammar)} chars of grammar); router build + check {router_s * 1e3:.0f} ms")
    for k in range(a.repeat):
        step, longest, waited = run(engine, grammar, a.batch, k)
        print(f"run {k}: free step median {step * 1e3:.1f} ms; longest step until the schema request's "
              f"first token {longest * 1e3:.1f} ms ({longest / step:.1f}x); its first token after {waited * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
