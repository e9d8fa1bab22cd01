"""qexp: experiment tracking for LLM quantization on Qualcomm HTP with ExecuTorch."""

import os

# qexp runs offline by design: models and text come from installed packages and user paths. Without these, the
# Hugging Face libraries try the network first and wait for time-outs. Set them to 0 to allow downloads.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# MLflow's usage telemetry: a thread that posts to the internet (unreachable offline) and sets and unsets an
# environment variable while `requests` reads the environment, which failed requests to a tracking server with
# KeyError '_MLFLOW_TELEMETRY_SESSION_ID' under load (benchmarks/bench_store_writers.py).
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

# The same numbers on every x86-64 host: PyTorch picks its CPU kernels by the host's instruction set (DEFAULT,
# AVX2, AVX512), and the QDQ program's fake quantization turns their last-bit differences into different rounding:
# SmolLM2 16a4w, 2 windows, one AMD EPYC host, ppl 45.72 with AVX512 kernels, 46.09 with AVX2, 45.41 with DEFAULT
# (FP: 1e-8 relative). qexp pins the AVX2 kernels, which every x86-64 host of the last decade has; MKL's own dispatch
# is pinned the same way (MKL_CBWR; measured no change on this AMD host, meant for Intel hosts with AVX512). Both are
# read at PyTorch's first operation, so they are set at import; set ATEN_CPU_CAPABILITY yourself (e.g. avx512) for
# ~25% faster CPU evaluation at the cost of numbers that differ from other hosts'. Runs tag what they used
# (numerics.cpu_capability) and the report refuses to mix them. STRICT: on an Intel Xeon host MKL's sgemm gave
# different last bits with 1 and 2 threads (tiny wide model, 16a4w: ppl_qdq 2217.659 vs 2217.640) under MKL_CBWR=AVX2;
# MKL's strict conditional-numerical-reproducibility mode makes them bit-identical (tests/test_reproducibility.py).
os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
# Across CPU vendors this is not enough: MKL's AVX2 branch is Intel's only (on other CPUs MKL takes its AUTO branch),
# and on an Intel host the AVX2, COMPATIBLE and AUTO branches give different sgemm bits; COMPATIBLE is the branch MKL
# documents for Intel and compatible CPUs alike, at ~2.6x the sgemm time (docs/reproducibility.md). Set
# MKL_CBWR=COMPATIBLE yourself to try it: runs tag it (numerics.mkl_cbwr) and the cache keys include it.
os.environ.setdefault("MKL_CBWR", "AVX2,STRICT")

__version__ = "0.1.0"
