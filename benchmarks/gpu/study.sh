#!/usr/bin/env bash
# The GPU study of issue 35 on one GPU machine: conveyor (defaults, max_num_seqs 256) and vLLM 0.24.0 (defaults)
# on the Qwen3-32B shape, one trace, one objective, all driven by `conveyor bench study`
# (benchmarks/gpu/study/*.toml). Three calls per machine, one right after the other (the machine stays
# warm ~30 s between calls and /tmp survives), each carrying one of .peers/c1..c3 (benchmarks/gpu/stage_study.sh):
#   call 1, carry .peers/c1:  bash benchmarks/gpu/study.sh stage 1 && bash benchmarks/gpu/study.sh study conveyor TAG
#   call 2, carry .peers/c2:  bash benchmarks/gpu/study.sh stage 2
#   call 3, carry .peers/c3:  bash benchmarks/gpu/study.sh stage 3 && bash benchmarks/gpu/study.sh unpack && \
#                             bash benchmarks/gpu/study.sh study vllm TAG
# The sustained studies (sustained_*.toml: 90 s of arrivals per point, step logs) first write their trace:
#   carry .peers/c1:  bash benchmarks/gpu/study.sh stage 1 && bash benchmarks/gpu/study.sh trace && \
#                     bash benchmarks/gpu/study.sh study sustained_h100 TAG
# Each study comes back as $OUT/study_ENGINE_TAG.tar.gz (the run directories), with the GPU's memory sampled
# every second ($OUT/nvsmi_ENGINE_TAG.csv) and the KV-cache lines of each server log printed.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD/src:/tmp/site0

step=$1; shift
case $step in
  stage)
    mkdir -p /tmp/stage && cp .peers/c"$1"/vllm.* /tmp/stage/
    if [ "$1" = 1 ]; then
      mkdir -p /tmp/site0 && tar -C /tmp/site0 -xJf .peers/c1/deps.tar.xz && tar -C /tmp -xJf .peers/c1/tok.tar.xz
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      python3 -c 'import torch, fastapi, uvicorn, pydantic, zmq, msgspec, llguidance; print("torch", torch.__version__, torch.cuda.get_device_name())'
    fi
    ls /tmp/stage ;;
  trace)
    # The sustained studies' 800-request trace (sustained_*.toml): the first study's command with more
    # requests, written here rather than committed (6 MB). 800 requests cover 8 req/s for 90 s.
    python3 -m conveyor trace make --mix chat=1 --num-requests 800 --seed 0 --param chat.prompt_len_median=1024 \
      --param chat.prompt_len_max=2048 --param chat.output_len_median=384 --param chat.output_len_max=768 \
      --param chat.sigma=0.4 --max-model-len 4096 --out benchmarks/gpu/study/trace800.jsonl \
      && ls -la benchmarks/gpu/study/trace800.jsonl ;;
  unpack)
    got=$(cat /tmp/stage/vllm.a /tmp/stage/vllm.b /tmp/stage/vllm.c | sha256sum | cut -d' ' -f1)
    [ "$got" = "$(cat .peers/c3/vllm_site.full.sha256)" ] || { echo "vLLM pieces corrupt"; exit 3; }
    rm -rf /tmp/site && mkdir -p /tmp/site && cat /tmp/stage/vllm.a /tmp/stage/vllm.b /tmp/stage/vllm.c | tar -xJ -C /tmp/site
    for w in .peers/c3/whl/*.whl; do [ -f "$w" ] && python3 -m zipfile -e "$w" /tmp/site; done
    du -sh /tmp/site ;;
  study)
    engine=$1; tag=$2; dir=/tmp/study_${engine}_$tag
    nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv -l 1 > "$OUT/nvsmi_${engine}_$tag.csv" &
    smi=$!
    timeout -k 20 "${GUARD:-540}" python3 -m conveyor bench study benchmarks/gpu/study/"$engine".toml --out "$dir" \
      > "$OUT/study_${engine}_$tag.log" 2>&1
    echo "study $engine $tag rc=$?"; kill $smi
    # A study cut by the guard leaves its server running (launched in its own session): stop it, or the
    # next server finds the GPU's memory taken (vLLM refuses to start; conveyor sizes a smaller KV pool).
    pkill -f 'serve[.]sh'; pkill -f 'conveyo[r] serve'; pkill -f 'vllm[.]entrypoints'; sleep 5
    grep -E "^\[|point|rate" "$OUT/study_${engine}_$tag.log" | grep -v "%|" | cut -c1-220 | tail -40
    for log in "$dir"/*/server.log; do
      echo "== $log"; grep -iE "kv cache|kv blocks|num_gpu_blocks|maximum concurrency|gpu blocks" "$log" | cut -c1-240 | head -5
    done
    tar -C /tmp -czf "$OUT/study_${engine}_$tag.tar.gz" "study_${engine}_$tag"
    ls -la "$OUT" ;;
esac
exit 0
