#!/usr/bin/env bash
# The control plane under load, this checkout against another (OLD) in one machine session: one
# colocated qwen3-30b-a3b replica (dummy bf16, max_num_seqs 512) through `pdserve up`, then
# `pdserve bench --rate inf --max-concurrency C --input-len 256 --output-len 256` at C = 64, 256, 512;
# a table of the router's dispatch phase, TTFT and delivered tokens/s last. One GPU.
#   OLD=/path/to/other/checkout bash pdserve/benchmarks/dispatch_ab.sh    (VERSIONS=new: this one alone)
set -u
ROOT=$(pwd)
[ -f .device/setup.sh ] && source .device/setup.sh  # GPU machines: the packages their image lacks
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name --format=csv,noheader
cat > /tmp/coloc.yaml <<YAML
model: {path: qwen3-30b-a3b, load_format: dummy, dtype: bfloat16}
router: {host: 127.0.0.1, http_port: 8000, grpc_port: 50051}
colocated: {replicas: 1, gpus: 1, max_num_seqs: 512, max_batch_tokens: 16384, chunk_size: 8192}
YAML
run_version() {  # NAME TREE
  local name=$1 tree=$2
  # The tree as installed (pdserve/ with router/ prefill/ decode/ kvtransfer/ inside), plus the
  # folders top-level for the older code that imports them so.
  rm -rf /tmp/tree_$name && mkdir -p /tmp/tree_$name && cp -r $tree/pdserve /tmp/tree_$name/
  for d in router prefill decode kvtransfer; do cp -r $tree/$d /tmp/tree_$name/pdserve/$d; cp -r $tree/$d /tmp/tree_$name/$d; done
  cd /tmp
  PYTHONPATH=/tmp/tree_$name:/tmp/site python -m pdserve.cli up /tmp/coloc.yaml > $OUT/up_$name.log 2>&1 &
  local pid=$! t0=$SECONDS
  until curl -sf http://127.0.0.1:8000/health > /dev/null; do
    sleep 1
    if [ $((SECONDS - t0)) -gt 200 ]; then echo "$name: no health"; tail -5 $OUT/up_$name.log; kill -INT $pid; cd $ROOT; return; fi
  done
  echo "$name: ready after $((SECONDS - t0)) s"
  for C in 64 256 512; do
    PYTHONPATH=/tmp/tree_$name:/tmp/site timeout 150 python -m pdserve.cli bench --url http://127.0.0.1:8000 --rate inf \
      --max-concurrency $C --num-prompts $((2 * C)) --input-len 256 --output-len 256 --warmup 16 \
      --json $OUT/bench_${name}_$C.json > $OUT/bench_${name}_$C.log 2>&1
    echo "$name C=$C exit $?"
  done
  kill -INT $pid; wait $pid; sleep 3
  cd $ROOT
}
for v in ${VERSIONS:-old new}; do
  if [ $v = old ]; then run_version old ${OLD:?set OLD to the checkout to compare with}; else run_version new $ROOT; fi
done
OUT=$OUT python - <<'PY'
import json, os
out = os.environ["OUT"]
print(f"{'code':5} {'C':>4} {'dispatch ms':>11} {'first_token ms':>14} {'TTFT p50':>9} {'TTFT p90':>9} {'out tok/s':>10} {'ok':>5}")
for name in ("old", "new"):
    for c in (64, 256, 512):
        try:
            r = json.load(open(f"{out}/bench_{name}_{c}.json"))["runs"][0]
        except Exception as e:
            print(name, c, "no result", e); continue
        ph = r.get("server_ms") or {}
        print(f"{name:5} {c:>4} {ph.get('dispatch', float('nan')):>11} {ph.get('first_token', float('nan')):>14} "
              f"{r['ttft_ms']['p50']!s:>9} {r['ttft_ms']['p90']!s:>9} {r['output_throughput']!s:>10} {r['completed']:>5}")
PY
