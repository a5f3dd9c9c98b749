#!/usr/bin/env bash
# Tensor parallelism and the KV transfer figures on one host of two GPUs, in one go: the two-GPU
# tests, tp_scaling.py (TP = 1 against TP = 2) and kv_transfer.py (a 4k prompt's KV, MLA against
# the Qwen3 shape, bf16 against FP8). Logs and JSON under $OUT (default ./tp-figures); the short
# tables last.
#
#   bash pdserve/benchmarks/tp_figures.sh [tests] [scaling] [kv] [kv-nixl] [scaling-qwen3]
#
# Each part runs under its own time limit (PART_S, default 240 s; the parts' processes are one
# process group, killed with it), so a hang costs one part.
set -u
OUT=${OUT:-tp-figures}
mkdir -p "$OUT"
parts=${*:-tests scaling kv}
limit=${PART_S:-240}
summary="$OUT/summary.txt"
: > "$summary"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1 || true

run() {  # name, command...: runs under the limit, keeps the log, notes the outcome in the summary
  local name=$1; shift
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc in $((SECONDS - t0)) s" | tee -a "$summary"
  return $rc
}

for part in $parts; do
  case $part in
    tests)
      run tests python -m pytest -q -s -p no:cacheprovider -rA -k "two_gpus or cuda_graphs_equal_eager" \
        tests/test_tensor_parallel_gpu.py tests/test_gpu_engine.py
      grep -E "passed|failed|PASSED|FAILED|Error|equal, max" "$OUT/tests.log" | tail -15 >> "$summary" ;;
    scaling)
      run scaling python -m pdserve.benchmarks.tp_scaling --models deepseek-v2-lite --profile --json "$OUT/tp_scaling.json"
      sed -n '/^tensor parallelism/,$p' "$OUT/scaling.log" >> "$summary" ;;
    scaling-qwen3)
      run scaling-qwen3 python -m pdserve.benchmarks.tp_scaling --models qwen3-30b-a3b --json "$OUT/tp_scaling_qwen3.json"
      sed -n '/^tensor parallelism/,$p' "$OUT/scaling-qwen3.log" >> "$summary" ;;
    kv|kv-nixl)
      backend=cuda_ipc; [ "$part" = kv-nixl ] && backend=nixl
      run "$part" python -m pdserve.benchmarks.kv_transfer --backend "$backend" --sizes 4096 --ttft 0 --reps 20 \
        --presets qwen3-30b-a3b deepseek-v2-lite --kv-cache-dtypes auto fp8_e4m3 --json "$OUT/$part.json"
      sed -n '/^raw GPU0->GPU1 copy [0-9.]* GB\/s (/,$p' "$OUT/$part.log" | cut -c1-125 >> "$summary" ;;
  esac
done
echo
cat "$summary"
