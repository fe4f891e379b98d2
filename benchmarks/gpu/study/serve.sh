#!/usr/bin/env bash
# The server command of the GPU study (conveyor.toml, vllm.toml): one engine on the Qwen3-32B shape with
# random weights. It first waits (up to 60 s) until the GPU's memory is free: the configuration before it
# may still be releasing ~70 GiB, and both engines size their KV cache from the memory they find.
#   bash benchmarks/gpu/study/serve.sh conveyor|vllm SERVER_FLAGS...
set -u
engine=$1; shift
for _ in $(seq 1 60); do
  used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
  [ "${used:-0}" -lt 2000 ] && break
  sleep 1
done
model=benchmarks/models/qwen3-32b
case $engine in
  conveyor) exec python3 -m conveyor serve $model --load-format dummy --tokenizer /tmp/tok --device cuda \
              --max-model-len 4096 "$@" ;;
  vllm) PYTHONPATH=/tmp/site exec python3 -m vllm.entrypoints.cli.main serve $model --load-format dummy \
          --tokenizer /tmp/tok --max-model-len 4096 --seed 0 "$@" ;;
  *) echo "serve.sh: engine must be conveyor or vllm, got $engine"; exit 2 ;;
esac
