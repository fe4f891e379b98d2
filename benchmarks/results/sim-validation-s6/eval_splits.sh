#!/usr/bin/env bash
# issue 36: calibrate and validate the CPU trials with one checkout's code, holding out each rate in turn.
# usage: eval_splits.sh SRC OUT [HELD...] -- SRC: a checkout's src/ (PYTHONPATH), OUT: a scratch folder,
# HELD: indexes of the held-out rate among each setup's (0.5 2 1) / preempt (1 3 2); default "2" (the
# script's own split: 1 req/s, preempt 2 req/s). Trials: TRIALS="/tmp/val-r3 /tmp/val-r3b /tmp/itl-val" (made by
# benchmarks/sim_validation_cpu.sh; REPEATS=3 runs are rate-R-repK, REPEATS=1 rate-R).
# Writes OUT/split-H/TRIAL-SETUP/{calib.json, out.txt, validation/}. Take /tmp/cpu-measure.lock around it.
SRC=$1; OUT=$2; shift 2; HELD=${*:-2}
PY=(env PYTHONPATH=$SRC "${PYTHON:-/work/main/.venv/bin/python}" -m conveyor)
for h in $HELD; do
  for T in ${TRIALS:-/tmp/val-r3 /tmp/val-r3b /tmp/itl-val}; do
    for name in seqs8 smallkv preempt; do
      if [ $name = preempt ]; then all=(1 3 2); else all=(0.5 2 1); fi
      rates=(); for i in 0 1 2; do [ $i != $h ] && rates+=(${all[$i]}); done
      if [ -d $T/$name/rate-${all[0]} ]; then ks=(""); else ks=(-rep1 -rep2 -rep3); fi
      fit=(); held=()
      for k in "${ks[@]}"; do
        fit+=($T/$name/rate-${rates[0]}$k $T/$name/rate-${rates[1]}$k); held+=($T/$name/rate-${all[$h]}$k)
      done
      d=$OUT/split-$h/$(basename $T)-$name; mkdir -p $d
      { "${PY[@]}" bench calibrate "${fit[@]}" --held-out "${held[@]}" --out $d/calib.json 2>&1 | tail -4
        "${PY[@]}" simulate --validate "${held[@]}" --calibration $d/calib.json --out-dir $d/validation 2>&1 | tail -9
      } > $d/out.txt
    done
  done
done
