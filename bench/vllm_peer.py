"""What the benchmarks that run vLLM's CPU build share: where its venv is
(bench/peers/setup_vllm.sh builds it), how it is started, and when its bfloat16 is slow."""

from pathlib import Path

VLLM_PYTHON = Path(__file__).resolve().parent / ".peers" / "vllm" / "bin" / "python"
# vLLM's CPU backend: 1 GiB of KV cache (what the bench model needs many times over), no
# core binding on a shared machine.
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1"}


def have_vllm() -> bool:
    return any(VLLM_PYTHON.parent.parent.glob("lib/python*/site-packages/vllm/__init__.py"))


def bf16_note(dtype: str) -> str | None:
    """A warning where vLLM's bfloat16 is emulated: without AVX512-BF16 (or AMX) its oneDNN
    bf16 matmuls fail and it falls back to torch's, several times slower than float32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    if dtype != "bfloat16" or "avx512_bf16" in flags or "amx_bf16" in flags:
        return None
    return ("note: this CPU has no AVX512-BF16: vLLM's bfloat16 runs emulated; "
            "--vllm-dtype float32 shows vLLM at its best here")
