#!/usr/bin/env bash
# The KV blocks conveyor allocates on this GPU for the study's shape (Qwen3-32B, random weights), at each
# max_num_seqs given: the server starts, its KV-cache lines are printed, it stops. No load is sent.
#   PYTHONPATH=SRC:/tmp/site0 bash benchmarks/gpu/kv_blocks.sh 1024 256
set -u
for seqs in "$@"; do
  log=/tmp/kv_blocks_$seqs.log
  bash benchmarks/gpu/study/serve.sh conveyor --port 8077 --max-num-seqs "$seqs" > "$log" 2>&1 &
  pid=$!
  for _ in $(seq 1 180); do curl -sf localhost:8077/health > /dev/null && break; sleep 1; done
  echo "== max_num_seqs $seqs"; grep -iE "kv cache|kv blocks|num_gpu_blocks|gpu blocks|concurrency" "$log" | cut -c1-240 | head -5
  kill "$pid"; wait "$pid" 2>/dev/null
done
