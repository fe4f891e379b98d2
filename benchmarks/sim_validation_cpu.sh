#!/usr/bin/env bash
# issue 36: held-out validation of `conveyor simulate` on this CPU (run it on a quiet machine), three server setups:
# max_num_seqs 8; a 54-block KV cache (peaks at ~72% KV use, no preemption); and `preempt`, a 32-block cache
# (--kv-cache-memory 23600000: 737,280 bytes a block for SmolLM2-135M in float32) serving a trace of longer
# answers (output median 128, max-model-len 512: the longest request needs all 32 blocks), which preempts at
# 2 and 3 req/s (1 at 1 req/s) at two threads, 6-7, 9-11 and 11-13 times at 1, 2, 3 req/s at one (pinned).
# Each setup: three 16-request runs with step logs, calibrated on the first two rates and validated on the
# held-out third (0.5, 2 -> 1 req/s; the preemption setup 1, 3 -> 2 req/s, so the held-out run preempts
# several times and recompute steps are in the fit).
# On a shared machine serialize timed work: flock /tmp/cpu-measure.lock bash benchmarks/sim_validation_cpu.sh
# SETUPS="..." picks setups; W=DIR keeps the outputs elsewhere (default /tmp/val); VENV=DIR names the
# virtual environment (default .venv); PORT=N the server's port (default 8031). NREQ=N requests a run
# (default 16; the traces grow past 40 to fit); REPEATS=K serves each rate K times on the one server, fits on
# every repeat of the two fit rates and validates each held-out repeat (run dirs rate-R-repK).
# PIN=split (the default) runs the engine core alone on cpu 0 with one torch thread, the API server and the
# load generator on cpu 1; PIN=1 the whole server on cpu 0 (one thread), the load generator on cpu 1; PIN=0
# pins nothing and leaves the engine its default threads (two on two cores), as before 2026-12-07.
# On 2026-12-07 (an AMD EPYC, 2 vCPUs; docs/decision.md, "Pinning the server and the load generator"),
# held-out runs meeting the goals: PIN=0 0 of 6 (held-out pace 0.92-1.10), PIN=1 5 of 9, PIN=split 8 of 12
# (pace 0.90-1.04; REPEATS=2, twice); five runs of one server drifted with a pace sd of 5.5-15% unpinned at
# two threads, 1.4-1.9% pinned at one. Two held-out repeats still differ from each other by up to 16% in
# E2E p50, so single 16-request runs do not meet the goals reliably even pinned (NREQ=32: 0 of 3, one try).
# HELD_OUT_FIRST=1 runs the held-out rate first instead of last (the same roles); WARMUP_RUN=1 serves one
# more run first and keeps it out of both. On 2026-12-06, unpinned, neither made the held-out run's step
# cost track the fit: it drifted ±15-25% from run to run either way.
set -uo pipefail
cd "$(dirname "$0")/.."; . "${VENV:-.venv}/bin/activate"
W=${W:-/tmp/val}; rm -rf "$W"; mkdir -p "$W"; PORT=${PORT:-8031}; NREQ=${NREQ:-16}
PIN=${PIN:-split}; SRV=(); CLI=(); THREADS=()
# PIN=1: the server (engine, one torch thread, and API server) on cpu 0, the client on cpu 1
[ "$PIN" = 1 ] && { SRV=(taskset -c 0); CLI=(taskset -c 1); THREADS=(--num-threads 1); }
# PIN=split: the engine core alone on cpu 0 (one torch thread), the API server and the client on cpu 1
[ "$PIN" = split ] && { SRV=(taskset -c 1); CLI=(taskset -c 1); THREADS=(--num-threads 1); }
pin_engine() {  # SERVE_PID: under PIN=split, move the engine core process (the spawned child) to cpu 0
  [ "$PIN" = split ] || return 0
  for child in $(pgrep -P $1 -f spawn_main); do taskset -a -p -c 0 $child > /dev/null; done
}
TRACE_N=$(( NREQ > 40 ? NREQ : 40 )); REPEATS=${REPEATS:-1}
conveyor trace make --mix chat=1 --seed 5 --num-requests $TRACE_N --out $W/trace.jsonl --max-model-len 800 > /dev/null
conveyor trace make --mix chat=1 --seed 5 --num-requests $TRACE_N --out $W/trace-long.jsonl --max-model-len 512 \
  --param chat.output_len_median=128 > /dev/null
run_dir() {  # NAME RATE REPEAT -> the run's directory (rate-R with one repeat, rate-R-repK with several)
  if [ "$REPEATS" = 1 ]; then echo $W/$1/rate-$2; else echo $W/$1/rate-$2-rep$3; fi
}
bench() {  # TRACE RATE OUT_DIR LOG EXTRA...: one NREQ-request run against the server on $PORT
  "${CLI[@]}" conveyor bench run --base-url http://127.0.0.1:$PORT --trace $1 --rate $2 --num-requests $NREQ \
    --no-progress --out $3 "${@:5}" > $4 2>&1
}
serve_runs() {  # NAME TRACE "FIT_RATE FIT_RATE HELD_OUT_RATE" FLAGS...: one server, every run of the setup
  name=$1; trace=$2; rates=($3); shift 3
  "${SRV[@]}" conveyor serve --port $PORT --step-log-size 20000 "${THREADS[@]}" "$@" > $W/serve_$name.log 2>&1 &
  pid=$!
  for _ in $(seq 1 120); do curl -sf localhost:$PORT/health > /dev/null && break; sleep 1; done
  pin_engine $pid
  order=("${rates[@]}"); [ "${HELD_OUT_FIRST:-0}" = 1 ] && order=("${rates[2]}" "${rates[0]}" "${rates[1]}")
  # WARMUP_RUN=1: one run at the held-out rate, kept out of the fit and the check
  [ "${WARMUP_RUN:-0}" = 1 ] && bench $trace "${rates[2]}" $W/$name/warmup $W/$name-warmup.log
  for k in $(seq 1 $REPEATS); do
    for r in "${order[@]}"; do
      d=$(run_dir $name $r $k); bench $trace $r $d $W/$name-run-$r-$k.log --collect-step-log
      echo "$name rate $r repeat $k rc=$? $(python -c 'import json,sys; s=json.load(open(sys.argv[1])); print("completed", s["completed"], "failed", s["failed"], "preemptions", s["server"].get("num_preemptions"), "kv peak", s["server"].get("kv_cache_usage_max"))' $d/summary.json)"
    done
  done
  kill $pid; wait $pid 2>/dev/null
}
setup() {  # NAME TRACE "FIT_RATE FIT_RATE HELD_OUT_RATE" FLAGS...: serve, fit on the first two rates, validate the third
  serve_runs "$@"
  fit=(); held=()
  for k in $(seq 1 $REPEATS); do
    fit+=($(run_dir $name ${rates[0]} $k) $(run_dir $name ${rates[1]} $k)); held+=($(run_dir $name ${rates[2]} $k))
  done
  conveyor bench calibrate "${fit[@]}" --held-out "${held[@]}" --out $W/$name/calib.json 2>&1 | tail -4
  conveyor simulate --validate "${held[@]}" --calibration $W/$name/calib.json \
    --out-dir $W/$name/validation 2>&1 | tail -$(( 11 + REPEATS + (REPEATS > 1) ))  # + the repeats' mean row
}
echo "load before: $(cat /proc/loadavg)"
lscpu | grep -E '^Model name|^CPU\(s\)'
for name in ${SETUPS:-seqs8 smallkv preempt}; do  # SETUPS="preempt" runs one
  case $name in
    seqs8) setup seqs8 $W/trace.jsonl "0.5 2 1" --max-num-seqs 8 --max-model-len 800 ;;
    smallkv) setup smallkv $W/trace.jsonl "0.5 2 1" --max-num-seqs 8 --max-model-len 800 --kv-cache-memory 40000000 ;;
    preempt) setup preempt $W/trace-long.jsonl "1 3 2" --max-num-seqs 8 --max-model-len 512 --kv-cache-memory 23600000 ;;
  esac
done
echo "load after: $(cat /proc/loadavg)"
