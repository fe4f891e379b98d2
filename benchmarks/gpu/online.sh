#!/usr/bin/env bash
# Online serving on the GPU machine: `conveyor serve` (Llama-3.1-8B shape, random weights, SmolLM2
# tokenizer) driven by `conveyor bench run` at the peer's rates (Poisson, random 1024+-50% in,
# 256+-50% out, ignore_eos), ARRIVAL_S seconds of arrivals per rate. Writes run directories and a
# one-line-per-rate summary under OUT_DIR.
#   bash benchmarks/gpu/online.sh MODEL_DIR TOKENIZER_DIR OUT_DIR [ARRIVAL_S] [RATES...]   (a rate may be inf)
set -u
model=$1; tokenizer=$2; out=$3; arrival_s=${4:-30}; shift 4 || shift $#
rates=${*:-4 8 16 24}
port=$((20000 + RANDOM % 20000))
mkdir -p "$out"
python3 benchmarks/gpu/online_trace.py --num-requests 1000 --out "$out/trace.jsonl"
python3 -m conveyor serve --model "$model" --load-format dummy --tokenizer "$tokenizer" --device "${DEVICE:-cuda}" \
  ${SERVE_EXTRA:-} --max-model-len 4096 --max-num-seqs 256 --max-num-batched-tokens ${MAX_BATCHED:-2048} --no-enable-prefix-caching \
  --port "$port" > "$out/server.log" 2>&1 &
server=$!
for _ in $(seq 1 240); do
  python3 -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1], timeout=2)" "http://127.0.0.1:$port/v1/models" 2>/dev/null && break
  kill -0 $server 2>/dev/null || { echo "server died"; tail -20 "$out/server.log"; exit 1; }
  sleep 1
done
for rate in $rates; do
  if [ "$rate" = inf ]; then n=${INF_REQUESTS:-400}; else n=$((rate * arrival_s)); fi  # the peer's "unlimited": 400 at once
  python3 -m conveyor bench run --base-url "http://127.0.0.1:$port" --trace "$out/trace.jsonl" --rate "$rate" \
    --num-requests "$n" --goodput ttft:200,itl:50 --out "$out/rate_$rate" --no-progress > "$out/rate_$rate.txt" 2>&1
  python3 -c "import json,sys; s=json.load(open(sys.argv[1])); print('ONLINE', json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in s.items() if k in ('request_rate', 'num_prompts', 'completed', 'failed', 'duration', 'request_throughput', 'output_throughput', 'p95_ttft_ms', 'p95_itl_ms', 'p95_tpot_ms', 'p95_e2el_ms', 'median_ttft_ms', 'median_itl_ms', 'send_lag_p99_ms', 'valid')}))" "$out/rate_$rate/summary.json" || tail -5 "$out/rate_$rate.txt"
done
kill $server; wait $server 2>/dev/null
