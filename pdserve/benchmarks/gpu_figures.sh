#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md in one go, on one host of 4 (or 2, or 1) GPUs:
#   bash pdserve/benchmarks/gpu_figures.sh OUT_DIR [PART ...]
# PARTs (default: all but goodput, which takes ~7 minutes for its four cluster files):
#   tests    the GPU-path tests (kernels, engine, expert and tensor parallel, KV transfer)
#   engine   bench-engine, decode with and without overlap scheduling (same run), prefill, HF
#   ep       EP decode scaling at 256 per rank (ep_size 2 and 4 where there are 4 GPUs), overlap on/off
#   ep512    EP decode at 256 and 512 per rank with CUDA graphs captured up to 512 (--graph-max-batch)
#   kv       KV transfer rate (cuda_ipc) and TTFT with layer-wise streaming; a 4k prompt's KV per cache
#            layout (qwen3-30b-a3b, deepseek-v2-lite) and dtype (bf16, FP8)
#   kvnixl   KV over NIXL through staging slots (nixl), without them (nixl-blocks) and cuda_ipc, same run:
#            fresh, fragmented and scattered blocks at 4k and 16k, then the 16k TTFT with layer-wise
#            streaming over NIXL (issue 43; 2 GPUs)
#   tp       tensor parallelism: TP = 2 against one GPU (deepseek-v2-lite, qwen3-30b-a3b; 2 GPUs)
#   goodput  the P:D configurations of deploy/pd4 through `pdserve up` (4 GPUs; GOODPUT_RATES="24 32 48 64"
#            to look past the 32 req/s that three of them held on 2026-11-22)
#   adaptive the adaptive disaggregation sweep on 2 GPUs (deploy/bench/adaptive: 1 + 1 adaptive at two TPOT
#            guards, 1 + 1 fixed, 2 colocated) on 4k/256, then 8k/128 and 1k/1k (~25 minutes in all);
#            each sweep's JSON holds the per-request records its goodput grid is printed from
#   flip     a role flip under load, prefill -> decode and back (deploy/bench/flip: 2 prefill + 1 decode, 3 GPUs)
#   serving  issue 40's and 44's served figures on one GPU (control_plane.sh): the engine's own first token after
#            1 s idle, then through `pdserve up`: streams 64-512 (dispatch, admit, loop lag, tokens per router
#            CPU-s), a lone 4k prompt, 128-token prompts at 1 req/s
#   grammar  issue 41's step overhead at 256 sequences, all constrained or all penalized, against none, over a
#            BPE vocabulary, the MoE shape and a dense control (1 GPU)
#   spec     issue 44's verify-step cost (k = 1, 2, 4, 8 at batch 1, 8, 32) and n-gram speed-up (1 GPU)
#   cached   a 128-token prompt's first token fresh and again with its prefix cached, in-process; the
#            paged prefill kernel at 0-3,840 cached of 4,096 keys against SDPA; a lone 4k prompt with a
#            cached prefix (1 GPU)
#   mixed    a decode replica's step with a prompt's chunk beside 16, 32 and 96 decoders (mixed_step.py), eager
#            beyond graphs of 32 sequences (--graph-seqs 32) (its attention's grid as today, then flat), then with
#            prefill graphs of 128 sequences (1 GPU)
#   pdl      issue 44: bench-engine's decode at batch 1, 2, 4, 8 and a 128-token prefill with programmatic
#            dependent launch off and on (PDSERVE_PDL=0 / 1; PDL_VARIANTS, default "0 1 0 1": interleaved
#            twice) (1 GPU)
#   light    issue 44's light load through `pdserve up` (one colocated replica; 1 req/s, 128-token prompts,
#            50-token answers, 60 requests) under each of LIGHT_VARIANTS (default "PDSERVE_PDL=1
#            PDSERVE_PDL=1,SPEC=1 PDSERVE_PDL=0": environments, commas between variables; SPEC=1 serves
#            with n-gram speculation, 4 draft tokens: issue 44's "the figure with it") (1 GPU)
#   routers  issue 40's 1, 2 and 4 routers sharing a port against 4 synthetic workers that outrun one router
#            (router_stream.py: the real channel, routers and HTTP; no GPU used, the host's cores are what counts)
# Each part writes OUT_DIR/<part>*.json (routers: its table in the log) and a log; a failing part does not
# stop the others.
set -u
out=${1:?usage: gpu_figures.sh OUT_DIR [PART ...]}
shift
parts=${*:-tests engine ep kv}
mkdir -p "$out"
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
echo "[gpu-figures] $(date -u +%FT%TZ) $gpus GPU(s); parts: $parts"

run() {  # run NAME COMMAND...: logs to OUT/NAME.log, says how it went
    local name=$1
    shift
    local t0=$SECONDS
    "$@" >"$out/$name.log" 2>&1
    echo "[gpu-figures] $name: exit $? after $((SECONDS - t0)) s (log: $out/$name.log)"
    tail -n 12 "$out/$name.log"
}

for part in $parts; do
    case $part in
    tests)
        run tests python -m pytest -q -x -p no:cacheprovider tests/test_gpu_kernels.py tests/test_gpu_engine.py \
            tests/test_mtp.py tests/test_expert_parallel.py tests/test_kvtransfer_gpu.py tests/test_tensor_parallel_gpu.py ;;
    engine)
        for overlap in on off; do
            run "engine-decode-$overlap" python -m pdserve.benchmarks.bench_engine --overlap "$overlap" \
                --prefill-sizes --no-hf --json "$out/engine-decode-$overlap.json"
        done
        run engine python -m pdserve.benchmarks.bench_engine --hf-prefill-sizes 2048 4096 \
            --hf-decode-batches 1 8 32 --reps 3 --json "$out/engine.json" ;;
    ep)
        sizes=2
        [ "$gpus" -ge 4 ] && sizes="2 4"
        for overlap in on off; do
            run "ep-$overlap" python -m pdserve.benchmarks.ep_decode --ep-sizes $sizes --batches 256 \
                --setups single pair ep --paths all_gather --overlap "$overlap" --json "$out/ep-$overlap.json"
        done ;;
    ep512)
        sizes=2
        [ "$gpus" -ge 4 ] && sizes="2 4"
        run ep512 python -m pdserve.benchmarks.ep_decode --ep-sizes $sizes --batches 256 512 \
            --setups single ep --paths all_gather --graph-max-batch 512 --json "$out/ep512.json" ;;
    kv)
        run kv python -m pdserve.benchmarks.kv_transfer --backend cuda_ipc --sizes 1024 4096 16384 65536 \
            --ttft 16384 --reps 9 --json "$out/kv.json"
        run kv-layouts python -m pdserve.benchmarks.kv_transfer --backend cuda_ipc --sizes 4096 --ttft 0 --reps 20 \
            --presets qwen3-30b-a3b deepseek-v2-lite --kv-cache-dtypes auto fp8_e4m3 --json "$out/kv-layouts.json" ;;
    kvnixl)
        run kvnixl python -m pdserve.benchmarks.kv_transfer --backends nixl nixl-blocks cuda_ipc --sizes 4096 16384 \
            --ttft 0 --reps 9 --json "$out/kvnixl.json"
        run kvnixl-ttft python -m pdserve.benchmarks.kv_transfer --backends nixl --sizes 4096 --ttft 16384 --reps 5 \
            --json "$out/kvnixl-ttft.json" ;;
    tp)
        run tp python -m pdserve.benchmarks.tp_scaling --models deepseek-v2-lite qwen3-30b-a3b --profile \
            --json "$out/tp.json" ;;
    goodput)
        run goodput python -m pdserve.benchmarks.pd_goodput deploy/pd4/colocated4.yaml deploy/pd4/2p2d.yaml \
            deploy/pd4/1p3d.yaml deploy/pd4/2p1ep2.yaml --rates ${GOODPUT_RATES:-12 16 24 32} --duration 10 --input-len 4096 \
            --output-len 256 --stop-below 0.5 --start-timeout 120 --stop-timeout 20 --log-dir "$out" \
            --json "$out/goodput.json" ;;
    adaptive)
        a=deploy/bench/adaptive
        common=(--duration 12 --stop-below 0.5 --start-timeout 180 --stop-timeout 20 --clients 4 --log-dir "$out")
        run mixed-step python -m pdserve.benchmarks.mixed_step $a/1p1d-adaptive50.yaml --decoders 32 64 96 \
            --chunks 0 16 256 512 1024 2048 --json "$out/mixed-step.json"
        run adaptive-4k python -m pdserve.benchmarks.pd_goodput $a/1p1d-adaptive50.yaml $a/1p1d-adaptive20.yaml \
            $a/1p1d-fixed.yaml $a/colocated2.yaml --rates ${ADAPTIVE_RATES:-9 12 15 18 22} --input-len 4096 \
            --output-len 256 "${common[@]}" --json "$out/adaptive-4k.json"
        [ -n "${ADAPTIVE_4K_ONLY:-}" ] && continue
        run adaptive-8k python -m pdserve.benchmarks.pd_goodput $a/1p1d-adaptive50.yaml $a/1p1d-fixed.yaml \
            $a/colocated2.yaml --rates 3 5 7 9 12 --input-len 8192 --output-len 128 "${common[@]}" \
            --json "$out/adaptive-8k.json"
        run adaptive-1k python -m pdserve.benchmarks.pd_goodput $a/1p1d-adaptive50.yaml $a/1p1d-fixed.yaml \
            $a/colocated2.yaml --rates 4 6 8 10 --input-len 1024 --output-len 1024 "${common[@]}" \
            --json "$out/adaptive-1k.json" ;;
    flip)
        run flip python -m pdserve.benchmarks.role_flip deploy/bench/flip/2p1d.yaml --rate 4 --input-len 1024 \
            --output-len 64 --log "$out/flip-up.log" --json "$out/flip.json" ;;
    serving)
        run serving env OUT="$out/serving" bash pdserve/benchmarks/control_plane.sh ;;
    grammar)
        # A real BPE vocabulary (trained here: no hub), the MoE shape and a dense control whose forward's
        # cost does not depend on the tokens sampled (docs/benchmarks.md, structured outputs).
        run bpe python -m pdserve.benchmarks.bpe_vocab /tmp/bpe
        for m in qwen3-30b-a3b deploy/bench/grammar/qwen3-8b.json; do
            run "grammar-$(basename $m .json)" python -m pdserve.benchmarks.grammar_masks \
                --json "$out/grammar-$(basename $m .json).json" step --model $m --device cuda --batch 256 \
                --steps 20 --rounds 5 --tokenizer /tmp/bpe
        done ;;
    spec)
        run spec python -m pdserve.benchmarks.spec_decode --model qwen3-30b-a3b --device cuda --batches 1 8 32 \
            --k 1 2 4 8 --steps 20 --json "$out/spec.json" ;;
    cached)
        printf 'model: {path: qwen3-30b-a3b, load_format: dummy, dtype: bfloat16}\ncolocated: {replicas: 1, gpus: 1, max_num_seqs: 512, max_batch_tokens: 16384, chunk_size: 8192}\n' > /tmp/cached.yaml
        run cached python -m pdserve.benchmarks.cached_prefix /tmp/cached.yaml --json "$out/cached.json"
        run prefill-kernel python -m pdserve.benchmarks.prefill_kernel --json "$out/prefill-kernel.json"
        run cached-4k python -m pdserve.benchmarks.lone_prompt /tmp/cached.yaml --prompt-len 4096 --reps 8 \
            --gap-s 0.5 --overlap on --cached-prefix 256 1024 2048 3840 --json "$out/cached-4k.json" ;;
    mixed)
        for v in "32" "32 --flat-eager" "128"; do
            name=mixed$(echo $v | tr -d ' -')
            run $name python -m pdserve.benchmarks.mixed_step deploy/bench/adaptive/1p1d-adaptive50.yaml \
                --decoders 16 32 96 --context 4096 --chunks 0 16 256 1024 2048 --graph-seqs $v \
                --json "$out/$name.json"
        done ;;
    pdl)
        for v in ${PDL_VARIANTS:-0 1 0 1}; do
            n=$((${n:-0} + 1))
            run pdl-$v-$n env PDSERVE_PDL=$v python -m pdserve.cli bench-engine --model qwen3-30b-a3b --device cuda \
                --load-format dummy --prefill-sizes 128 --decode-batches 1 2 4 8 --no-hf --reps 5 \
                --json "$out/pdl-$v-$n.json"
        done ;;
    light)
        for spec in "" ", speculative: {method: ngram, num_tokens: 4}"; do
            printf 'model: {path: qwen3-30b-a3b, load_format: dummy, dtype: bfloat16}\nrouter: {host: 127.0.0.1, http_port: 8000, grpc_port: null}\ncolocated: {replicas: 1, gpus: 1, max_num_seqs: 512, max_batch_tokens: 16384, chunk_size: 8192%s}\n' "$spec" \
                > /tmp/light${spec:+-spec}.yaml
        done
        seed=100
        for v in ${LIGHT_VARIANTS:-PDSERVE_PDL=1 PDSERVE_PDL=1,SPEC=1 PDSERVE_PDL=0}; do
            name=light-$(echo $v | tr ',=' '-_')
            yaml=/tmp/light.yaml; case $v in *SPEC=1*) yaml=/tmp/light-spec.yaml ;; esac
            env $(echo $v | tr ',' ' ') python -m pdserve.cli up $yaml > "$out/$name-up.log" 2>&1 &
            pid=$!; t0=$SECONDS
            until grep -q "ready; Ctrl-C" "$out/$name-up.log"; do
                sleep 1; [ $((SECONDS - t0)) -gt 300 ] && { echo "[gpu-figures] $name: no health"; break; }
            done
            seed=$((seed + 1))  # fresh prompts for every cluster (no cached prefix from a run before)
            run $name python -m pdserve.cli bench --url http://127.0.0.1:8000 --rate 1 --num-prompts 60 \
                --input-len 128 --output-len 50 --warmup 3 --seed $seed --json "$out/$name.json"
            kill -INT $pid; wait $pid
        done ;;
    routers)
        run routers python -m pdserve.benchmarks.router_stream --routers 1 2 4 --workers 4 --clients 4 \
            --streams 128 512 --seconds 15 --prompt-len 256 ;;
    *)
        echo "[gpu-figures] unknown part $part (tests, engine, ep, ep512, kv, kvnixl, tp, goodput, adaptive, flip," \
            "serving, grammar, spec, cached, mixed, pdl, light, routers)" ;;
    esac
done
