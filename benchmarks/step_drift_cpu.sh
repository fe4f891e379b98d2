#!/usr/bin/env bash
# issue 36: how far one CPU server's step cost drifts from run to run. One server (`--max-num-seqs 8`, the
# embedded model), the same NREQ-request run N times with step logs, then each run held out in turn: its
# pace (`bench calibrate`'s summed predicted / measured step time) under a fit on the other runs. A pace of
# 0.9 means the run's steps took 11% longer than the others predict; a simulation of it inherits that.
#   flock /tmp/cpu-measure.lock bash benchmarks/step_drift_cpu.sh
# PIN as in sim_validation_cpu.sh: split (default; the engine core alone on cpu 0, one torch thread, the API
# server and the load generator on cpu 1), 1 (the whole server on cpu 0, one thread; the load generator on
# cpu 1) or 0 (nothing pinned, the engine's default threads). N (5), RATE (1), NREQ (16), PORT (8031),
# W (/tmp/drift), VENV (.venv). The 2026-12-07 numbers (docs/decision.md, "Pinning the server and the load
# generator"): pace sd 5.5-15% with PIN=0, 4.1% split, 1.4-1.9% with PIN=1.
set -uo pipefail
cd "$(dirname "$0")/.."; . "${VENV:-.venv}/bin/activate"
W=${W:-/tmp/drift}; rm -rf "$W"; mkdir -p "$W"; PORT=${PORT:-8031}; N=${N:-5}
PIN=${PIN:-split}; SRV=(); CLI=(); THREADS=()
[ "$PIN" = 1 ] && { SRV=(taskset -c 0); CLI=(taskset -c 1); THREADS=(--num-threads 1); }
[ "$PIN" = split ] && { SRV=(taskset -c 1); CLI=(taskset -c 1); THREADS=(--num-threads 1); }
conveyor trace make --mix chat=1 --seed 5 --num-requests 40 --out $W/trace.jsonl --max-model-len 800 > /dev/null
"${SRV[@]}" conveyor serve --port $PORT --step-log-size 20000 --max-num-seqs 8 --max-model-len 800 "${THREADS[@]}" \
  > $W/serve.log 2>&1 &
pid=$!
for _ in $(seq 1 120); do curl -sf localhost:$PORT/health > /dev/null && break; sleep 1; done
if [ "$PIN" = split ]; then  # the engine core process (the spawned child) to cpu 0
  for child in $(pgrep -P $pid -f spawn_main); do taskset -a -p -c 0 $child > /dev/null; done
fi
echo "load before: $(cat /proc/loadavg)"
for i in $(seq 1 $N); do
  "${CLI[@]}" conveyor bench run --base-url http://127.0.0.1:$PORT --trace $W/trace.jsonl --rate ${RATE:-1} \
    --num-requests ${NREQ:-16} --collect-step-log --no-progress --out $W/run-$i > $W/run-$i.log 2>&1 || echo "run $i failed"
done
echo "load after: $(cat /proc/loadavg)"
kill $pid; wait $pid 2>/dev/null
for i in $(seq 1 $N); do  # each run's pace under a fit on the others
  others=$(for j in $(seq 1 $N); do [ $j != $i ] && echo $W/run-$j; done)
  conveyor bench calibrate $others --held-out $W/run-$i --out $W/calib-$i.json | grep '^pace' | sed 's/.*held out /held out /'
done
