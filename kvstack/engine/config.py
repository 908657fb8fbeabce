"""The engine's settings in one validated object (vLLM's EngineArgs / nano-vllm's Config)."""

import ctypes
import dataclasses
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstack.config import (
    ATTENTION_BACKENDS,
    CPU_KERNELS,
    DTYPES,
    NUMERICS,
    REPLAY_MODES,
    ModelConfig,
)
from kvstack.units import parse_bytes

log = logging.getLogger("kvstack")
SPECULATIVE = ("none", "dspark")
SPECULATIVE_SCHEDULES = ("measured", "always")


def _check_device(device: str) -> None:
    import torch

    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r}: not a device name like cpu or cuda") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: CUDA is not available on this machine")
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: kvstack runs on cpu or cuda")


def default_threads() -> int:
    """Half the cores, at most 8 and at least 1: torch's default (every core) collapses
    on a machine that is busy with other work (4-10x slower on a loaded 2-core machine
    than one thread), and a model this size gains little past a few threads."""
    return max(1, min(8, (os.cpu_count() or 1) // 2))


_HEAP_KEEPS = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
_HEAP_RETAINED = 1 << 30


def retain_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for the next allocation: allocations up to
    32 MiB come from its heap, which is not trimmed back to the OS below 1 GiB. By default
    a freed tensor of a few MiB goes back to the OS, so each decode step faults its
    temporaries' pages in anew (about 12,000 page faults in a step of 32 sequences of the
    benchmark model). PyTorch's CPU tuning guide swaps in jemalloc or tcmalloc for the
    same reason; this needs no other library. Process-wide, like the thread count; False
    where the C library is not glibc's."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    done = mallopt(m_mmap_threshold, _HEAP_KEEPS) == 1 and mallopt(
        m_trim_threshold, _HEAP_RETAINED) == 1
    if done:
        log.info("kvstack: malloc keeps freed memory for reuse (allocations up to %d MiB "
                 "from its heap)", _HEAP_KEEPS >> 20)
    return done


@dataclass(frozen=True)
class EngineConfig:
    kv_budget: int | str = "1GiB"  # bytes for the device pools and window rings
    block_tokens: int = 64  # tokens per cache block (a multiple of every ratio)
    max_num_seqs: int = 8  # sequences holding a window-ring slot at once
    # Tokens a step feeds: one per decoding sequence, the rest prompt tokens; a longer
    # prompt is prefilled in parts over several steps. At a CPU's few thousand prompt
    # tokens a second, a part holds the running streams for under a second.
    max_num_batched_tokens: int = 2048
    chunk_size: int = 512  # tokens per prefill chunk
    replay: str = "bounded"  # window rebuild after a prefix hit or a resume
    enable_prefix_caching: bool = True
    # Window states that prefix hits' replays rebuilt, kept so that the next hit on the
    # same cached blocks copies one instead of replaying (kvstack.cache.checkpoints);
    # each takes a window-ring slot's bytes of kv_budget. 0: every hit replays.
    window_checkpoints: int = 16
    cache_dir: str | Path = "~/.cache/kvstack"  # the disk tier and saved sessions
    disk_budget: int | str = "16GiB"
    host_budget: int | str = 0  # host memory for prefix blocks the pool gave up; 0 = none
    disk_prefix_cache: bool = False  # prefix blocks the host tier gives up go to disk
    device: str | None = None  # None: cuda when available, else cpu
    max_model_len: int | None = None  # tokens per sequence; None: the model's max_seq_len
    threads: int | None = None  # torch intra-op threads; None: default_threads()
    numerics: str = "default"  # one of kvstack.config.NUMERICS
    dtype: str = "auto"  # the weight matrices' (kvstack.config.DTYPES)
    # Decode steps through torch.compile, one graph per batch-size bucket: minutes to
    # compile on a bucket's first step on a small CPU, faster steps after (Model.compile_decode).
    compile_decode: bool = False
    # ATTENTION_BACKENDS: auto is torch; "triton" (CUDA, the kernel's cache formats) runs
    # the Triton kernels of kvstack.cache.kernels (split-K, untimed on a GPU so far).
    attention: str = "auto"
    # CPU_KERNELS: auto runs a CPU step's packed-row reads, index scoring, expert matmuls
    # and the matmuls on a checkpoint's packed FP8/FP4/bf16 weights by C kernels
    # (kvstack.native) where the system's C compiler builds them, and says in the log when
    # it cannot; "c" requires them; "torch" never (packed weights dequantised per call).
    cpu_kernels: str = "auto"
    # SPECULATIVE: "dspark" drafts greedy requests' next tokens with the model's DSpark
    # layers and verifies them in one target call (lossless: the outputs are the target's);
    # "none" decodes one token a step.
    speculative: str = "none"
    # With speculative="dspark": at most this many drafts verified a step (SGLang's DSpark
    # block size, vLLM's num_speculative_tokens); None: the draft's whole block
    # (dspark_block_size, what it was trained to propose), which is also the most.
    speculative_tokens: int | None = None
    # SPECULATIVE_SCHEDULES, with speculative="dspark": "measured" drafts for a sequence
    # while its verifies keep more tokens than the time they take would make plainly,
    # timed in the engine's own steps (kvstack.engine.pace); "always" drafts every step.
    speculative_schedule: str = "measured"
    # Ranks the model is split over (`kvstack.parallel`: heads, index heads, Engram rows
    # and vocabulary by rank), one process and one device each; with expert_parallel
    # the routed experts go whole by rank, else each expert is split by its inter dim.
    # kv_budget is each rank's, and every rank keeps every token's whole record.
    tensor_parallel_size: int = 1
    expert_parallel: bool = False
    # How long rank 0 waits on another rank in a collective before the engine fails.
    parallel_timeout_s: float = 120.0
    # The largest encoded image a request may carry (a model with a vision tower).
    max_image_bytes: int | str = "10MiB"

    def __post_init__(self) -> None:
        def positive(key: str) -> None:
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"engine setting {key} must be a positive integer, got "
                                 f"{value!r}")

        for key in ("block_tokens", "max_num_seqs", "max_num_batched_tokens", "chunk_size",
                    "tensor_parallel_size"):
            positive(key)
        if (not isinstance(self.window_checkpoints, int)
                or isinstance(self.window_checkpoints, bool) or self.window_checkpoints < 0):
            raise ValueError("engine setting window_checkpoints must be a non-negative "
                             f"integer, got {self.window_checkpoints!r}")
        for key in ("max_model_len", "threads", "speculative_tokens"):
            if getattr(self, key) is not None:
                positive(key)
        if self.replay not in REPLAY_MODES:
            raise ValueError(f"replay must be one of {', '.join(REPLAY_MODES)}, got "
                             f"{self.replay!r}")
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_BACKENDS)}, got "
                             f"{self.attention!r}")
        if self.cpu_kernels not in CPU_KERNELS:
            raise ValueError(f"cpu_kernels must be one of {', '.join(CPU_KERNELS)}, got "
                             f"{self.cpu_kernels!r}")
        if self.attention == "triton" and self.compile_decode:
            raise ValueError("attention='triton' and compile_decode are two ways to run a "
                             "decode step: choose one")
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE)}, got "
                             f"{self.speculative!r}")
        if self.speculative_schedule not in SPECULATIVE_SCHEDULES:
            raise ValueError("speculative_schedule must be one of "
                             f"{', '.join(SPECULATIVE_SCHEDULES)}, got "
                             f"{self.speculative_schedule!r}")
        if self.speculative_tokens is not None and self.speculative == "none":
            raise ValueError("speculative_tokens limits DSpark's verified drafts: set it "
                             "with speculative='dspark'")
        if self.speculative != "none" and self.tensor_parallel_size > 1:
            raise ValueError("speculative='dspark' runs in one process: the draft on a "
                             "model split over ranks is not built")
        if parse_bytes(self.max_image_bytes, "max_image_bytes") <= 0:
            raise ValueError("engine setting max_image_bytes must be positive")
        if self.numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}, got "
                             f"{self.numerics!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.dtype == "bfloat16" and self.tensor_parallel_size > 1:
            raise ValueError("dtype='bfloat16' runs in one process: a model split over ranks "
                             "holds float32 matrices")
        if self.compile_decode and self.tensor_parallel_size > 1:
            raise ValueError("compile_decode runs in one process: with tensor_parallel_size "
                             "> 1 decode runs eager")
        if (not isinstance(self.parallel_timeout_s, int | float)
                or isinstance(self.parallel_timeout_s, bool) or self.parallel_timeout_s <= 0):
            raise ValueError(f"parallel_timeout_s must be a positive number of seconds, got "
                             f"{self.parallel_timeout_s!r}")
        for key in ("enable_prefix_caching", "disk_prefix_cache", "compile_decode",
                    "expert_parallel"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"engine setting {key} must be true or false, got "
                                 f"{getattr(self, key)!r}")
        if self.device is not None:
            _check_device(self.device)
        parse_bytes(self.kv_budget, "kv_budget")
        parse_bytes(self.disk_budget, "disk_budget")
        if self.host_budget:
            parse_bytes(self.host_budget, "host_budget")

    @property
    def kv_budget_bytes(self) -> int:
        return parse_bytes(self.kv_budget, "kv_budget")

    @property
    def disk_budget_bytes(self) -> int:
        return parse_bytes(self.disk_budget, "disk_budget")

    @property
    def host_budget_bytes(self) -> int:
        return parse_bytes(self.host_budget, "host_budget") if self.host_budget else 0

    @property
    def image_bytes(self) -> int:
        """max_image_bytes in bytes."""
        return parse_bytes(self.max_image_bytes, "max_image_bytes")

    @property
    def kept_window_checkpoints(self) -> int:
        """Window checkpoints the cache makes room for: only a prefix hit is replayed
        over blocks that another sequence may attach again."""
        return self.window_checkpoints if self.enable_prefix_caching else 0

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    def model_len(self, model: ModelConfig) -> int:
        """Tokens a sequence may hold: max_model_len, which may lower the model's
        max_seq_len but not raise it."""
        if self.max_model_len is None:
            return model.max_seq_len
        if self.max_model_len > model.max_seq_len:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's "
                             f"max_seq_len {model.max_seq_len}")
        return self.max_model_len

    def apply_threads(self) -> int:
        """Set torch's intra-op threads (process-wide) and say so; the count used."""
        import torch

        threads = self.threads or default_threads()
        torch.set_num_threads(threads)
        log.info("kvstack: %d torch thread%s of %d cores%s", threads,
                 "" if threads == 1 else "s", os.cpu_count() or 1,
                 "" if self.threads else " (threads=N / --threads to change)")
        return threads
