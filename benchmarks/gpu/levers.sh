#!/usr/bin/env bash
# A lever's before and after in one call (issue 38), on one GPU machine: the "before" is a `git archive` of
# src/ carried as .peers/src_before (`bash benchmarks/gpu/levers.sh before COMMIT`, here), the "after" this tree.
#   carry .peers/c1/deps.tar.xz, .peers/c1/tok.tar.xz, .peers/src_before:
#   bash benchmarks/gpu/levers.sh stage && bash benchmarks/gpu/levers.sh tests && bash benchmarks/gpu/levers.sh kernels
#   bash benchmarks/gpu/levers.sh nano qwen3-0.6b 2      # nano256, before / after alternating, 2 of each
#   TREES="before mid after" ...                         # a third tree: .peers/src_mid (git archive, as `before`)
#   bash benchmarks/gpu/levers.sh mixed                  # mixed_profile.py on both trees
#   bash benchmarks/gpu/levers.sh gemm qwen3-0.6b 256    # cuBLAS vs triton_gemm's candidate tiles (this tree)
#   bash benchmarks/gpu/levers.sh probe --rows 256 64    # splitk_probe.py (this tree)
# Logs and results.jsonl (one RESULT line per run, in run order) under $OUT; a `tree` key says which tree.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
BEFORE=$PWD/.peers/src_before/src AFTER=$PWD/src

tree_path() { case $1 in before) echo "$BEFORE" ;; mid) echo "$PWD/.peers/src_mid/src" ;; *) echo "$AFTER" ;; esac; }

step=$1; shift
case $step in
  before)  # here, not on the device
    rm -rf .peers/src_before && mkdir -p .peers/src_before && git archive "$1" src | tar -x -C .peers/src_before ;;
  stage)
    mkdir -p /tmp/site0 && tar -C /tmp/site0 -xJf .peers/c1/deps.tar.xz && tar -C /tmp -xJf .peers/c1/tok.tar.xz
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader ;;
  tests)  # the GPU tests of the kernels the levers touch, on this tree
    PYTHONPATH=$AFTER:/tmp/site0 timeout -s KILL "${GUARD:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider \
      "${@:-tests/kernels}" tests/worker/test_sampler_gpu.py > "$OUT/gpu_tests.txt" 2>&1
    echo "tests rc=$?"; tail -15 "$OUT/gpu_tests.txt" | cut -c1-250 ;;
  kernels)  # microbenchmarks on both trees, before first
    for t in before after; do
      PYTHONPATH=$(tree_path $t):/tmp/site0 timeout 150 python3 benchmarks/gpu/kernels.py --mixed-only --order \
        > "$OUT/kernels_$t.log" 2>&1; echo "kernels $t rc=$?"; grep -v KERNEL "$OUT/kernels_$t.log" | tail -22
      for b in sampler_kernels small_kernels; do
        [ -f benchmarks/gpu/$b.py ] || continue
        PYTHONPATH=$(tree_path $t):/tmp/site0 timeout 120 python3 benchmarks/gpu/$b.py > "$OUT/${b}_$t.log" 2>&1
        echo "$b $t rc=$?"; tail -12 "$OUT/${b}_$t.log" | cut -c1-200
      done
    done ;;
  nano)  # MODEL_NAME REPEATS: nano256 (offline.py as fp8.sh runs it), before and after alternating
    model=$1; reps=${2:-1}
    for i in $(seq "$reps"); do for t in ${TREES:-before after}; do
      PYTHONPATH=$(tree_path $t):/tmp/site0 timeout -s KILL "${GUARD:-240}" python3 benchmarks/gpu/offline.py \
        --model benchmarks/models/$model --async-scheduling --max-num-seqs 1024 --max-num-batched-tokens 16384 \
        --out "$OUT/nano_$t.jsonl" --step-times-out "$OUT/steps_${model}_${t}_$i.jsonl" \
        > "$OUT/nano_${model}_${t}_$i.log" 2>&1
      echo "nano $model $t $i rc=$?"; grep -h RESULT "$OUT/nano_${model}_${t}_$i.log" | grep -o '"output_tok_s": [0-9.]*'
    done; done ;;
  gemm)  # MODEL_NAME ROWS...: cuBLAS against triton_gemm's tiles at each projection shape (fp8_gemm.py --configs)
    model=$1; shift
    PYTHONPATH=$AFTER:/tmp/site0 timeout -s KILL "${GUARD:-150}" python3 benchmarks/gpu/fp8_gemm.py --model "$model" \
      --rows "$@" --configs > "$OUT/gemm_$model.log" 2>&1
    echo "gemm $model rc=$?"; grep -v '^GEMMCFG' "$OUT/gemm_$model.log" | tail -8 | cut -c1-400
    grep -h '"rank": 0,' "$OUT/gemm_$model.log" | cut -c1-300 ;;
  probe)  # split-K o/down projections reduced in add_rms_norm, against cuBLAS, in CUDA graphs (this tree)
    PYTHONPATH=$AFTER:/tmp/site0 timeout -s KILL "${GUARD:-200}" python3 benchmarks/gpu/splitk_probe.py "$@" \
      > "$OUT/splitk_probe.log" 2>&1
    echo "probe rc=$?"; cut -c1-330 "$OUT/splitk_probe.log" | tail -20 ;;
  mixed)
    for t in before after; do
      PYTHONPATH=$(tree_path $t):/tmp/site0 timeout 150 python3 benchmarks/gpu/mixed_profile.py \
        --model benchmarks/models/llama-3.1-8b > "$OUT/mixed_$t.log" 2>&1
      echo "mixed $t rc=$?"; tail -1 "$OUT/mixed_$t.log" | cut -c1-330
    done ;;
esac
exit 0
