#!/usr/bin/env bash
# Tensor parallelism on 2 H200s (issue 19): nano256 offline and the online table (`vllm bench serve`, one client
# for both servers) for conveyor TP=2 against vLLM 0.24 TP=2 on the Llama-3.1-70B shape (random weights), one
# right after the other on the same machine, and conveyor TP=2 against TP=1 on Llama-3.1-8B for the scaling.
# Runs on the GPU machine (nvidia-h200-x2) from the repository root. Set-up as benchmarks/gpu/session.sh: vLLM's
# site in /tmp/site (session.sh setup 1, setup 2, unpack), conveyor's cp312 wheels in /tmp/site0 and SmolLM2's
# tokenizer in /tmp/tok (session.sh setup with the wheel piece), .peers/h200 carried (its device_run.sh vbench is
# the client). Each step below fits one 10-minute device call:
#   bash benchmarks/gpu/tp.sh check                    GPUs, an NCCL all-reduce, the TP GPU tests, plan vs engine (70B, TP=2)
#   bash benchmarks/gpu/tp.sh offline ENGINE MODEL TP  nano256 (ENGINE: conveyor | vllm; MODEL: llama-3.1-70b | llama-3.1-8b)
#   bash benchmarks/gpu/tp.sh online ENGINE MODEL TP RATES...   serve + `vllm bench serve` at each rate (30 s of arrivals)
#   bash benchmarks/gpu/tp.sh table                    the summary of everything under $OUT
# The order the issue asks for (the same machine, one right after the other):
#   check; offline conveyor llama-3.1-70b 2; offline vllm llama-3.1-70b 2; online conveyor llama-3.1-70b 2 1 2 4 8 inf;
#   online vllm llama-3.1-70b 2 1 2 4 8 inf; offline conveyor llama-3.1-8b 2; offline conveyor llama-3.1-8b 1;
#   online conveyor llama-3.1-8b 2 4 8 16 24 inf; online conveyor llama-3.1-8b 1 4 8 16 24 inf; table
# Online, both servers run at their defaults (conveyor's CUDA defaults are vLLM's: async scheduling, max_num_seqs
# 1024, max_num_batched_tokens 8192, prefix caching on; docs/serving.md), as in docs/performance.md's issue-15 table.
# Results: JSON lines in $OUT/results.jsonl (offline), vbench_<engine>_<model>_tp<N>_r<rate>.json (online), logs in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export TOKENIZERS_PARALLELISM=false VLLM_USE_FLASHINFER_SAMPLER=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast here
export PYTHONPATH=$PWD/src:/tmp/site0:/tmp/site
TOK=${TOK:-/tmp/tok}

wait_health() {  # URL PID LOG: up to 600 s (the 70B shape draws 70B random values per rank and captures graphs)
  for _ in $(seq 1 600); do
    curl -sf "$1/health" >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || { echo "server died"; tail -30 "$3"; return 1; }
    sleep 1
  done
  echo "server not healthy after 600 s"; tail -30 "$3"; return 1
}

stop_server() {  # PID: SIGTERM, then wait until every GPU's memory is free again
  kill "$1" 2>/dev/null; wait "$1" 2>/dev/null
  for _ in $(seq 1 60); do
    used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | sort -n | tail -1)
    [ "${used:-0}" -lt 2000 ] && return 0
    sleep 1
  done
}

step=$1; shift
case $step in
  check)
    nvidia-smi -L
    python3 -c "import torch; print('GPUs', torch.cuda.device_count(), 'torch', torch.__version__)"
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/worker/test_tensor_parallel_gpu.py 2>&1 | tail -5
    timeout -s KILL 420 python3 benchmarks/plan_vs_engine.py benchmarks/models/llama-3.1-70b --tensor-parallel-size 2 \
      --max-num-seqs 256 --max-num-batched-tokens 8192 > "$OUT/plan_vs_engine_70b_tp2.log" 2>&1
    echo "plan_vs_engine rc=$?"; grep -h RESULT "$OUT/plan_vs_engine_70b_tp2.log" || tail -20 "$OUT/plan_vs_engine_70b_tp2.log" ;;
  offline)
    engine=$1; m=$2; tp=$3; log="$OUT/offline_${engine}_${m}_tp$tp.log"
    if [ "$engine" = vllm ]; then
      timeout -s KILL 540 python3 benchmarks/gpu/vllm_offline.py --model benchmarks/models/"$m" --tensor-parallel-size "$tp" \
        --out "$OUT/results.jsonl" > "$log" 2>&1
    else
      timeout -s KILL 540 python3 benchmarks/gpu/offline.py --model benchmarks/models/"$m" --tensor-parallel-size "$tp" \
        --async-scheduling --max-num-seqs 1024 --max-num-batched-tokens 16384 --out "$OUT/results.jsonl" > "$log" 2>&1
    fi
    echo "$engine $m tp=$tp rc=$?"; grep -h RESULT "$log" | cut -c1-700 || tail -30 "$log" ;;
  online)
    engine=$1; m=$2; tp=$3; shift 3; tag="${engine}_${m}_tp$tp"; log="$OUT/serve_$tag.log"
    if [ "$engine" = vllm ]; then
      url=http://127.0.0.1:8011; name=benchmarks/models/$m
      python3 -m vllm.entrypoints.cli.main serve "$name" --load-format dummy --tokenizer "$TOK" --max-model-len 4096 \
        --tensor-parallel-size "$tp" --host 127.0.0.1 --port 8011 --seed 0 > "$log" 2>&1 &
    else
      url=http://127.0.0.1:8012; name=$m
      python3 -m conveyor serve benchmarks/models/"$m" --load-format dummy --tokenizer "$TOK" --device cuda \
        --tensor-parallel-size "$tp" --max-model-len 4096 --host 127.0.0.1 --port 8012 > "$log" 2>&1 &
    fi
    pid=$!; t0=$(date +%s)
    wait_health $url $pid "$log" || exit 4
    echo "$tag healthy after $(( $(date +%s) - t0 )) s"
    OUT=$OUT bash .peers/h200/device_run.sh vbench $url "$name" "$TOK" "$tag" "$@"
    curl -s $url/metrics > "$OUT/metrics_$tag.txt"
    stop_server $pid ;;
  table)
    python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| offline nano256 | engine | TP | output tok/s | wall s |")
for line in (out / "results.jsonl").read_text().splitlines() if (out / "results.jsonl").exists() else []:
    r = json.loads(line)
    print(f"| {r['model']} | {r['engine']} | {r.get('tensor_parallel_size', 1)} | {r['output_tok_s']:,.0f} | {r['wall_s']} |")
print("\n| online | rate | completed req/s | output tok/s | p95 TTFT ms | p95 ITL ms | p95 E2E ms | failed |")
for path in sorted(out.glob("vbench_*_r*.json")):
    r = json.loads(path.read_text())
    tag, rate = path.stem[len("vbench_"):].rsplit("_r", 1)
    print(f"| {tag} | {rate} | {r['request_throughput']:.2f} | {r['output_throughput']:,.0f} | {r['p95_ttft_ms']:.0f} | "
          f"{r['p95_itl_ms']:.1f} | {r['p95_e2el_ms']:.0f} | {r.get('failed', 0)} |")
PY
    ;;
esac
exit 0
