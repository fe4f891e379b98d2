#!/usr/bin/env bash
# `conveyor serve` built from several git refs, one right after the other, measured by vLLM's own client
# (`vllm bench serve --backend openai`, random text prompts tokenized with SmolLM2's tokenizer): request
# and output throughput and the TTFT tail, per ref and offered rate. Made for "before / after" of a
# change to the serving path, e.g. the engine-core process split:
#
#   benchmarks/serve_refs_vllm_bench.sh 5a028e1 engine-proc          # main before the split, then after
#   REPEATS=2 RATES="4 inf" SERVE_ARGS="--async-scheduling" benchmarks/serve_refs_vllm_bench.sh A B
#   RATES="c1 c4 inf" benchmarks/serve_refs_vllm_bench.sh "main --num-threads 1" "main --num-threads 2"
#
# An argument is a ref, optionally followed by serve flags of its own (one quoted word: "REF FLAGS...").
# A rate is a Poisson rate in req/s, `inf`, or `cN`: everything at once but at most N in flight
# (vllm bench serve --max-concurrency N), i.e. N closed-loop streams.
#
# Each ref is exported (`git archive`) into $OUT/src-<ref> and served with this checkout's .venv (the
# refs must need no other packages), on the same weights ($PEER_DIR/smollm2-hf, served as "smollm2").
# REPEATS>1 alternates the refs (A B A B ...) so drift on a shared machine shows as spread, not as a
# difference. Needs the peer (bash ../shared/peers/vllm-cpu/setup.sh). Numbers on a busy machine are
# noise: run it on a quiet one. Results: $OUT/<ref>-r<k>@<rate>.json (vLLM's format) and a table.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
source "${PEER_ENV:-$here/../shared/peers/vllm-cpu/env.sh}"   # PEER_ENV=/work/shared/peers/vllm-cpu/env.sh from a worktree
[ $# -ge 1 ] || { echo "usage: $0 REF [REF...]" >&2; exit 2; }
OUT=${OUT:-/tmp/conveyor-refs-bench}; RATES=${RATES:-"2 inf"}; N=${N:-64}; REPEATS=${REPEATS:-1}
INPUT_LEN=${INPUT_LEN:-256}; OUTPUT_LEN=${OUTPUT_LEN:-64}; RANGE_RATIO=${RANGE_RATIO:-0.5}
SERVE_ARGS=${SERVE_ARGS:-}   # extra `conveyor serve` flags for every ref, e.g. "--async-scheduling --max-num-seqs 64"
MODEL=$PEER_DIR/smollm2-hf; NAME=smollm2
PY="$here/.venv/bin/python"
mkdir -p "$OUT"
free_port() { $PY -c "import socket;s=socket.socket();s.bind(('127.0.0.1',0));print(s.getsockname()[1])"; }
wait_up() { for _ in $(seq 600); do curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0; sleep 0.5; done; return 1; }
safe() { echo "$1" | tr '/: ' '___'; }

for variant in "$@"; do  # export every ref first, so the runs are back to back
  ref=${variant%% *}
  dir="$OUT/src-$(safe "$ref")"
  rm -rf "$dir"; mkdir -p "$dir"
  git -C "$here" archive "$ref" src | tar -x -C "$dir"
  echo "$ref = $(git -C "$here" rev-parse --short "$ref")" > "$dir/REF"
done

SERVER=0; trap 'kill $SERVER 2>/dev/null || true' EXIT
for repeat in $(seq "$REPEATS"); do
  for variant in "$@"; do
    ref=${variant%% *}; own_args=${variant#"$ref"}
    tag="$(safe "$variant")-r$repeat"; PORT=$(free_port)
    # shellcheck disable=SC2086
    PYTHONPATH="$OUT/src-$(safe "$ref")/src" $PY -m conveyor serve --model "$MODEL" --served-model-name "$NAME" \
        --host 127.0.0.1 --port "$PORT" --max-model-len 2048 $SERVE_ARGS $own_args > "$OUT/$tag-serve.log" 2>&1 &
    SERVER=$!
    wait_up "$PORT" || { echo "$ref did not start; see $OUT/$tag-serve.log" >&2; exit 1; }
    for rate in warmup $RATES; do
      case $rate in
        warmup) args=(--num-prompts 8 --request-rate inf) ;;
        c*) args=(--num-prompts "$N" --request-rate inf --max-concurrency "${rate#c}") ;;
        *) args=(--num-prompts "$N" --request-rate "$rate") ;;
      esac
      vllm bench serve --backend openai --base-url "http://127.0.0.1:$PORT" --model "$NAME" --tokenizer "$MODEL" \
          --dataset-name random --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" \
          --random-range-ratio "$RANGE_RATIO" --ignore-eos --seed 0 "${args[@]}" \
          --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,95,99 \
          --save-result --result-dir "$OUT" --result-filename "$tag@$rate.json" > "$OUT/$tag@$rate.txt" 2>&1
    done
    kill -TERM "$SERVER"; wait "$SERVER" 2>/dev/null || true
  done
done

$PY - "$OUT" "$RATES" "$REPEATS" "$@" <<'PYEOF'
import json, sys
out, rates, repeats, refs = sys.argv[1], sys.argv[2].split(), int(sys.argv[3]), sys.argv[4:]
safe = lambda r: r.replace("/", "_").replace(":", "_").replace(" ", "_")
print(f"{'ref':>30s} | {'rate':>4s} | rep | {'req/s':>6s} | {'out tok/s':>9s} | {'TTFT p50':>8s} | {'TTFT p95':>8s} | "
      f"{'TTFT p99':>8s} | {'ITL p50':>7s} | {'E2E p95':>7s} | failed   (ms)")
for rate in rates:
    for ref in refs:
        for k in range(1, repeats + 1):
            try:
                r = json.load(open(f"{out}/{safe(ref)}-r{k}@{rate}.json"))
            except FileNotFoundError:
                continue
            failed = r.get("failed", r["num_prompts"] - r["completed"]) if "num_prompts" in r else "-"
            print(f"{ref:>30.30s} | {rate:>4s} | {k:3d} | {r['request_throughput']:6.2f} | {r['output_throughput']:9.1f} | "
                  f"{r['p50_ttft_ms']:8.0f} | {r['p95_ttft_ms']:8.0f} | {r['p99_ttft_ms']:8.0f} | "
                  f"{r['p50_itl_ms']:7.1f} | {r['p95_e2el_ms']:7.0f} | {failed}")
PYEOF
