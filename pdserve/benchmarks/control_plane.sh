#!/usr/bin/env bash
# Issue 18's figures in one machine session on one GPU, each against a reference from the same run:
#  1. the engine alone (`pdserve bench-engine`): decode tok/s at batch 64/128/256/512 (context 384, the
#     mean of the served workload below) and the prefill of one 4096-token prompt;
#     the engine's own first-token time for a lone 4096-token prompt (lone_prompt.py), and the
#     engine in-process on the bench's own workload below (engine_workload.py: prefill included);
#  2. one colocated qwen3-30b-a3b replica (dummy bf16, max_num_seqs 512) through `pdserve up` with
#     ROUTERS routers (default 1): `pdserve bench --rate inf --max-concurrency C --input-len 256
#     --output-len 256` at C = 64, 128, 256, 512 (router dispatch mean and p99, TTFT, delivered tok/s,
#     and the routers' CPU seconds from /proc: streamed tokens per router CPU-second), from CLIENTS
#     client processes (default 4);
#  3. a lone 4096-token prompt's TTFT through the same cluster, 20 times one at a time, and 128-token
#     prompts at 1 req/s with 50-token answers;
#  4. (TRACE=1, the default) the same two light loads through a fresh cluster whose processes trace
#     every request's hops (PDSERVE_HOP_TRACE): where each TTFT goes, hop by hop (hop_trace.py).
# AFTER_LOAD=1 repeats part 4 after 512 streams through the traced cluster, and the engine's own lone prompts
# after 1,024 requests in the engine (lone_prompt.py --after-load).
# SKIP_ENGINE=1 leaves out bench-engine and the engine on the bench's workload (not the lone prompts'
# reference); SKIP_LIGHT=1 parts 3 and 4; CONCS the streams of part 2.
# A table last. Run from the checkout's root:  bash pdserve/benchmarks/control_plane.sh
set -u
[ -f .device/setup.sh ] && source .device/setup.sh  # GPU machines: the packages their image lacks
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
ROUTERS=${ROUTERS:-1}
CLIENTS=${CLIENTS:-4}  # bench client processes: one runs at a whole core from ~128 streams (its client_cpu)
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null
MODEL=${MODEL:-qwen3-30b-a3b}  # MODEL=tiny-moe GPUS=0 SKIP_ENGINE=1 CONCS=8 LONE_LEN=2048: a smoke run on a CPU
LONE_LEN=${LONE_LEN:-4096}  # the lone prompts' length
GPUS=${GPUS:-1}
if [ -z "${SKIP_ENGINE:-}" ]; then  # SKIP_ENGINE=1: the served figures only (an engine run of this session exists)
timeout 300 python -m pdserve.cli bench-engine --model qwen3-30b-a3b --device cuda --load-format dummy \
  --prefill-sizes 4096 --decode-batches 64 128 256 512 --context 384 --no-hf --json $OUT/engine.json \
  > $OUT/engine.log 2>&1
echo "bench-engine exit $?"
fi
cat > /tmp/coloc.yaml <<YAML
model: {path: $MODEL, load_format: dummy, dtype: bfloat16}
router: {host: 127.0.0.1, http_port: 8000, grpc_port: null, replicas: $ROUTERS}
colocated: {replicas: 1, gpus: $GPUS, max_num_seqs: 512, max_batch_tokens: 16384, chunk_size: 8192}
YAML
if [ -z "${SKIP_LIGHT:-}" ]; then
# The engine's own first token for a lone 4k and a 128-token prompt, each after 1 s idle (as the served
# light loads below leave the engine between requests; a GPU idle that long starts slower).
timeout 300 python -m pdserve.benchmarks.lone_prompt /tmp/coloc.yaml --prompt-len $LONE_LEN 128 --reps 8 --gap-s 1 --overlap on \
  ${AFTER_LOAD:+--after-load 1024} --json $OUT/engine_lone.json > $OUT/engine_lone.log 2>&1
echo "lone_prompt exit $?"
fi
if [ -z "${SKIP_ENGINE:-}" ]; then
timeout 300 python -m pdserve.benchmarks.engine_workload /tmp/coloc.yaml --concurrency 64 128 256 512 \
  --json $OUT/engine_workload.json > $OUT/engine_workload.log 2>&1
echo "engine_workload exit $?"
fi
up() {  # up LOG: start the cluster, wait until every router listens
  python -m pdserve.cli up /tmp/coloc.yaml > $1 2>&1 &
  pid=$!; t0=$SECONDS
  until grep -q "ready; Ctrl-C" $1; do
    sleep 1; [ $((SECONDS - t0)) -gt 240 ] && { echo "no health"; tail -20 $1; break; }
  done
  echo "ready after $((SECONDS - t0)) s"
}
up $OUT/up.log
# Several routers: the phases come from each one's own /metrics, added up.
OWN=$(grep -o "own http [^ ]*" $OUT/up.log | awk '{print $3}' | tr '\n' ' ')
METRICS=${OWN:+--metrics-url $OWN}
router_cpu() {  # CPU seconds of every router process so far
  python - <<'PY'
import os, subprocess
pids = subprocess.run(["pgrep", "-f", "ray::Router"], capture_output=True, text=True).stdout.split()
total = 0.0
for p in pids:
    try:
        f = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
        total += (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        pass
print(total)
PY
}
light() {  # light SUFFIX SEED: the lone 4k prompts (SEED) and the 128-token light load (SEED + 1)
  # Seeds no run on the cluster used before: the bench draws prompt i's tokens as the i-th stretch of
  # one seeded stream, so seed 0's 4k prompts began with the 256-token prompts the streams above had
  # left cached (a 256-token cached prefix: the varlen prefill path, +8 ms at 4k on an H200).
  local seed=$2
  timeout 150 python -m pdserve.cli bench --url http://127.0.0.1:8000 --rate 1 --max-concurrency 1 --num-prompts 20 \
    --input-len $LONE_LEN --output-len 2 --warmup 4 --seed $seed $METRICS --json $OUT/lone$1.json > $OUT/lone$1.log 2>&1
  echo "lone$1 exit $?"
  [ -n "${HOPS:-}" ] && python -m pdserve.benchmarks.hop_trace $HOPS --last 20 --json $OUT/hops_lone$1.json
  # Issue 40's light load: 128-token prompts at 1 req/s, 50-token answers (TTFT against the engine's 128 above).
  timeout 120 python -m pdserve.cli bench --url http://127.0.0.1:8000 --rate 1 --num-prompts 25 --input-len 128 \
    --output-len 50 --warmup 3 --seed $((seed + 1)) $METRICS --json $OUT/light128$1.json > $OUT/light128$1.log 2>&1
  echo "light128$1 exit $?"
  [ -n "${HOPS:-}" ] && python -m pdserve.benchmarks.hop_trace $HOPS --last 25 --json $OUT/hops_light128$1.json
}
CONCS=${CONCS:-64 128 256 512}  # the concurrencies to serve
for C in $CONCS; do
  c0=$(router_cpu)
  # The routers' CPU by thread over 12 s of the run (after the bench's start and warm-up).
  (sleep 6; timeout 30 python -m pdserve.benchmarks.router_threads --seconds 12 --json $OUT/threads_$C.json \
    > $OUT/threads_$C.log 2>&1) &
  timeout 180 python -m pdserve.cli bench --url http://127.0.0.1:8000 --rate inf --max-concurrency $C \
    --num-prompts $((2 * C)) --input-len 256 --output-len 256 --warmup 16 --clients $CLIENTS $METRICS --json $OUT/bench_$C.json \
    > $OUT/bench_$C.log 2>&1
  echo "C=$C exit $? router_cpu_s $(python -c "print($(router_cpu) - $c0)")" | tee -a $OUT/cpu.txt
done
if [ -z "${SKIP_LIGHT:-}" ]; then  # SKIP_LIGHT=1: no lone 4k prompts, no light load
  light "" 100
fi
if [ -z "${SKIP_LIGHT:-}" ] && [ "${TRACE:-1}" != 0 ]; then
  # A fresh cluster whose processes trace every request's hops, the bench's too (PDSERVE_HOP_TRACE).
  kill -INT $pid; wait $pid
  export HOPS=$OUT/hops PDSERVE_HOP_TRACE=$OUT/hops
  up $OUT/up_traced.log
  light _traced 200
  if [ -n "${AFTER_LOAD:-}" ]; then  # AFTER_LOAD=1: and again after 512 streams (what part 2 leaves part 3)
    timeout 180 python -m pdserve.cli bench --url http://127.0.0.1:8000 --rate inf --max-concurrency 512 \
      --num-prompts 1024 --input-len 256 --output-len 256 --warmup 0 --clients $CLIENTS > $OUT/load_traced.log 2>&1
    light _traced_loaded 300
  fi
  unset PDSERVE_HOP_TRACE
fi
# The served worker's step times (its stats' profile), against lone_prompt.py's in-process ones.
timeout 60 python -m pdserve.cli tune --record $OUT/served_profile.json > /dev/null 2>&1
kill -INT $pid; wait $pid
OUT=$OUT python - <<'PY'
import json, os
out = os.environ["OUT"]
try:
    eng = json.load(open(f"{out}/engine.json"))
    decode = {r["batch"]: r["tok_s"] for r in eng["engine_decode"]["rows"]}
    print("engine alone: prefill 4096", [r["ms"] for r in eng["engine_prefill"]["rows"]], "ms; decode tok/s", decode)
except Exception as e:
    decode = {}
    print("no engine figures here", e)
try:
    same = {r["concurrency"]: r["output_tok_s"]
            for r in json.load(open(f"{out}/engine_workload.json"))["rows"]}
    print("engine alone on the same workload, output tok/s:", same)
except Exception as e:
    same = {}
    print("no engine workload figures here", e)
cpu = {int(l.split()[0][2:]): float(l.split()[-1]) for l in open(f"{out}/cpu.txt")}
print(f"routers: {os.environ.get('ROUTERS', '1')}")
print(f"{'C':>4} {'% decode':>8} {'% same work':>11} {'admit':>6} {'dispatch mean':>13} {'p99<=':>6} {'loop lag p99<=':>14} {'max<=':>6} "
      f"{'first_tok':>9} {'TTFT p50':>9} {'TTFT p90':>9} "
      f"{'out tok/s':>10} {'router CPU s':>12} {'tok/router CPU-s':>16} {'client CPU':>10} {'ok':>5}")
for c in (64, 128, 256, 512):
    try:
        r = json.load(open(f"{out}/bench_{c}.json"))["runs"][0]
    except Exception as e:
        print(c, "no result", e); continue
    ph = r.get("server_ms") or {}
    toks = r["output_throughput"] * r["duration_s"] if "duration_s" in r else float("nan")
    # The routers' CPU over the run alone (their process_cpu_seconds_total, read by the bench), else
    # /proc over the whole bench invocation (its start and warm-up included: more than the run's).
    if r.get("router_cpu_s"):
        cpu[c] = r["router_cpu_s"]
    pct = 100 * r["output_throughput"] / decode[c] if c in decode else float("nan")
    pct_same = 100 * r["output_throughput"] / same[c] if c in same else float("nan")
    print(f"{c:>4} {pct:>8.1f} {pct_same:>11.1f} {ph.get('admit', float('nan')):>6} {ph.get('dispatch', float('nan')):>13} "
          f"{ph.get('dispatch p99<=', float('nan')):>6} {ph.get('loop_lag p99<=', float('nan')):>14} "
          f"{ph.get('loop_lag max<=', float('nan')):>6} "
          f"{ph.get('first_token', float('nan')):>9} {r['ttft_ms']['p50']!s:>9} {r['ttft_ms']['p90']!s:>9} "
          f"{r['output_throughput']!s:>10} {cpu.get(c, 0):>12.1f} {toks / cpu[c] if cpu.get(c) else float('nan'):>16.0f} "
          f"{r.get('client_cpu', float('nan')):>10} {r['completed']:>5}")
for name in ("lone", "light128", "lone_traced", "light128_traced", "lone_traced_loaded", "light128_traced_loaded"):
    try:
        r = json.load(open(f"{out}/{name}.json"))["runs"][0]
        print(f"{name}: TTFT p50", r["ttft_ms"]["p50"], "p90", r["ttft_ms"]["p90"], "p99", r["ttft_ms"]["p99"],
              "e2e p50", r["e2e_ms"]["p50"], "p99", r["e2e_ms"]["p99"], "server_ms", r.get("server_ms"))
    except Exception as e:
        print(name, "no result", e)
for c in (128, 512):
    try:
        print(f"router threads at {c} streams:", open(f"{out}/threads_{c}.log").read().strip()[-900:])
    except OSError:
        pass
try:
    print("engine alone, lone 4k first token:", json.load(open(f"{out}/engine_lone.json")))
except Exception as e:
    print("no engine lone figure", e)
try:
    steps = json.load(open(f"{out}/served_profile.json"))["steps"]
    print("served worker, step means ms (steps):", {p: {b: (round(1e3 * r[2] / r[0], 2), r[0]) for b, r in v.items()}
                                                    for p, v in steps.items()})
except Exception as e:
    print("no served profile", e)
PY
