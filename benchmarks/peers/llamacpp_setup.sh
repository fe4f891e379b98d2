#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` as a CPU peer for benchmarks/cpu_vs_vllm.sh (issue 39). The source is
# the llama.cpp that the llama-cpp-python 0.3.36 sdist vendors: that is the build earlier measurements used
# (`llama-server -np 8 -t 2`), and PyPI is the one source this machine can reach (no git clone).
# Built with -DGGML_NATIVE=ON (this CPU's own instruction set, as conveyor's kernels get) and -j2; only the
# server target, ~15 minutes on 2 cores. Idempotent: each step is skipped when its output exists.
# Prints the path of llama-server on its last line. CI never runs this.
# Usage: benchmarks/peers/llamacpp_setup.sh [DIR]   (default /tmp/conveyor-peers/llamacpp)
#   run it under `nice -n 19` on a shared machine.
# GGML_CPU_FLAGS replaces -DGGML_NATIVE=ON: on a KVM Intel Xeon that lists AMX and AVX512-FP16 in cpuid, the
# -march=native build died at start with SIGILL (Illegal instruction), so there it is built with the AVX-512
# families named instead (docs/performance.md, "llama.cpp as a CPU peer"):
#   GGML_CPU_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
#   -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON" benchmarks/peers/llamacpp_setup.sh DIR
set -euo pipefail
DIR=${1:-/tmp/conveyor-peers/llamacpp}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
JOBS=${JOBS:-2}
mkdir -p "$DIR/dl"
cd "$DIR"
src=$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp
build=$DIR/build
bin=$build/bin/llama-server
if [ -x "$bin" ]; then echo "$bin"; exit 0; fi
for tool in cmake make c++ tar; do
  command -v "$tool" >/dev/null || { echo "llamacpp_setup: $tool is not installed" >&2; exit 1; }
done
# 1. the sdist (source only: --no-binary so pip does not hand back a wheel without the C++ tree)
sdist=$(ls dl/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)
if [ -z "$sdist" ]; then
  pip download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d dl \
    || { echo "llamacpp_setup: pip download of llama-cpp-python==$VERSION failed" >&2; exit 1; }
  sdist=dl/llama_cpp_python-$VERSION.tar.gz
fi
[ -f "$sdist" ] || { echo "llamacpp_setup: no sdist at $DIR/$sdist" >&2; exit 1; }
# 2. unpack (the tarball's top directory is llama_cpp_python-VERSION)
[ -f "$src/CMakeLists.txt" ] || tar -xzf "$sdist"
[ -f "$src/CMakeLists.txt" ] || { echo "llamacpp_setup: no vendored llama.cpp at $src" >&2; exit 1; }
# 3. configure: no libcurl (no network at run time; the model is a local GGUF), no tests/examples to build
[ -f "$build/CMakeCache.txt" ] || cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release ${GGML_CPU_FLAGS:--DGGML_NATIVE=ON} \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON > configure.log 2>&1 \
  || { echo "llamacpp_setup: cmake configure failed, see $DIR/configure.log" >&2; exit 1; }
# 4. build only the server target
cmake --build "$build" --target llama-server -j "$JOBS" > build.log 2>&1 \
  || { echo "llamacpp_setup: build failed, see $DIR/build.log" >&2; exit 1; }
[ -x "$bin" ] || { echo "llamacpp_setup: built, but no $bin" >&2; exit 1; }
echo "$bin"
