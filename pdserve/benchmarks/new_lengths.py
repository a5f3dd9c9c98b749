"""What a prompt of a length the engine has not seen costs, against the same length again: the
first-time costs a warm-up must take before "ready" (kernel plans built per shape).

    python -m pdserve.benchmarks.new_lengths cluster.yaml                 # one GPU
    python -m pdserve.benchmarks.new_lengths cluster.yaml --sdpa cudnn flash

Builds the engine a colocated replica of cluster.yaml runs, runs its warm-up (engine/warm_up.py),
then for each length times the first token of a prompt of fresh ids three times in a row (first,
then twice more: the same-run reference), and a steady 4096-token prompt (median of 7). With
--sdpa, once per SDPA backend allowed for fresh prompts' attention (cudnn: torch's default pick,
flash: cuDNN off), each with lengths the other has not run.
"""

import argparse
import json
import time

import torch

from pdserve.config import load_cluster_config
from pdserve.engine.engine import Engine
from pdserve.engine.warm_up import warm_up
from pdserve.protocol import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--lengths", type=int, nargs="+", default=[129, 1001, 2049, 4095])
    ap.add_argument("--sdpa", nargs="+", choices=["default", "cudnn", "flash"], default=["default"])
    a = ap.parse_args()
    cfg = load_cluster_config(a.config).engine_config("colocated")
    engine = Engine(cfg)
    warmed = warm_up(engine, print)
    n = 0

    def first_token_ms(length: int) -> float:
        nonlocal n
        n += 1
        ids = [3 + (n * 131 + i * 17) % 250 for i in range(length)]  # fresh ids: no prefix-cache hit
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.add_request(f"r{n}", ids, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        first = None
        while engine.has_unfinished():
            if engine.step() and first is None:
                first = time.perf_counter()
        return round((first - t0) * 1e3, 1)

    rows = []
    for k, mode in enumerate(a.sdpa):
        if mode != "default":
            torch.backends.cuda.enable_cudnn_sdp(mode == "cudnn")
        for length in a.lengths:
            length += k  # a length no earlier mode ran
            rows.append({"sdpa": mode, "length": length, "first_ms": first_token_ms(length),
                         "then_ms": [first_token_ms(length), first_token_ms(length)]})
            print(rows[-1], flush=True)
        rows.append({"sdpa": mode, "length": 4096, "steady_median_ms": sorted(first_token_ms(4096) for _ in range(7))[3]})
        print(rows[-1], flush=True)
    print(json.dumps({"warm_up_s": round(warmed.seconds, 1), "rows": rows}))


if __name__ == "__main__":
    main()
