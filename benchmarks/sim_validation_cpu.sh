#!/usr/bin/env bash
# issue 36: held-out validation of `conveyor simulate` on this CPU (run it on a quiet machine), two server setups:
# max_num_seqs 8, and a 54-block KV cache (meant to preempt; it peaked at 72% KV use: lower it to see preemptions).
# Each: runs at 0.5, 2, 1 req/s with step logs; calibrate on 0.5 and 2; validate the held-out 1 req/s run.
set -uo pipefail
cd "$(dirname "$0")/.."; . .venv/bin/activate
W=/tmp/val; rm -rf $W; mkdir -p $W
conveyor trace make --mix chat=1 --seed 5 --num-requests 40 --out $W/trace.jsonl --max-model-len 800 > /dev/null
setup() {  # NAME FLAGS...
  name=$1; shift
  conveyor serve --port 8031 --step-log-size 20000 "$@" > $W/serve_$name.log 2>&1 &
  pid=$!
  for _ in $(seq 1 120); do curl -sf localhost:8031/health > /dev/null && break; sleep 1; done
  for r in 0.5 2 1; do
    conveyor bench run --base-url http://127.0.0.1:8031 --trace $W/trace.jsonl --rate $r --num-requests 16 \
      --collect-step-log --no-progress --out $W/$name/rate-$r > $W/$name-run-$r.log 2>&1
    echo "$name rate $r rc=$?"
  done
  kill $pid; wait $pid 2>/dev/null
  conveyor bench calibrate $W/$name/rate-0.5 $W/$name/rate-2 --held-out $W/$name/rate-1 --out $W/$name/calib.json 2>&1 | tail -4
  conveyor simulate --validate $W/$name/rate-1 --calibration $W/$name/calib.json --out-dir $W/$name/validation 2>&1 | tail -12
}
echo "load before: $(cat /proc/loadavg)"
setup seqs8 --max-num-seqs 8 --max-model-len 800
setup smallkv --max-num-seqs 8 --max-model-len 800 --kv-cache-memory 40000000
echo "load after: $(cat /proc/loadavg)"
