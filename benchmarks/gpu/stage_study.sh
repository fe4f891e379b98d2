#!/usr/bin/env bash
# Packs what benchmarks/gpu/study.sh needs on the GPU machine into three carried folders, each small enough
# to travel with the working tree (64 MiB a call, the tree itself ~5 MiB):
#   .peers/c1: conveyor's serving dependencies (cp312), SmolLM2's tokenizer, vLLM piece a
#   .peers/c2: vLLM piece b        .peers/c3: vLLM piece c
# vLLM 0.24.0 and its extra packages come from the peer's own staging script (../shared/peers/h200), so
# both engines run on the GPU machine's torch 2.11 + CUDA 13. Run here, from the repository root (~3 min):
#   echo /.peers/ >> .git/info/exclude; cp -r ../shared/peers/h200 .peers/h200; bash .peers/h200/stage_vllm.sh
#   python benchmarks/gpu/write_tokenizer.py /tmp/tok; bash benchmarks/gpu/stage_study.sh
set -euo pipefail
ROOT=$(pwd); WORK=$ROOT/.peers/_work; SITE=$WORK/site
[ -f "$WORK/vllm_site.tar.xz" ] || { echo "run .peers/h200/stage_vllm.sh first"; exit 2; }
rm -rf "$ROOT"/.peers/c1 "$ROOT"/.peers/c2 "$ROOT"/.peers/c3 "$WORK/split" && mkdir -p "$ROOT"/.peers/c{1,2,3} "$WORK/split"
# conveyor serve's imports that the GPU machine's image lacks (the image has aiohttp, scipy, prometheus_client,
# tokenizers, safetensors, jinja2, pyyaml, uvloop): the same versions vLLM's site pins, plus gguf.
python3 -m pip download -q --no-deps --only-binary=:all: -d "$WORK/gguf" gguf==0.17.1
rm -rf "$WORK/deps" && mkdir -p "$WORK/deps"
(cd "$SITE" && cp -r annotated_types* fastapi* llguidance* msgspec* pydantic* pyzmq* zmq sniffio* starlette* \
   typing_extensions* typing_inspection* uvicorn* "$WORK/deps/")
(cd "$WORK/deps" && unzip -q -o "$WORK"/gguf/gguf-*.whl)
tar -C "$WORK/deps" -cf - . | xz -6 -T0 > "$ROOT/.peers/c1/deps.tar.xz"
[ -d /tmp/tok ] || { echo "write SmolLM2's tokenizer first: python benchmarks/gpu/write_tokenizer.py /tmp/tok"; exit 2; }
tar -C /tmp -cJf "$ROOT/.peers/c1/tok.tar.xz" tok
(cd "$WORK/split" && split -n 3 -a 1 "$WORK/vllm_site.tar.xz" vllm.)
mv "$WORK/split/vllm.a" "$ROOT/.peers/c1/"; mv "$WORK/split/vllm.b" "$ROOT/.peers/c2/"; mv "$WORK/split/vllm.c" "$ROOT/.peers/c3/"
# vLLM's --quantization imports compressed-tensors (pinned by vLLM 0.24.0) even for its own fp8 method;
# the peer's site lacks it and loguru, its one import the GPU image lacks (issue 37's FP8 runs).
mkdir -p "$ROOT/.peers/c3/whl" && python3 -m pip download -q --no-deps --only-binary=:all: -d "$ROOT/.peers/c3/whl" \
  compressed-tensors==0.17.0 loguru==0.7.3
sha256sum "$WORK/vllm_site.tar.xz" | cut -d' ' -f1 | tee "$ROOT/.peers/vllm_site.full.sha256" > "$ROOT/.peers/c3/vllm_site.full.sha256"
du -sh "$ROOT"/.peers/c?
