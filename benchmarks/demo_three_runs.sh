#!/usr/bin/env bash
# Three independent `conveyor demo` runs, one after the other, and their recommendations side by side.
# On a quiet machine (nothing else running): each run is ~6-10 minutes on 2 cores.
#   bash benchmarks/demo_three_runs.sh [OUT_PREFIX]        (default: demo-run -> demo-run1, demo-run2, demo-run3)
set -uo pipefail
PREFIX=${1:-demo-run}
for i in 1 2 3; do
    start=$(date +%s)
    conveyor demo --out "$PREFIX$i" --force > "$PREFIX$i.txt" 2> "$PREFIX$i.log"
    echo "run $i: exit $? in $(( $(date +%s) - start )) s, load average $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$PREFIX$i.txt"
done
grep -h "^Demo recommendation" "$PREFIX"1.txt "$PREFIX"2.txt "$PREFIX"3.txt
