#!/usr/bin/env bash
# Build llama-cpp-python (llama.cpp's Python binding) into the project's .venv for benchmarks/bench_llama_cpp.py.
# Not part of the main install: it compiles llama.cpp from source (~10 min on 2 cores), CPU only, native ISA.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
if .venv/bin/python -c "import llama_cpp" 2>/dev/null; then
  echo "llama-cpp-python already installed: $(.venv/bin/python -c 'import llama_cpp; print(llama_cpp.__version__)')"
  exit 0
fi
CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_OPENMP=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF" \
  CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
  .venv/bin/pip install --no-cache-dir --no-deps "llama-cpp-python==0.3.36" "diskcache>=5.6"
# --no-deps: its other requirements (numpy, jinja2, typing-extensions) are already pinned by the main install
