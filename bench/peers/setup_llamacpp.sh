#!/usr/bin/env bash
# Builds llama.cpp (through llama-cpp-python, which PyPI ships only as an sdist)
# into bench/.peers/llamacpp, once. bench/decode.py --peer llama.cpp uses it.
#
# -DGGML_NATIVE=ON so ggml uses the CPU's own instruction set (AVX2/FMA/F16C
# on the bench machine): a generic build would understate llama.cpp.
# About 20 minutes on 2 idle cores (40 on a busy shared machine). Pinned to the
# version the bench figures were taken with (LLAMA_CPP_PYTHON_VERSION= for another).
#
# The HF -> GGUF conversion is bench/peers/hf_to_gguf.py on the `gguf` package's
# writer (numpy only), not the sdist's convert_hf_to_gguf.py: that one imports
# torch, and torch from PyPI is the CUDA build with gigabytes of nvidia wheels.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
venv="$here/.peers/llamacpp"
py="${PYTHON:-python3.11}"

[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip="$venv/bin/pip"
"$pip" install -q --upgrade pip
# ggml's build needs cmake >= 3.21; use the system's when present.
command -v cmake >/dev/null || "$pip" install -q cmake
"$pip" install -q numpy gguf safetensors

if ! "$venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
  CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL="${JOBS:-2}" \
    "$pip" install -v --no-cache-dir "llama-cpp-python==${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
fi
"$venv/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__, 'ok')"
