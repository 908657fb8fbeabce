"""CPU kernels in C: the decode step's costliest torch sequences over the packed cache
(`kernels.c`), matmuls on weights as DeepSeek's V4.1 checkpoint stores them
(`weights.c`), and the step's small per-token ops, each one call where torch dispatches
tens of ops on a few hundred floats (`step.c`: hyper-connections, RoPE, RMSNorm).

Torch runs the cache's reads, index scoring and the float experts' grouped matmul as tens
of ops over float copies (a batch-32 step of the decode benchmark's model made 4,500 of its
5,400 aten ops there); and a packed FP8/FP4 weight it can only multiply after expanding the
whole of it to float32, on every call (30-65x the memory floor at V4.1-Flash's widths,
bench/real_shapes.py). These read the packed bytes
once and write only their result. They are built on first use from the C sources by the
system's C compiler (`cc`, or $CC) into a per-user cache ($XDG_CACHE_HOME or ~/.cache,
`kvstack/native/`, made 0700 and used only while it is this user's alone: else a private
temporary folder, built into anew), keyed by the sources, the compiler and this CPU's flags
(`-march=native`: the build is this CPU's dispatch), and loaded with ctypes; no torch
headers, so a build takes a few seconds.

`resolve(choice)` says whether they run for an engine setting (kvstack.config.CPU_KERNELS:
"auto" where they build, saying in the log when they do not; "c" or raise
`NativeUnavailable` naming why; "torch" never), and an engine runs each step inside
`active(on)`, a choice of the stepping thread alone. The cache ops ask `enabled()` (on
inside an engine's step) and keep their torch code beside, which runs everywhere else
(GPUs, training, a model used without an engine). The packed-weight matmuls ask
`packed_enabled()`: on wherever they build, engine or not (their torch path is 30-65x
slower), unless the engine's step says "torch".
"""

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import struct
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvstack.config import CPU_KERNELS
from kvstack.formats import bytes_per_entry, decode_tables, get_format
from kvstack.formats.quantized import check_magnitude
from kvstack.formats.spec import check_width

log = logging.getLogger("kvstack")

SOURCES = tuple(Path(__file__).with_name(name) for name in ("kernels.c", "weights.c", "step.c"))
# In the build's key, not its command.
HEADERS = tuple(Path(__file__).with_name(name) for name in ("vec.h", "kernels.h"))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11")


class NativeUnavailable(RuntimeError):
    """The C kernels were required and cannot be built or loaded here."""


_library: ctypes.CDLL | None = None
_why_not: str | None = None
# An engine step's choice, per thread (None outside one): a server's engine thread steps
# while other threads may run the same model outside any step, which must not see it.
_step = threading.local()
# The packed-weight kernels' paths (weights.c's ISA_*), in order: the best one this CPU's
# build has, or the lower one `weights_path()` forces.
ISAS = ("portable", "avx2", "avx512")
_forced_isa: str | None = None
_best_isa: str | None = None

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "kv_read_rows": [_P, _I, _P, _I, _I, _I, ctypes.c_int, _P, _P, _P, ctypes.c_int],
    "kv_index_scores": [_P, _P, _P, _I, _I, _P, _I, _P, _I, _I, _I, _I, ctypes.c_int, _P, _P,
                        _I, _I, _P, ctypes.c_int],
    "kv_index_scores_at": [_P, _P, _P, _I, _I, _P, _I, _P, _P, _I, _I, _I, _I, _I,
                           ctypes.c_int, _P, _P, _P, ctypes.c_int],
    "kv_sparse_attention": [_P, _P, _P, _I, _P, _P, _P, _I, _I, _I, ctypes.c_int, _P, _P, _P,
                            _I, _I, _P, _I, _P, _I, _I, ctypes.c_int, _P, _P, _I, _I, _I,
                            ctypes.c_float, _P, _P, _P, ctypes.c_int],
    "kv_ring_write_attend": [_P, ctypes.c_int, ctypes.c_int, _P, _P, _P, _I, _P, _P, _P, _I,
                             _I, _I, ctypes.c_int, _P, _P, _P, _I, _I, _P, _I, _P, _I, _I,
                             ctypes.c_int, _P, _P, _I, _I, _I, ctypes.c_float, _P, _P, _P,
                             ctypes.c_int],
    "kv_stream_write": [_P, _I, _I, ctypes.c_int, ctypes.c_int, _I, _P, _P, _P, _I, _P, _P,
                        _P],
    "kv_candidate_pool": [_P, _I, _I, _I, _P, _I, _I, _I, _I, _P, _P, _P],
    "kv_select_in_pool": [_P, _P, _P, _I, _I, _P, _I, _P, _P, _I, _I, _I, _I, _I, _I,
                          ctypes.c_int, _P, _P, _I, _P],
    "kv_compress_write": [_P, _I, _I, _P, _P, _I, _P, _P, _I, _P, _P, _P, ctypes.c_float, _P,
                          _I, _P, ctypes.c_float, _P, _I, _P, _P, _P, ctypes.c_int,
                          ctypes.c_int, _I, _P, _P, _P, ctypes.c_int, ctypes.c_int, _I, _P,
                          _P, _I, _P, _P, _P, ctypes.c_int, ctypes.c_int, ctypes.c_int],
    "kv_prefill_attention": [_P, _P, _I, _P, _P, _I, _I, _P, _I, _P, _I, _P, _I, _I, _I, _I,
                             ctypes.c_float, _P, ctypes.c_int],
    "kv_dense_attention": [_P, _P, _P, _I, _I, _I, _P, _I, _P, _I, ctypes.c_int, _P, _P, _I,
                           _I, _I, _I, ctypes.c_float, _P, _P, _P, _P],
    "kv_draft_attention": [_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float, _P, _P,
                           _P, ctypes.c_int],
    "kv_grouped_mm": [_P, _I, _P, _I, _I, _I, _I, _I, _P, _P, ctypes.c_int, ctypes.c_int],
    "kv_packed_linear": [_P, _I, ctypes.c_int, _P, _P, _I, _I, _I, _P, _P, ctypes.c_int, _P,
                         ctypes.c_int, ctypes.c_int],
    "kv_fp8_has_nan": [_P, _I],
    "kv_fp8_dequantize": [_P, _P, _I, _I, _P, _P, _P, ctypes.c_int],
    "kv_fp4_grouped": [_P, _I, _P, _P, _P, _I, _I, _P, _P, _P, ctypes.c_int, ctypes.c_int],
    "kv_weights_isa": [],
    "kv_hc_mixes": [_P, _I, _I, _I, _P, _P, _P, ctypes.c_float, ctypes.c_float, _I, _P, _P, _P,
                    ctypes.c_int],
    "kv_hc_collapse": [_P, _P, _I, _I, _I, _P],
    "kv_hc_post": [_P, _P, _P, _P, _I, _I, _I, _P],
    "kv_rope": [_P, _I, _I, _I, _I, _P, _I, _P, _I, ctypes.c_int, _P],
    "kv_rmsnorm": [_P, _I, _I, _P, ctypes.c_float, _P],
    "kv_attention_in": [_P, _I, _I, _P, _P, _I, _P, _I, _I, _P, _P, ctypes.c_float, _P, _P,
                        _I, _P, _P, _P, ctypes.c_int, ctypes.c_int],
    "kv_attention_out": [_P, _I, _I, _I, _P, _P, _I, _P, _I, _I, _P, _I, _P, _P,
                         ctypes.c_int, ctypes.c_int],
    "kv_ring_write": [_P, _I, _I, ctypes.c_int, ctypes.c_int, _I, _P, _P, _P, _P, _I, _P, _P,
                      _P],
    "kv_select_topk": [_P, _I, _I, _I, _P, _P],
    "kv_greedy": [_P, _I, _I, _P],
    "kv_draft_head": [_P, _I, _I, _I, _P, ctypes.c_float, _P, _I, _P, _P, _I, _P, ctypes.c_int,
                      _P, _P, _P, _P, _P, ctypes.c_int],
    "kv_draft_stage": [_P, _I, _I, _I, _P, ctypes.c_float, _P, _P, _I, _P, _I, _I, _P, _P, _P,
                       _P, _I, ctypes.c_int, ctypes.c_int, ctypes.c_int, _I, _P, _P, _P, _I,
                       _P, _P, ctypes.c_float, _P, _I, _I, _P, _P, _P, _P, _P, ctypes.c_int],
    "kv_moe": [_P, _I, _I, _P, _P, _I, ctypes.c_int, ctypes.c_float, _I, ctypes.c_int,
               ctypes.c_float, _P, _P, _P, _I, _P, _P, _P, _I, ctypes.c_float, ctypes.c_int,
               _P, _P, _P],
    "kv_quantize": [_P, _I, _I, ctypes.c_int, ctypes.c_int, _I, _P, _P, _P, _P],
    "kv_attention_block_in": [_P, _I, _I, _I, _P, _P, _P, ctypes.c_float, ctypes.c_float, _I,
                              _P, _P, _P, _P, _I, _P, _I, _I, _P, _P, _P, _P, _I, _P, _P,
                              _P, _P, _P, _P, _P, ctypes.c_int, ctypes.c_int],
    "kv_attention_out_spread": [_P, _I, _I, _I, _P, _P, _I, _P, _I, _I, _P, _I, _P, _P, _P,
                                _I, _P, _P, _P, ctypes.c_int, ctypes.c_int],
    "kv_compress_step": [_P, _I, _I, _P, _P, _I, _P, _P, _I, _P, _P, _P, ctypes.c_float, _P,
                         _I, _P, ctypes.c_float, _P, _I, _P, _P, _P, ctypes.c_int,
                         ctypes.c_int, ctypes.c_int],
    "kv_index_queries": [_P, _P, _I, _I, _I, _P, _P, ctypes.c_int, _I, _I, _P, _P, _I,
                         ctypes.c_int, ctypes.c_int, _I, _P, _P, ctypes.c_float, _P, _P,
                         ctypes.c_int],
    "kv_index_select": [_P, _P, _I, _I, _I, _P, _P, ctypes.c_int, _I, _I, _P, _P, _I,
                        ctypes.c_int, ctypes.c_int, _I, _P, _P, ctypes.c_float, _P, _P,
                        ctypes.c_int, _P, _I, _I, _P, _I, _I, ctypes.c_int, _P, _P, _I, _I, _P,
                        _P, _I, _I, _I, _P, ctypes.c_int],
    "kv_ffn_block": [_P, _I, _I, _I, _P, _P, _P, ctypes.c_float, ctypes.c_float, _I, _P, _P,
                     _P, _P, _I, ctypes.c_int, ctypes.c_float, _I, ctypes.c_int,
                     ctypes.c_float, _P, _P, _P, _I, _P, _P, _P, _I, ctypes.c_float,
                     ctypes.c_int, _P, _P, _P, _P, ctypes.c_int],
    "kv_dense_attention_block": [_P, _I, _I, _P, ctypes.c_float, _P, _P, _P, _P,
                                 ctypes.c_int, _I, _I, _I,
                                 _P, _P, _I, _P, _P, _I, _I, _I, _P, _I, _P, _P, _P,
                                 ctypes.c_int, ctypes.c_int, _I, ctypes.c_int, _P, _P,
                                 ctypes.c_float, _P, ctypes.c_int],
}
_RESTYPES = {"kv_weights_isa": ctypes.c_int, "kv_fp8_has_nan": ctypes.c_int,
             "kv_quantize": ctypes.c_float}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "kvstack" / "native"


def _private(path: Path, kind: int) -> bool:
    """Whether path is this user's alone: of `kind` (stat.S_IFDIR, S_IFREG) and not a
    symlink, owned by this process's user, writable by nobody else. A library is loaded
    only from such a folder, so no one else can plant code that runs in the engine."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (stat.S_IFMT(st.st_mode) == kind and st.st_uid == os.getuid()
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _folders() -> Iterator[Path]:
    """Where to build and load the library: the per-user cache (made 0700) when it is
    private, else a fresh private temporary folder of this process's (mkdtemp: 0700, a
    name no one can guess), built into anew."""
    folder = _cache_dir()
    with suppress(OSError):  # unwritable: checked below, as is what was there before
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if _private(folder, stat.S_IFDIR):
        yield folder
    else:
        log.warning("kvstack: %s is not a private folder of this user (a symlink, another "
                    "owner, or writable by others); the C kernels are built in a private "
                    "temporary folder instead", folder)
    try:
        yield Path(tempfile.mkdtemp(prefix="kvstack-native-"))
    except OSError:
        return


def _build() -> Path:
    """The shared library for this source, compiler and CPU, built if not cached; raises
    NativeUnavailable naming what failed."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise NativeUnavailable("no C compiler found (cc, gcc or $CC)")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"the C compiler {cc} does not run: {e}") from e
    key = hashlib.sha256("\0".join([*(p.read_text() for p in SOURCES + HEADERS), cc, version,
                                    " ".join(FLAGS), _cpu_flags()]).encode()).hexdigest()[:16]
    for folder in _folders():
        target = folder / f"kernels-{key}.so"
        if _private(target, stat.S_IFREG):
            return target
        try:
            # Built under a name of its own and renamed into place: a process that loads
            # the library while another builds it sees the whole file or none.
            fd, partial = tempfile.mkstemp(dir=folder, suffix=".so.partial")
            os.close(fd)
        except OSError:
            continue
        try:
            run = subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-o", partial, "-lm"],
                                 capture_output=True, text=True, timeout=300)
            if run.returncode != 0:
                raise NativeUnavailable(f"{cc} failed on {', '.join(p.name for p in SOURCES)}: "
                                        f"{run.stderr.strip()[-2000:]}")
            os.chmod(partial, 0o700)
            os.replace(partial, target)
            return target
        except (OSError, subprocess.SubprocessError) as e:
            raise NativeUnavailable(f"building the C kernels with {cc}: {e}") from e
        finally:
            if os.path.exists(partial):
                os.remove(partial)
    raise NativeUnavailable(f"no private writable folder for the built library ({_cache_dir()}, "
                            f"or a new one under {tempfile.gettempdir()})")


def _load() -> ctypes.CDLL:
    global _library, _why_not
    if _library is None:
        if _why_not is not None:
            raise NativeUnavailable(_why_not)
        try:
            path = _build()
            library = ctypes.CDLL(str(path))
            if path.parent != _cache_dir():  # a temporary folder of this process's: the
                shutil.rmtree(path.parent, ignore_errors=True)  # loaded mapping outlives it
        except OSError as e:
            _why_not = f"the built library does not load: {e}"
            raise NativeUnavailable(_why_not) from e
        except NativeUnavailable as e:
            _why_not = str(e)
            raise
        for name, argtypes in _SIGNATURES.items():
            getattr(library, name).argtypes = argtypes
            getattr(library, name).restype = _RESTYPES.get(name)
        for name in _BLOCK_CALLS:
            getattr(library, name + "_args").argtypes = [_P]
            getattr(library, name + "_args").restype = None
        _library = library
    return _library


def resolve(choice: str) -> bool:
    """Whether the C kernels run for a setting of CPU_KERNELS ("c": or NativeUnavailable)."""
    if choice not in CPU_KERNELS:
        raise ValueError(f"cpu_kernels {choice!r}: expected one of {', '.join(CPU_KERNELS)}")
    if choice == "torch":
        return False
    try:
        _load()
    except NativeUnavailable as e:
        if choice == "c":
            raise
        log.warning("kvstack: the C kernels are off (%s); torch runs their ops", e)
        return False
    return True


@contextmanager
def active(on: bool) -> Iterator[None]:
    """The C kernels on (or off) for the ops run inside: one engine step."""
    before = _step_choice()
    _step.on = on
    try:
        yield
    finally:
        _step.on = before


def _step_choice() -> bool | None:
    """This thread's engine-step choice (`active`): None outside a step."""
    return getattr(_step, "on", None)


def enabled() -> bool:
    """Whether the cache ops run in C: inside an engine step that chose them."""
    return _step_choice() is True


def packed_enabled() -> bool:
    """Whether packed weights are multiplied by the C kernels: wherever they build (the
    first call builds them, and logs once why not where they don't), unless an engine
    step chose torch."""
    if _step_choice() is False or _why_not is not None:
        return False
    if _library is None:
        try:
            _load()
        except NativeUnavailable as e:
            log.warning("kvstack: packed weights are dequantised per call (%s)", e)
            return False
    return True


def weights_isa() -> str:
    """The path the packed-weight kernels take now: "avx512", "avx2" or "portable"
    (ISAS): the best this CPU's build has, unless `weights_path` forces a lower one."""
    return _forced_isa or best_weights_isa()


def best_weights_isa() -> str:
    """The best packed-weight path this CPU's build has (asked of the library once)."""
    global _best_isa
    if _best_isa is None:
        _best_isa = ISAS[_load().kv_weights_isa()]
    return _best_isa


@contextmanager
def weights_path(isa: str) -> Iterator[None]:
    """The packed-weight kernels on a lower path inside (what a CPU without AVX-512, or
    without AVX2, runs), for tests that check each path on a CPU that has more."""
    global _forced_isa
    if isa not in ISAS:
        raise ValueError(f"unknown packed-weight path {isa!r}: one of {', '.join(ISAS)}")
    if ISAS.index(isa) > ISAS.index(best_weights_isa()):
        raise ValueError(f"this CPU's build has no {isa} path (best: {best_weights_isa()})")
    before, _forced_isa = _forced_isa, isa
    try:
        yield
    finally:
        _forced_isa = before


def _ptr(t: torch.Tensor) -> int:
    """t's address for a C call. Only an address: a tensor made in the call's own argument
    list (a contiguous copy, a cast) is freed before the call runs, so each wrapper binds
    what it converts to a name first."""
    return t.data_ptr()


def _threads() -> int:
    return torch.get_num_threads()


# The calls a decode step makes in every layer, which step.c also takes as one block of
# arguments (`<name>_args`): see ArgBlock.
_BLOCK_CALLS = ("kv_ffn_block", "kv_attention_block_in", "kv_attention_out",
                "kv_attention_out_spread", "kv_sparse_attention", "kv_ring_write_attend",
                "kv_dense_attention_block", "kv_index_select", "kv_compress_write",
                "kv_draft_stage")


class ArgBlock:
    """The arguments of a C call as one block of int64 slots, in its parameters' order
    (pointers and integers as they are, floats as a double's bits), passed to step.c's
    `<name>_args` as one pointer. ctypes converts every argument of a call anew, about 3 us
    for thirty on a small CPU, where a call site that keeps its block sets the few slots
    that change (`slots[i] = value`) and calls it for a third of a microsecond."""

    __slots__ = ("_address", "_call", "name", "slots")

    def __init__(self, name: str, args: tuple | list) -> None:
        types = _SIGNATURES[name]
        if len(args) != len(types):
            raise ValueError(f"{name} takes {len(types)} arguments, got {len(args)}")
        self.name = name
        self.slots = (ctypes.c_int64 * len(types))(*map(_slot, args, types))
        self._address = ctypes.addressof(self.slots)
        self._call = getattr(_load(), name + "_args")

    def __call__(self) -> None:
        self._call(self._address)

    def copy(self) -> "ArgBlock":
        """The same call with slots of its own: a holder that sets only some slots keeps
        the others as they are now, whatever another caller of this block sets later."""
        return _restored_block(self.name, list(self.slots))

    def __reduce__(self) -> tuple:
        # A copied or unpickled model's kept plans: the same slots (`_plan` sees that their
        # tensors moved and makes new ones).
        return _restored_block, (self.name, list(self.slots))


def _restored_block(name: str, slots: list[int]) -> ArgBlock:
    block = ArgBlock(name, [0] * len(slots))
    block.slots[:] = slots
    return block


def _slot(value: int | float | None, kind: type) -> int:
    """One argument as an ArgBlock's slot holds it."""
    if kind is ctypes.c_float:
        return int.from_bytes(struct.pack("<d", float(value)), "little", signed=True)
    return 0 if value is None else int(value)


@functools.cache  # a fixed table of formats, asked at every call of a step
def _decoding(fmt: str) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    f = get_format(fmt)
    tables = decode_tables(fmt)
    if tables is None:
        raise ValueError(f"format {fmt}: the C kernels decode block-scaled formats only")
    return f.scale_block, int(f.element == "e2m1"), *tables


@functools.cache
def _any_decoding(fmt: str) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """`_decoding` for any cache format: block 0 (and unused tables) for bf16."""
    if decode_tables(fmt) is None:
        return 0, 0, *_weight_tables("fp8")
    return _decoding(fmt)


def decodes(fmt: str) -> bool:
    """Whether the C kernels read rows of this format (every block-scaled one)."""
    return decode_tables(fmt) is not None


def read_rows(data: torch.Tensor, index: torch.Tensor, fmt: str, width: int) -> torch.Tensor:
    """What `dequantize(unpack_rows(rows at index))` gives, bit for bit: the float32 values
    [*index.shape, width] of the rows of a buffer [..., bytes] of format fmt at index
    (over its leading dims as one)."""
    block, packed, elem, scale = _decoding(fmt)
    rows = data.contiguous().view(-1, data.shape[-1])
    flat = index.reshape(-1).contiguous()
    out = torch.empty(*index.shape, width, dtype=torch.float32)
    _load().kv_read_rows(_ptr(rows), rows.shape[1], _ptr(flat), flat.numel(), width, block,
                         packed, _ptr(elem), _ptr(scale), _ptr(out), _threads())
    return out


def index_scores(q: torch.Tensor, w: torch.Tensor, pool: torch.Tensor,
                 block_table: torch.Tensor, positions: torch.Tensor, n_entries: int,
                 ratio: int, fmt: str) -> torch.Tensor:
    """What `kvstack.cache.batch.score_index_keys` computes, within float rounding, from
    the packed keys of format fmt where they lie (pool [blocks, per, bytes] through
    block_table [B, max_blocks]), with no float copy of them."""
    block, packed, elem, scale = _decoding(fmt)
    b, hi, di = q.shape
    q, w, pool = _as(q, torch.float32), _as(w, torch.float32), pool.contiguous()
    table, positions = _as(block_table, torch.int64), _as(positions, torch.int64)
    out = torch.empty(b, n_entries, dtype=torch.float32)
    _load().kv_index_scores(_ptr(q), _ptr(w), _ptr(pool), pool.shape[1], pool.shape[2],
                            _ptr(table), table.shape[1], _ptr(positions), b, hi, di, block,
                            packed, _ptr(elem), _ptr(scale), n_entries, ratio,
                            _ptr(out), _threads())
    return out


def index_scores_at(q: torch.Tensor, w: torch.Tensor, pool: torch.Tensor,
                    block_table: torch.Tensor, held: torch.Tensor, entries: torch.Tensor,
                    fmt: str) -> torch.Tensor:
    """score(b, i) = sum_h w_h relu(q_h . k) of each sequence's query (q [B, H, D], w
    [B, H]) over its own entries (entries [B, K]) of a stream of keys in format fmt (pool
    [blocks, per, bytes] through block_table [B, max_blocks]), read where they lie; -inf
    (and not read) at or past the sequence's count held [B] or outside the table: [B, K],
    within float rounding of gather, dequantise and score."""
    block, packed, elem, scale = _decoding(fmt)
    b, hi, di = q.shape
    if entries.shape[0] != b or w.shape != (b, hi) or held.shape != (b,):
        raise ValueError(f"index_scores_at: entries {tuple(entries.shape)}, weights "
                         f"{tuple(w.shape)} or counts {tuple(held.shape)} do not match "
                         f"queries {tuple(q.shape)}")
    q, w = _as(q, torch.float32), _as(w, torch.float32)
    table, entries = _as(block_table, torch.int64), _as(entries, torch.int64)
    held, pool = _as(held, torch.int64), pool.contiguous()
    out = torch.empty(b, entries.shape[1], dtype=torch.float32)
    _load().kv_index_scores_at(_ptr(q), _ptr(w), _ptr(pool), pool.shape[1],
                               pool.shape[2], _ptr(table), table.shape[1], _ptr(held),
                               _ptr(entries),
                               entries.shape[1], b, hi, di, block, packed, _ptr(elem),
                               _ptr(scale), _ptr(out), _threads())
    return out


def sparse_attention(q: torch.Tensor, sink: torch.Tensor, ring: torch.Tensor, ring_fmt: str,
                     ring_positions: torch.Tensor, slots: torch.Tensor,
                     positions: torch.Tensor, pool: torch.Tensor | None, kv_fmt: str | None,
                     block_table: torch.Tensor, selected: torch.Tensor | None,
                     window_size: int, new_entries: torch.Tensor | None = None,
                     keep: dict | None = None) -> torch.Tensor:
    """`kvstack.cache.kernels.sparse_attention` from the packed rows on a CPU, for any
    ring and stream formats: q [B, H, D] (or [B, 1, H, D]) over each sequence's window
    ring rows (ring [slots, W, bytes], ring_positions [slots, W]) at its slot and the
    entries it selected (selected [B, (1,) k], -1 for none, from pool [blocks, per, bytes]
    through block_table; None: the window alone), the sink [H] in the denominator:
    float32 of q's shape, within float rounding of the model's softmax over the values
    the store hands back. new_entries: this step's window entries [B, (1,) D] float32,
    written first as `ring_write` writes them (a block-scaled ring, contiguous, written in
    place), in the same call. keep: as `attention_block_in`'s (the output is a kept
    buffer)."""
    b, h, d = q.shape[0], q.shape[-2], q.shape[-1]
    w, k = ring.shape[1], 0 if selected is None else selected.shape[-1]
    sink = _as(sink, torch.float32)
    ring_ptr = ring.data_ptr()

    def make() -> tuple[bool, tuple]:
        if not ring.is_contiguous() or (pool is not None and not pool.is_contiguous()):
            raise ValueError("sparse_attention: the ring and the pool must be contiguous")
        ring_block, ring_packed, ring_elem, ring_scale = _any_decoding(ring_fmt)
        decoding = (0, 0, 0, 0) if pool is None else (
            pool.shape[1], pool.shape[2], *_any_decoding(kv_fmt)[:2])
        kv_elem, kv_scale = (_weight_tables("fp8") if pool is None
                             else _any_decoding(kv_fmt)[2:])
        f = get_format(ring_fmt)
        writes = (int(f.element != "e2m1"), int(f.scale == "e4m3")) if decodes(ring_fmt) \
            else None
        if writing and writes is None:
            raise ValueError("sparse_attention: new entries go into a contiguous "
                             "block-scaled ring with int64 positions, in place")
        rows = torch.empty(w + k, d)  # one sequence's decoded rows
        logits = torch.empty(h, w + k)  # then each head's probabilities
        out = q.new_empty(q.shape, dtype=torch.float32)
        # q, sink, the ring positions, slots, positions, table (and its width) and the
        # selection (slots 0, 1, 4-6, 16-18, after the write's three) are set each call.
        args = (0, 0, ring_ptr, ring.shape[2], 0, 0, 0, w, window_size, ring_block,
                ring_packed, _ptr(ring_elem), _ptr(ring_scale),
                0 if pool is None else _ptr(pool), *decoding[:2], 0, 0, 0, k, *decoding[2:],
                _ptr(kv_elem), _ptr(kv_scale), b, h, d, d**-0.5, _ptr(rows), _ptr(logits),
                _ptr(out), 0)
        block = (ArgBlock("kv_ring_write_attend", (0, *writes, *args)) if writing
                 else ArgBlock("kv_sparse_attention", args))
        return True, (block, out, (rows, logits, ring_elem, kv_elem))

    writing = new_entries is not None
    key = (q.shape, k, ring_ptr, ring_fmt, window_size, writing,
           None if pool is None else (pool.data_ptr(), pool.shape, kv_fmt))
    block, out, _held = _plan(keep, "sparse_attention", key, make)
    q, ring_pos = _as(q, torch.float32), _as(ring_positions, torch.int64)
    slots, positions = _as(slots, torch.int64), _as(positions, torch.int64)
    table = _as(block_table, torch.int64)
    chosen = None if selected is None else _as(selected, torch.int64)
    at, o = block.slots, 0
    if writing:
        if ring_pos.data_ptr() != ring_positions.data_ptr():
            raise ValueError("sparse_attention: new entries go into a contiguous "
                             "block-scaled ring with int64 positions, in place")
        new_entries = _as(new_entries, torch.float32)
        at[0], o = _ptr(new_entries), 3  # kv_ring_write_attend's three come first
    at[o], at[o + 1], at[o + 4] = _ptr(q), _ptr(sink), _ptr(ring_pos)
    at[o + 5], at[o + 6], at[o + 16] = _ptr(slots), _ptr(positions), _ptr(table)
    at[o + 17], at[o + 18] = table.shape[1], 0 if chosen is None else _ptr(chosen)
    at[o + 31] = _threads()
    block()
    return out


def prefill_attention(q: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
                      key_positions: torch.Tensor, window_size: int, rows: torch.Tensor,
                      columns: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """A prefill chunk's attention over float rows: queries q [B, n, H, D] at positions
    [B or 1, n] over the window keys [B, m, D] at key_positions [B, m] (those at
    t - window_size + 1 .. t) and each query's selected entries (columns [B, n, k] into
    rows [B, U, D], -1 for none), the sink [H] in the denominator; keys are their own
    values: [B, n, H, D] float32, within float rounding of the model's torch softmax."""
    b, n, h, d = q.shape
    m, k, u = keys.shape[1], columns.shape[-1], rows.shape[1]
    if positions.shape[-1] != n or key_positions.shape != (b, m) or columns.shape[:2] != (b, n):
        raise ValueError(f"prefill_attention: positions {tuple(positions.shape)}, key "
                         f"positions {tuple(key_positions.shape)} or columns "
                         f"{tuple(columns.shape)} do not match queries {tuple(q.shape)} and "
                         f"keys {tuple(keys.shape)}")
    q, keys, rows = (_as(t, torch.float32) for t in (q, keys, rows))
    positions, key_positions, columns = (_as(t, torch.int64)
                                         for t in (positions, key_positions, columns))
    out = torch.empty(b, n, h, d, dtype=torch.float32)
    sink = _as(sink, torch.float32)
    _load().kv_prefill_attention(
        _ptr(q), _ptr(positions), n if positions.shape[0] > 1 else 0, _ptr(keys),
        _ptr(key_positions), m, window_size, _ptr(rows), u, _ptr(columns), k,
        _ptr(sink), b, n, h, d, d**-0.5, _ptr(out), _threads())
    return out


def dense_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, fmt: str,
                    width: int, block_table: torch.Tensor,
                    lengths: torch.Tensor) -> torch.Tensor:
    """One decode step's causal GQA from the packed rows: q [B, H, D] over entries
    0 .. lengths[b] - 1 of each sequence's key and value streams (rows of `width` = KV
    heads * D values in format fmt, pools [blocks, per, bytes] through block_table
    [B, max_blocks]), scale D^-0.5, no sink: [B, H, D] float32, within float rounding of
    `F.scaled_dot_product_attention` on the values the store hands back."""
    b, h, d = q.shape
    block, packed, elem, scale = _any_decoding(fmt)
    kv_heads = width // d
    q = _as(q, torch.float32)
    table, lengths = _as(block_table, torch.int64), _as(lengths, torch.int64)
    longest = int(lengths.max()) if b else 0
    keys = torch.empty(longest, kv_heads * d)
    values = torch.empty(longest, kv_heads * d)
    logits = torch.empty(longest)
    out = torch.empty(b, h, d)
    k_pool, v_pool = k_pool.contiguous(), v_pool.contiguous()
    _load().kv_dense_attention(
        _ptr(q), _ptr(k_pool), _ptr(v_pool), k_pool.shape[1],
        k_pool.shape[2], v_pool.shape[2], _ptr(table), table.shape[1], _ptr(lengths), block,
        packed, _ptr(elem), _ptr(scale), b, h, kv_heads, d, d**-0.5, _ptr(keys), _ptr(values),
        _ptr(logits), _ptr(out))
    return out


def draft_attention(q: torch.Tensor, window: torch.Tensor, block: torch.Tensor,
                    pad: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """A DSpark draft stage's attention (`DraftAttention`): block queries q [B, K, H, D]
    over each sequence's window entries window [B, W, D], its first pad[b] (int64 [B])
    left padding that no query reads, then the block's entries block [B, K, D], all of
    them seen by every query, the sink [H] in the denominator: [B, K, H, D] float32,
    within float rounding of the model's softmax."""
    b, k, h, d = q.shape
    w = window.shape[1]
    q, window, block = _as(q, torch.float32), _as(window, torch.float32), _as(block, torch.float32)
    pad, sink = _as(pad, torch.int64), _as(sink, torch.float32)
    seen = torch.empty(w + k, dtype=torch.int64)  # row pointers
    probs = torch.empty(h, w + k)
    out = torch.empty(b, k, h, d)
    _load().kv_draft_attention(_ptr(q), _ptr(window), _ptr(block), _ptr(pad), _ptr(sink), b,
                               k, w, h, d, scale, _ptr(seen), _ptr(probs), _ptr(out),
                               _threads())
    return out


class DraftFFN(NamedTuple):
    """A draft stage's feed-forward half as `draft_stage` takes it: its norm's weight and
    epsilon, `ffn_block`'s router (None: dense) and shared (or dense) weights, the SwiGLU
    limit."""

    norm: torch.Tensor
    eps: float
    router: "Router | None"
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    limit: float


def draft_stage(x: torch.Tensor, positions: torch.Tensor, attn_norm: torch.Tensor,
                eps: float, matrices: tuple[torch.Tensor, ...], q_norm: torch.Tensor,
                kv_norm: torch.Tensor, freqs: torch.Tensor, heads: int, groups: int,
                window_fmt: str, window: torch.Tensor, max_window: int, pad: torch.Tensor,
                sink: torch.Tensor, scale: float, ffn: DraftFFN, keep: dict) -> torch.Tensor:
    """A DSpark draft stage without hyper-connections (`DraftStage.forward`) as one C
    call, the kernels its modules' own calls run, in their order: the block x [B, K, dim]
    at positions [B, K], its attention (matrices: wq_a, wq_b, wkv, wo_a, wo_b, all float32
    or all bf16; the norms' weights, float64 RoPE freqs, `heads` heads in `groups` output
    groups) over each sequence's window entries window [B, W, D] (W at most max_window,
    for which the plan is made: a sequence's window grows step by step) past its pad[b]
    (int64 [B]) left padding and the block's own entries rounded to window_fmt, the sink [H] in
    the denominator and logits scaled by `scale`; then the feed-forward half: x + attention
    + FFN, [B, K, dim], a buffer the plan in `keep` holds (the next call of this shape
    writes it again)."""
    b, k, dim = x.shape
    w, d = window.shape[1], matrices[2].shape[0]
    f = get_format(window_fmt)

    def make() -> tuple[bool, tuple]:
        wq_a, wq_b, wkv, wo_a, wo_b = matrices
        rank, half, o_rank = wq_a.shape[0], freqs.shape[0], wo_a.shape[0] // groups
        if (wq_a.shape[1] != dim or wq_b.shape != (heads * d, rank) or wkv.shape[1] != dim
                or half > 512 or 2 * half > d or heads % groups
                or wo_a.shape != (groups * o_rank, heads // groups * d)
                or wo_b.shape != (dim, groups * o_rank)):
            raise ValueError(f"draft_stage: weights {[list(m.shape) for m in matrices]} in "
                             f"{groups} groups do not fit {heads} heads, x {list(x.shape)} "
                             f"and the window {list(window.shape)}")
        check_width(f, d)
        stored = _matrix_dtype(*matrices)
        same, held = _converted((*matrices, attn_norm, q_norm, kv_norm, sink, freqs),
                                (*(stored,) * 5, *(torch.float32,) * 4, torch.float64))
        ffn_same, (ffn_call, ffn_held) = _ffn_block(b * k, 1, dim, None, ffn.eps, 0.0, 0,
                                                    ffn.norm, ffn.router, ffn.shared,
                                                    ffn.limit)
        elem, scale_table = decode_tables(window_fmt)
        n = b * k
        # kv_draft_stage's scratch (its comment), the row pointers as two floats each
        # after one float of alignment.
        floats = (n * (3 * dim + rank + 2 * heads * d + 2 * d + groups * o_rank) + 1
                  + 2 * (max_window + k) + heads * (max_window + k))
        scratch, out, largest = torch.empty(floats), torch.empty(b, k, dim), torch.empty(1)
        ptrs = [_ptr(t) for t in held]
        # x, positions, the window, its width, the pad and the threads (slots 0, 14,
        # 23-25, 36) are set each call.
        block = ArgBlock("kv_draft_stage", (
            0, b, k, dim, ptrs[5], eps, ptrs[0], ptrs[6], rank, ptrs[1], heads, d, ptrs[2],
            ptrs[7], 0, ptrs[9], half, int(stored is torch.bfloat16),
            int(f.element != "e2m1"), int(f.scale == "e4m3"), f.scale_block, _ptr(elem),
            _ptr(scale_table), 0, 0, 0, ptrs[8], scale, ptrs[3], groups, o_rank, ptrs[4],
            ffn_call._address, _ptr(scratch), _ptr(out), _ptr(largest), 0))
        return same and ffn_same, (block, out, largest,
                                   (held, ffn_call, ffn_held, scratch, elem, scale_table))

    routing = None if ffn.router is None else (
        ffn.router.score_func, ffn.router.gate_temp, ffn.router.k, ffn.router.renormalise,
        ffn.router.route_scale)
    weights = (*matrices, attn_norm, q_norm, kv_norm, sink, freqs, ffn.norm,
               *(ffn.shared or ()), *(() if ffn.router is None else (
                   ffn.router.gate, ffn.router.bias, *ffn.router.experts)))
    if window.shape[0] != b or window.shape[2] != d or w > max_window:
        raise ValueError(f"draft_stage: the window must be [{b}, at most {max_window}, {d}], "
                         f"got {list(window.shape)}")
    key = (x.shape, max_window, window_fmt, heads, groups, eps, scale, ffn.eps, ffn.limit,
           routing, *map(_data_ptr, weights))
    block, out, largest, _held = _plan(keep, "draft_stage", key, make)
    x, window = _as(x, torch.float32), _as(window, torch.float32)
    positions = _as(positions.expand(b, k), torch.int64)
    pad = _as(pad, torch.int64)
    at = block.slots
    at[0], at[14], at[23], at[24] = _ptr(x), _ptr(positions), _ptr(window), w
    at[25], at[36] = _ptr(pad), _threads()
    block()
    check_magnitude(f, float(largest[0]))
    return out


def draft_head(x: torch.Tensor, token: torch.Tensor, norm: torch.Tensor, eps: float,
               head: torch.Tensor, markov_columns: torch.Tensor, markov_embed: torch.Tensor,
               confidence: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A greedy draft block's outputs from its last stage's x [B, K, dim] and the given
    tokens [B] (`Draft.block`'s): the final norm (weight, eps) and the head [vocab, dim]
    (float32 or bf16); at each position the Markov head's bias after the token before
    (markov_columns [rank, vocab], the head transposed, times the token's markov_embed
    [vocab, rank] row) added and the largest logit chosen; the confidence head's [dim +
    rank] logit over (x, that embedding). (logits [B, K, vocab] float32, tokens [B, K + 1]
    int64, the given ones first, confidence [B, K]) within float rounding of torch's."""
    b, k, dim = x.shape
    vocab, rank = head.shape[0], markov_embed.shape[1]
    if (head.shape[1] != dim or markov_columns.shape != (rank, vocab)
            or markov_embed.shape[0] != vocab or confidence.shape != (dim + rank,)):
        raise ValueError(f"draft_head: head {list(head.shape)}, Markov columns "
                         f"{list(markov_columns.shape)} and embedding "
                         f"{list(markov_embed.shape)}, confidence {list(confidence.shape)} "
                         f"do not fit x {list(x.shape)}")
    stored = _matrix_dtype(head)
    head, markov_columns = _as(head, stored), _as(markov_columns, torch.float32)
    x, norm = _as(x, torch.float32), _as(norm, torch.float32)
    markov_embed, confidence = _as(markov_embed, torch.float32), _as(confidence, torch.float32)
    first = _as(token, torch.int64)
    scratch = torch.empty(k * dim + vocab)
    logits, tokens = torch.empty(b, k, vocab), torch.empty(b, k + 1, dtype=torch.int64)
    scores = torch.empty(b, k)
    _load().kv_draft_head(_ptr(x), b, k, dim, _ptr(norm), eps, _ptr(head), vocab,
                          _ptr(markov_embed), _ptr(markov_columns), rank, _ptr(confidence),
                          int(stored is torch.bfloat16), _ptr(first), _ptr(scratch),
                          _ptr(logits), _ptr(tokens), _ptr(scores), _threads())
    return logits, tokens, scores


def dense_attention_block(x: torch.Tensor, norm: torch.Tensor, eps: float, wq: torch.Tensor,
                          wk: torch.Tensor, wv: torch.Tensor, wo: torch.Tensor, heads: int,
                          positions: torch.Tensor, freqs: torch.Tensor, k_pool: torch.Tensor,
                          v_pool: torch.Tensor, fmt: str, block_table: torch.Tensor,
                          new_rows: tuple[torch.Tensor, torch.Tensor],
                          lengths: torch.Tensor, keep: dict | None = None) -> torch.Tensor:
    """A decode step of a dense layer's attention half for x [B, dim] (one new token of
    each sequence, at positions [B]) with float32 or bf16 weights (wq [heads * D, dim], wk
    and wv [kv heads * D, dim], wo [dim, heads * D]), the norm's weight, float64 RoPE freqs
    [R/2]: RMSNorm, the projections, RoPE on q and k, k and v packed in format fmt into
    the pools [blocks, per, bytes] at new_rows (block [B], offset [B]), causal GQA over each
    sequence's entries 0 .. lengths[b] - 1 through block_table [B, max_blocks] (this
    step's included), the output projection, the residual added: [B, dim]. What
    `dense_attention` and the separate ops make, within float rounding; the rows written
    are the bytes `PackedRows.pack` writes. keep: as `attention_block_in`'s (the output is
    a kept buffer)."""
    b, dim = x.shape

    def make() -> tuple[bool, tuple]:
        kv_width, d, half = wk.shape[0], wq.shape[0] // heads, freqs.shape[0]
        if (wq.shape != (heads * d, dim) or wv.shape != wk.shape or wk.shape[1] != dim
                or kv_width % d or heads % (kv_width // d) or wo.shape != (dim, heads * d)
                or half > 512 or 2 * half > d):
            raise ValueError(f"dense_attention_block: weights {list(wq.shape)}, "
                             f"{list(wk.shape)}, {list(wv.shape)}, {list(wo.shape)} with "
                             f"{heads} heads and {2 * half} rotated dims do not fit x "
                             f"{list(x.shape)}")
        f = get_format(fmt)
        if f.element != "bf16":
            check_width(f, kv_width)
        # kv_quantize's element numbering; -1: bf16 bytes. (The block is the decoder's.)
        element = -1 if f.element == "bf16" else int(f.element != "e2m1")
        block, packed, elem, scale = _any_decoding(fmt)
        for pool in (k_pool, v_pool):
            if not pool.is_contiguous() or pool.shape[-1] != bytes_per_entry(fmt, kv_width):
                raise ValueError(f"dense_attention_block: pools must be contiguous rows of "
                                 f"{bytes_per_entry(fmt, kv_width)} bytes")
        stored = _matrix_dtype(wq, wk, wv, wo)
        same, held = _converted((norm, wq, wk, wv, wo, freqs),
                                (torch.float32, stored, stored, stored, stored, torch.float64))
        out = torch.empty(b, dim)
        n, q, k, v, o, fr = map(_ptr, held)
        # x, positions, the table (and its width), the new rows, the lengths and the
        # threads (slots 0, 13, 21-25, 34) are set each call.
        block_args = ArgBlock("kv_dense_attention_block", (
            0, b, dim, n, eps, q, k, v, o, int(stored is torch.bfloat16), heads,
            kv_width // d, d, 0, fr, half, _ptr(k_pool), _ptr(v_pool), k_pool.shape[1],
            k_pool.shape[2], v_pool.shape[2], 0, 0, 0, 0, 0, element, int(f.scale == "e4m3"),
            block, packed, _ptr(elem), _ptr(scale), d**-0.5, _ptr(out), 0))
        return same, (block_args, out, held)

    key = (x.shape, eps, heads, fmt, k_pool.shape, v_pool.shape,
           *map(_data_ptr, (norm, wq, wk, wv, wo, freqs, k_pool, v_pool)))
    block, out, _held = _plan(keep, "dense_attention_block", key, make)
    x = _as(x, torch.float32)
    positions, table = _as(positions.reshape(b), torch.int64), _as(block_table, torch.int64)
    new_block, new_offset = _as(new_rows[0], torch.int64), _as(new_rows[1], torch.int64)
    lengths = _as(lengths, torch.int64)
    at = block.slots
    at[0], at[13], at[21], at[22] = _ptr(x), _ptr(positions), _ptr(table), table.shape[1]
    at[23], at[24], at[25] = _ptr(new_block), _ptr(new_offset), _ptr(lengths)
    at[34] = _threads()
    block()
    return out


def grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows ends[g-1]:ends[g] of x [M, K] (float32) times w[g] [K, N] (float32, or bf16
    widened in registers: no float copy; any strides of w; ends [G] int32): [M, N], rows
    past ends[-1] zero. Within float rounding of torch's on w in float32."""
    if w.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"grouped_mm: float32 or bf16 weights, got {w.dtype}")
    x = _as(x, torch.float32)
    ends = ends.to(torch.int32).contiguous()
    g, k, n = w.shape
    out = torch.zeros(x.shape[0], n, dtype=torch.float32)  # rows past ends[-1] stay 0
    _load().kv_grouped_mm(_ptr(x), k, _ptr(w), g, n, *w.stride(), _ptr(ends),
                          _ptr(out), int(w.dtype is torch.bfloat16), _threads())
    return out


# Packed weights (weights.c): its format numbers, and the decode tables of each.
_WEIGHT_FORMATS = {"fp8": 0, "fp4": 1, "bf16": 2}


@functools.cache
def _weight_tables(fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    tables = decode_tables("fp4_ue8m0_32" if fmt == "fp4" else "fp8_ue8m0_32")
    assert tables is not None
    return tables


def fp8_has_nan(codes: torch.Tensor) -> bool:
    """Whether E4M3 codes (uint8) hold a NaN (0x7F or 0xFF) anywhere: one pass."""
    codes = codes.contiguous()
    return bool(_load().kv_fp8_has_nan(_ptr(codes), codes.numel()))


# From this many tokens a call decodes an FP8 weight once into a transient float32 copy and
# multiplies it by torch's GEMM (MKL / oneDNN), which then outruns decoding each weight once
# per four tokens in registers (16.8 against 10.6 GMAC/s on one core here; wo_b 5120x8192
# at 128 tokens: 458 against 499 ms, at 512: 1.44 against 2.18 s, the copy's decoding and
# page faults amortised). A prefill chunk takes it; decode batches stay below it.
GEMM_TOKENS = 128
# A small bf16 weight is widened for torch's GEMM from fewer tokens: where its float32 copy
# stays in the CPU's caches, widening it costs a copy, not a decode (one thread here,
# kernel against torch: a 256x256 weight at 24 tokens 66 against 61 us, at 48 123 against
# 93, at 512 922 against 665; a 2048x256 head at 16 tokens 325 against 373, at 32 637
# against 436). A decode batch of up to 16 stays in the kernel. A larger bf16 weight (a
# V4.1 checkpoint's head: a 3.7 GB float32 copy) is never widened: the kernel reads it
# as stored, where the copy would write and read twice its bytes again.
BF16_GEMM_TOKENS = 24
BF16_GEMM_ELEMENTS = 1 << 20  # the largest bf16 weight widened: a 4 MiB float32 copy


def fp8_dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 values [O, K] of an FP8 block-scaled weight, bit for bit
    `kvstack.formats.weights.dequantize_fp8_blocks`'s."""
    elem, scale = _weight_tables("fp8")
    codes, scales = codes.contiguous(), scales.contiguous()
    out = torch.empty(codes.shape, dtype=torch.float32)
    _load().kv_fp8_dequantize(_ptr(codes), _ptr(scales), *codes.shape, _ptr(elem), _ptr(scale),
                              _ptr(out), _threads())
    return out


def packed_linear(x: torch.Tensor, fmt: str, codes: torch.Tensor,
                  scales: torch.Tensor | None = None, groups: int = 1,
                  nan_codes: bool = True) -> torch.Tensor:
    """x [N, groups * K] times W^T for W [O, K] held packed: "fp8" (E4M3 codes uint8 [O, K],
    UE8M0 scales uint8 [ceil(O/32), ceil(K/32)]) or "bf16" (codes bf16 [O, K]); [N, O]
    float32, equal to dequantise-then-matmul within float32 rounding. groups > 1: W is
    block-diagonal, output rows of group g (O / groups each) reading x's columns
    g*K .. g*K + K - 1 (V4.1's wo_a). nan_codes=False: the codes are known to hold no NaN
    (`fp8_has_nan`), and the kernel does not look for them. An FP8 call of GEMM_TOKENS
    tokens or more, or a bf16 one of BF16_GEMM_TOKENS of a weight up to BF16_GEMM_ELEMENTS,
    multiplies a transient float32 copy of the weight instead."""
    if fmt not in ("fp8", "bf16"):  # FP4 weights are experts: fp4_grouped
        raise ValueError(f"packed_linear multiplies fp8 or bf16 weights, not {fmt!r}")
    o, k = codes.shape
    if o % groups:
        raise ValueError(f"a weight of {o} rows does not split into {groups} groups")
    x = x.float().contiguous()
    n = x.shape[0]
    if x.dim() != 2 or x.shape[1] != groups * k:
        raise ValueError(f"packed_linear: x must be [N, {groups * k}], got {list(x.shape)}")
    if (fmt == "bf16" and n >= BF16_GEMM_TOKENS and o * k <= BF16_GEMM_ELEMENTS) or (
            fmt == "fp8" and n >= GEMM_TOKENS and scales is not None):
        weight = (codes.float() if fmt == "bf16" else fp8_dequantize(codes, scales))
        if groups == 1:
            return F.linear(x, weight)  # the copy is dropped after
        return torch.einsum("ngk,grk->ngr", x.view(n, groups, k),
                            weight.view(groups, o // groups, k)).reshape(n, o)
    elem, scale = _weight_tables(fmt)
    codes = codes.contiguous()
    scales = None if scales is None else scales.contiguous()
    scale_ptr = 0 if scales is None else _ptr(scales)
    out = torch.empty(n, o, dtype=torch.float32)
    if n:
        _load().kv_packed_linear(_ptr(x), n, _WEIGHT_FORMATS[fmt], _ptr(codes), scale_ptr, o,
                                 k, groups, _ptr(elem), _ptr(scale), int(nan_codes), _ptr(out),
                                 ISAS.index(weights_isa()), _threads())
    return out


def fp4_grouped(x: torch.Tensor, pointers: torch.Tensor, experts: torch.Tensor,
                ends: torch.Tensor, out_features: int) -> torch.Tensor:
    """Rows ends[g-1]:ends[g] of x [M, K] times the FP4 weight [out_features, K] of expert
    experts[g] (E2M1 codes uint8 [O, K/2], UE8M0 scales [O, K/32]), whose addresses are
    row experts[g] of pointers [E, 2] (int64: codes, scales): [M, O] float32, rows past
    ends[-1] zero. One call for every expert a step routes to; the caller keeps the
    tensors behind `pointers` alive."""
    x = x.float().contiguous()
    experts = experts.to(torch.int32).contiguous()
    ends = ends.to(torch.int32).contiguous()
    elem, scale = _weight_tables("fp4")
    out = torch.zeros(x.shape[0], out_features, dtype=torch.float32)
    if x.shape[0]:
        _load().kv_fp4_grouped(_ptr(x), x.shape[1], _ptr(pointers), _ptr(experts), _ptr(ends),
                               experts.numel(), out_features, _ptr(elem), _ptr(scale),
                               _ptr(out), ISAS.index(weights_isa()), _threads())
    return out


# The step's small ops (step.c). The model asks `fuses(...)` for its tensors: inside an
# engine step that chose the C kernels, for float32 CPU tensors outside autograd and
# outside a traced graph (a compiled step fuses them itself).
def fuses(*tensors: torch.Tensor) -> bool:
    """Whether the model's small ops on these tensors run in step.c."""
    if getattr(_step, "on", None) is not True or _grad_enabled() or _compiling():
        return False
    for t in tensors:  # noqa: SIM110 (a loop: this runs dozens of times a step)
        if t.dtype is not _F32 or not t.is_cpu:
            return False
    return True


# Bound once: `fuses` runs about fifty times a decode step, where looking up
# `torch.compiler.is_compiling` alone took a microsecond a call.
_grad_enabled, _compiling, _F32 = torch.is_grad_enabled, torch.compiler.is_compiling, torch.float32
# A plan's key holds its weights' addresses, read by map rather than a comprehension.
_data_ptr = torch.Tensor.data_ptr


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as a contiguous tensor of dtype, with no op dispatched where it already is one."""
    if t.dtype is not dtype:
        t = t.to(dtype)
    return t if t.is_contiguous() else t.contiguous()


def _matrix_dtype(*matrices: torch.Tensor) -> torch.dtype:
    """How a call of step.c takes its weight matrices: as stored where all are bf16 (a
    checkpoint's, or an engine's `dtype="bfloat16"`: the kernels widen them in
    registers), else float32 (any other dtype converted)."""
    for m in matrices:  # (a loop, not all(): this runs several times a layer)
        if m.dtype is not torch.bfloat16:
            return torch.float32
    return torch.bfloat16


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
             norm_eps: float, hc_eps: float,
             iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`HyperConnection.mixes` of x [..., h, dim]: pre [..., h], post [..., h], comb
    [..., h, h], within float rounding of torch's."""
    *lead, h, dim = x.shape
    if (2 + h) * h > 64:
        raise ValueError(f"hc_mixes: at most 6 residual copies, got {h}")
    x = x.contiguous()
    n = x.numel() // (h * dim)
    pre, post = x.new_empty(*lead, h), x.new_empty(*lead, h)
    comb = x.new_empty(*lead, h, h)
    fn, scale, base = fn.contiguous(), scale.contiguous(), base.contiguous()
    _load().kv_hc_mixes(_ptr(x), n, h, dim, _ptr(fn), _ptr(scale),
                        _ptr(base), norm_eps, hc_eps, iters, _ptr(pre), _ptr(post),
                        _ptr(comb), _threads())
    return pre, post, comb


def hc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_i pre_i * copy i: x [..., h, dim], pre [..., h] -> [..., dim]."""
    *lead, h, dim = x.shape
    if pre.shape != x.shape[:-1]:
        raise ValueError(f"hc_collapse: pre must be {list(x.shape[:-1])}, got {list(pre.shape)}")
    x, pre = x.contiguous(), pre.contiguous()
    out = x.new_empty(*lead, dim)
    _load().kv_hc_collapse(_ptr(x), _ptr(pre), x.numel() // (h * dim), h, dim, _ptr(out))
    return out


def hc_post(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor,
            comb: torch.Tensor) -> torch.Tensor:
    """Copy i <- post_i * y + sum_k comb[k, i] * copy k: y [..., dim], x [..., h, dim],
    post [..., h], comb [..., h, h] -> [..., h, dim]."""
    h, dim = x.shape[-2:]
    if (post.shape != x.shape[:-1] or comb.shape != (*x.shape[:-1], h)
            or y.shape != (*x.shape[:-2], dim)):
        raise ValueError(f"hc_post: x {list(x.shape)} needs y [..., {dim}], post [..., {h}] "
                         f"and comb [..., {h}, {h}] of its leading dims")
    y, x, post, comb = y.contiguous(), x.contiguous(), post.contiguous(), comb.contiguous()
    out = torch.empty_like(x)
    _load().kv_hc_post(_ptr(y), _ptr(x), _ptr(post), _ptr(comb), x.numel() // (h * dim), h, dim,
                       _ptr(out))
    return out


def rope(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor,
         inverse: bool) -> torch.Tensor:
    """`kvstack.model.model.rotate` of x [B, n, width] or [B, n, heads, width] at
    positions [P, n] (P = 1 or B) with float64 freqs [R/2]."""
    b, n = x.shape[:2]
    heads = x.shape[2] if x.dim() == 4 else 1
    half = freqs.shape[0]
    if positions.dim() != 2 or positions.shape[1] != n or positions.shape[0] not in (1, b):
        raise ValueError(f"rope: positions must be [1 or {b}, {n}], got {list(positions.shape)}")
    if half > 512 or x.dim() not in (3, 4):
        raise ValueError(f"rope: x [B, n, (heads,) width] with at most 1024 rotated dims, "
                         f"got {list(x.shape)} and {2 * half}")
    x = x.contiguous()
    positions = _as(positions, torch.int64)
    out = torch.empty_like(x)
    freqs = freqs.contiguous()
    _load().kv_rope(_ptr(x), b, n, heads, x.shape[-1], _ptr(positions), positions.shape[0],
                    _ptr(freqs), half, int(inverse), _ptr(out))
    return out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(x * rsqrt(mean(x^2) + eps)) * weight over x's last dim."""
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    _load().kv_rmsnorm(_ptr(x), x.numel() // x.shape[-1], x.shape[-1], _ptr(weight), eps,
                       _ptr(out))
    return out


def attention_in(x: torch.Tensor, positions: torch.Tensor, wq_a: torch.Tensor,
                 q_norm: torch.Tensor, wq_b: torch.Tensor, wkv: torch.Tensor,
                 kv_norm: torch.Tensor, eps: float, freqs: torch.Tensor,
                 heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`Attention.forward`'s inputs to its attention for x [B, n, dim] at positions [B or
    1, n] with float32 or bf16 weights (wq_a [rank, dim], wq_b [heads * D, rank], wkv [D,
    dim]), the norms' weights, float64 RoPE freqs [R/2]: qr [B, n, rank], q [B, n, heads,
    D] and window [B, n, D], within float rounding of torch's."""
    b, n, dim = x.shape
    rank, d, half = wq_a.shape[0], wkv.shape[0], freqs.shape[0]
    if (wq_a.shape[1] != dim or wq_b.shape != (heads * d, rank) or wkv.shape[1] != dim
            or half > 512 or 2 * half > d):
        raise ValueError(f"attention_in: weights {list(wq_a.shape)}, {list(wq_b.shape)}, "
                         f"{list(wkv.shape)} and {2 * half} rotated dims do not fit x "
                         f"{list(x.shape)} and {heads} heads")
    x = _as(x, torch.float32)
    positions = _as(positions.expand(b, n), torch.int64)
    qr, q, window = x.new_empty(b, n, rank), x.new_empty(b, n, heads, d), x.new_empty(b, n, d)
    stored = _matrix_dtype(wq_a, wq_b, wkv)
    wq_a, wq_b, wkv = (_as(t, stored) for t in (wq_a, wq_b, wkv))
    q_norm, kv_norm = _as(q_norm, torch.float32), _as(kv_norm, torch.float32)
    freqs = _as(freqs, torch.float64)
    _load().kv_attention_in(_ptr(x), b * n, dim, _ptr(wq_a), _ptr(q_norm), rank, _ptr(wq_b),
                            heads, d, _ptr(wkv), _ptr(kv_norm), eps, _ptr(positions),
                            _ptr(freqs), half, _ptr(qr), _ptr(q), _ptr(window),
                            int(stored is torch.bfloat16), _threads())
    return qr, q, window


def _plan(keep: dict | None, name: str, key: tuple,
          make: Callable[[], tuple[bool, tuple]]) -> tuple:
    """What a C call does not change from call to call at one site: `make()` gives
    (whether it may be kept, the plan), kept in the caller's `keep` under name while key
    (the shapes, the weights' addresses) stays the same. A plan may be kept only where it
    holds no converted copy of a weight, which an in-place update of the weight would
    leave behind."""
    plan = None if keep is None else keep.get(name)
    # A plan's addresses are its own tensors'; a copied or unpickled keep (a deep-copied
    # model) holds tensors at other addresses, which the sentinel's address tells.
    if plan is not None and plan[0] == key and plan[2].data_ptr() == plan[3]:
        return plan[1]
    # keep[name] is the last call's plan (a decode recipe takes its blocks from there);
    # a few recent small ones wait beside it, for a site whose shapes take turns (a
    # speculative verify's rows change from step to step).
    recent = None if keep is None else keep.setdefault(name + RECENT, {})
    plan = None if recent is None else recent.get(key)
    if plan is not None and plan[2].data_ptr() == plan[3]:
        keep[name] = plan
        return plan[1]
    keepable, made = make()
    if keep is not None and keepable:
        sentinel = _first_tensor(made)
        keep[name] = (key, made, sentinel, sentinel.data_ptr())
        if _tensor_bytes(made, set(key)) <= RECENT_PLAN_BYTES:
            if len(recent) >= RECENT_PLANS:
                del recent[next(iter(recent))]  # the oldest
            recent[key] = keep[name]
    return made


# A call site keeps up to RECENT_PLANS plans of other shapes whose buffers hold at most
# RECENT_PLAN_BYTES each (a verify's few rows: not a prefill chunk's).
RECENT, RECENT_PLANS, RECENT_PLAN_BYTES = "#recent", 8, 1 << 18


def _tensor_bytes(made: object, named: set) -> int:
    """The bytes of the tensors in a plan's nested tuples and lists but for those whose
    address its key names (the caller's weights, which a kept plan points at, unconverted:
    not buffers of its own)."""
    if isinstance(made, torch.Tensor):
        return 0 if made.data_ptr() in named else made.numel() * made.element_size()
    if isinstance(made, tuple | list):
        return sum(_tensor_bytes(part, named) for part in made)
    return 0


def _first_tensor(made: object) -> torch.Tensor | None:
    """The first tensor in a plan's nested tuples and lists."""
    if isinstance(made, torch.Tensor):
        return made
    for part in made if isinstance(made, tuple | list) else ():
        found = _first_tensor(part)
        if found is not None:
            return found
    return None


def _converted(tensors: tuple[torch.Tensor, ...], dtypes: tuple[torch.dtype, ...]
               ) -> tuple[bool, list[torch.Tensor]]:
    """The tensors as contiguous tensors of the dtypes, and whether none had to be
    copied."""
    out = [_as(t, dtype) for t, dtype in zip(tensors, dtypes, strict=True)]
    return all(o is t for o, t in zip(out, tensors, strict=True)), out


def attention_block_in(x: torch.Tensor, hc: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                       hc_eps: float, iters: int, collapse_pre: torch.Tensor | None,
                       norm: torch.Tensor, positions: torch.Tensor, wq_a: torch.Tensor,
                       q_norm: torch.Tensor, wq_b: torch.Tensor, wkv: torch.Tensor,
                       kv_norm: torch.Tensor, eps: float, freqs: torch.Tensor,
                       heads: int, keep: dict | None = None) -> tuple[torch.Tensor, ...]:
    """A layer's attention half up to its attention for x [B, n, h, dim] (h residual
    copies) in one call: the hyper-connection's mixes (hc: fn, scale, base), the copies
    collapsed with collapse_pre [B, n, h] or the mixes' own pre (None), RMSNorm (norm),
    then `attention_in` on the result: (pre, post [B, n, h], comb [B, n, h, h], the
    attention input y [B, n, dim], qr, q, window), within float rounding of the separate
    calls'. keep: a dict the caller holds for this call site, where the weights'
    addresses and the outputs' buffers stay between calls of one shape (each call then
    overwrites the previous call's outputs: for a caller done with them by then)."""
    b, n, h, dim = x.shape
    weights = (*hc, norm, wq_a, q_norm, wq_b, wkv, kv_norm, freqs)

    def make() -> tuple[bool, tuple]:
        rank, d, half = wq_a.shape[0], wkv.shape[0], freqs.shape[0]
        if ((2 + h) * h > 64 or wq_a.shape[1] != dim or wq_b.shape != (heads * d, rank)
                or wkv.shape[1] != dim or half > 512 or 2 * half > d):
            raise ValueError(f"attention_block_in: weights {list(wq_a.shape)}, "
                             f"{list(wq_b.shape)}, {list(wkv.shape)}, {2 * half} rotated "
                             f"dims and {h} residual copies do not fit x {list(x.shape)} and "
                             f"{heads} heads")
        stored = _matrix_dtype(wq_a, wq_b, wkv)
        f32 = torch.float32  # hc's three, norm, (wq_a), q_norm, (wq_b, wkv), kv_norm
        same, held = _converted(weights, (f32,) * 4 + (stored, f32, stored, stored, f32,
                                                       torch.float64))
        outs = (x.new_empty(b, n, h), x.new_empty(b, n, h), x.new_empty(b, n, h, h),
                x.new_empty(b, n, dim), x.new_empty(b, n, rank), x.new_empty(b, n, heads, d),
                x.new_empty(b, n, d))
        p = [_ptr(t) for t in held]
        # x, collapse_pre, positions and the threads (slots 0, 10, 20, 31) are set each call.
        block = ArgBlock("kv_attention_block_in", (
            0, b * n, h, dim, *p[:3], eps, hc_eps, iters, 0, p[3], p[4], p[5], rank, p[6],
            heads, d, p[7], p[8], 0, p[9], half, *map(_ptr, outs),
            int(stored is torch.bfloat16), 0))
        return same, (block, outs, held)

    key = (x.shape, heads, eps, hc_eps, iters, *map(_data_ptr, weights))
    block, outs, _held = _plan(keep, "attention_block_in", key, make)
    if collapse_pre is not None and collapse_pre.shape != x.shape[:-1]:
        raise ValueError(f"attention_block_in: collapse_pre must be {list(x.shape[:-1])}, "
                         f"got {list(collapse_pre.shape)}")
    x = x.contiguous()
    pre_in = None if collapse_pre is None else collapse_pre.contiguous()
    if positions.shape != (b, n):
        positions = positions.expand(b, n)
    positions = _as(positions, torch.int64)
    at = block.slots
    at[0], at[10] = _ptr(x), 0 if pre_in is None else _ptr(pre_in)
    at[20], at[31] = _ptr(positions), _threads()
    block()
    return outs


def attention_out(out: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor,
                  wo_a: torch.Tensor, groups: int, wo_b: torch.Tensor,
                  spread: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                  keep: dict | None = None, spent: bool = False) -> torch.Tensor:
    """`Attention.project_out` of the heads' outputs out [B, n, H, D] at positions [B or
    1, n] with float32 or bf16 weights (wo_a [groups * rank, H / groups * D], wo_b [dim,
    groups * rank]): [B, n, dim], within float rounding of torch's. With `spread` (the residual
    copies x [B, n, h, dim], post [B, n, h], comb [B, n, h, h]), that output spread over
    the copies as `hc_post` does, in the same call: [B, n, h, dim]. keep: as
    `attention_block_in`'s (the returned tensor is one of the buffers it keeps). spent:
    nothing reads out after the call, so it may take the rotation back in place (else a
    copy of it does)."""
    b, n, h, d = out.shape
    dim = wo_b.shape[0]
    copies_n = 0 if spread is None else spread[0].shape[-2]

    def make() -> tuple[bool, tuple]:
        half, rank = freqs.shape[0], wo_a.shape[0] // groups
        if (h % groups or wo_a.shape != (groups * rank, h // groups * d)
                or wo_b.shape[1] != groups * rank or half > 512 or 2 * half > d):
            raise ValueError(f"attention_out: weights {list(wo_a.shape)} and "
                             f"{list(wo_b.shape)} in {groups} groups and {2 * half} rotated "
                             f"dims do not fit the heads' outputs {list(out.shape)}")
        stored = _matrix_dtype(wo_a, wo_b)
        same, held = _converted((freqs, wo_a, wo_b), (torch.float64, stored, stored))
        rotated = torch.empty(b, n, h, d)  # the heads' outputs, rotated in place
        low, y = torch.empty(b * n, groups * rank), torch.empty(b, n, dim)
        spread_out = torch.empty(b, n, copies_n, dim) if spread is not None else None
        f, a, o = map(_ptr, held)
        wbf16 = int(stored is torch.bfloat16)
        # The heads' outputs and positions (slots 0, 4), the copies, post and comb (14, 16,
        # 17) and the threads (the last) are set each call.
        args = (_ptr(rotated), b * n, h, d, 0, f, half, a, groups, rank, o, dim, _ptr(low),
                _ptr(y))
        block = (ArgBlock("kv_attention_out", (*args, wbf16, 0)) if spread_out is None
                 else ArgBlock("kv_attention_out_spread", (*args, 0, copies_n, 0, 0,
                                                           _ptr(spread_out), wbf16, 0)))
        # low and y are held with the weights: the call writes them.
        return same, (block, rotated, y if spread_out is None else spread_out,
                      (*held, low, y))

    key = (out.shape, groups, copies_n, freqs.data_ptr(), wo_a.data_ptr(), wo_b.data_ptr())
    block, rotated, result, _held = _plan(keep, "attention_out", key, make)
    if spent and out.dtype is torch.float32 and out.is_contiguous():
        rotated = out
    else:
        rotated.copy_(out)
    if positions.shape != (b, n):
        positions = positions.expand(b, n)
    positions = _as(positions, torch.int64)
    at = block.slots
    at[0], at[4], at[len(at) - 1] = _ptr(rotated), _ptr(positions), _threads()
    if spread is not None:
        copies, post, comb = spread
        copies, post, comb = copies.contiguous(), post.contiguous(), comb.contiguous()
        if (copies.shape != (b, n, copies_n, dim) or post.shape != copies.shape[:-1]
                or comb.shape != (*copies.shape[:-1], copies_n)):
            raise ValueError(f"attention_out: spread over copies {list(copies.shape)} needs "
                             f"[{b}, {n}, h, {dim}] with post [..., h] and comb [..., h, h]")
        at[14], at[16], at[17] = _ptr(copies), _ptr(post), _ptr(comb)
    block()
    return result


def compress_step(x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, ratio: int,
                  wkv: torch.Tensor, wgate: torch.Tensor | None,
                  partial: tuple[torch.Tensor, torch.Tensor] | None, norm: torch.Tensor,
                  norm_eps: float, wk_index: torch.Tensor, index_norm: torch.Tensor,
                  index_eps: float, freqs: torch.Tensor,
                  write: tuple[torch.Tensor, str, torch.Tensor, str, torch.Tensor,
                               torch.Tensor] | None = None,
                  group_rows: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`Compressor._compress_step` for one token of each of B sequences, x [B, dim] at
    positions [B] with weights wkv, wgate [D, dim] and wk_index [Di, D] all float32 or all
    bf16 (a checkpoint's, multiplied as stored), float32 norm weights and float64 RoPE
    freqs [R/2]: the rotated entries [B, D] and index keys [B, Di]
    of the groups the tokens end, within float rounding of torch's. With ratio > 1,
    partial is the partial groups' values and gate logits [slots, ratio - 1, D]
    (contiguous float32, updated in place at each sequence's slot). write: (the "kv"
    pool, its block-scaled format, the "index" pool, its format, blocks [B], offsets
    [B]): both written in the same call as `stream_write` writes them, into the pools
    [blocks, per, bytes] (contiguous, in place). Rows run in order (a sequence's rows at
    consecutive positions pool each other). group_rows: with ratio > 1, float32 [B, 2, D]
    that gets each row's new values and gate logits."""
    args, how, kv, keys, _held = _compress_args(
        x, positions, slots, ratio, wkv, wgate, partial, norm, norm_eps, wk_index,
        index_norm, index_eps, freqs, write, group_rows)
    (_load().kv_compress_step if write is None else _load().kv_compress_write)(*args, *how)
    return kv, keys


def compress_write_block(x: torch.Tensor, ratio: int, wkv: torch.Tensor,
                         wgate: torch.Tensor | None,
                         partial: tuple[torch.Tensor, torch.Tensor] | None,
                         norm: torch.Tensor, norm_eps: float, wk_index: torch.Tensor,
                         index_norm: torch.Tensor, index_eps: float, freqs: torch.Tensor,
                         write: tuple[torch.Tensor, str, torch.Tensor, str, torch.Tensor,
                                      torch.Tensor]) -> tuple[ArgBlock, tuple]:
    """`compress_step` with `write` and no group rows as one kept C call (step.c's
    `kv_compress_write`) of x [B, dim] (contiguous float32: its address is the block's);
    the entries and index keys it makes go to its own buffers, which nothing reads. Returns
    the block and what it holds. A step sets slots 3 (positions [B] int64), 4 (slots [B]),
    34 and 35 (blocks, offsets [B] of the new rows) and 39 (threads)."""
    if not (x.is_contiguous() and x.dtype is torch.float32):
        raise ValueError("compress_write_block: x must be contiguous float32")
    b = x.shape[0]
    index = torch.zeros(b, dtype=torch.int64)  # stands for positions, slots, blocks, offsets
    args, how, kv, keys, held = _compress_args(
        x, index, index, ratio, wkv, wgate, partial, norm, norm_eps, wk_index, index_norm,
        index_eps, freqs, (*write[:4], index, index), None)
    given = (wkv, wk_index, wgate, norm, index_norm, freqs, x)
    if any(t is not u for t, u in zip(held, given, strict=False)):
        # A converted copy would not follow an in-place update of the weight it copies.
        raise ValueError("compress_write_block: the weights must be contiguous, the "
                         "projections all float32 or all bf16, the norms float32, freqs "
                         "float64")
    args[3] = args[4] = args[34] = args[35] = 0
    return ArgBlock("kv_compress_write", (*args, *how)), (held, kv, keys, x)


def _compress_args(x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, ratio: int,
                   wkv: torch.Tensor, wgate: torch.Tensor | None,
                   partial: tuple[torch.Tensor, torch.Tensor] | None, norm: torch.Tensor,
                   norm_eps: float, wk_index: torch.Tensor, index_norm: torch.Tensor,
                   index_eps: float, freqs: torch.Tensor,
                   write: tuple[torch.Tensor, str, torch.Tensor, str, torch.Tensor,
                                torch.Tensor] | None,
                   group_rows: torch.Tensor | None) -> tuple[list, tuple, torch.Tensor,
                                                             torch.Tensor, tuple]:
    """`compress_step`'s arguments checked and converted: (kv_compress_step's or, with
    write, kv_compress_write's arguments up to group_rows, then (weights_bf16, isa,
    threads), the entries and keys [B, D], [B, Di] it writes, the converted tensors whose
    addresses the arguments hold)."""
    b, dim = x.shape
    d, di, half = wkv.shape[0], wk_index.shape[0], freqs.shape[0]
    if group_rows is not None and (ratio == 1 or group_rows.shape != (b, 2, d)
                                   or group_rows.dtype is not torch.float32
                                   or not group_rows.is_contiguous()):
        raise ValueError(f"compress_step: group_rows must be contiguous float32 [{b}, 2, {d}]"
                         f" with ratio > 1")
    rows_out = 0 if group_rows is None else _ptr(group_rows)
    if ratio > 1 and (wgate is None or partial is None or partial[0].shape[1:] != (ratio - 1, d)
                      or not all(t.is_contiguous() and t.dtype is torch.float32
                                 for t in partial)):
        raise ValueError(f"compress_step: ratio {ratio} needs wgate and contiguous float32 "
                         f"partial groups [slots, {ratio - 1}, {d}]")
    if wkv.shape[1] != dim or wk_index.shape[1] != d or ratio > 64 or half > 512 \
            or 2 * half > min(d, di):
        raise ValueError(f"compress_step: weights {list(wkv.shape)} and "
                         f"{list(wk_index.shape)}, ratio {ratio} and {2 * half} rotated dims "
                         f"do not fit x {list(x.shape)}")
    projections = (wkv, wk_index) if wgate is None else (wkv, wk_index, wgate)
    stored = wkv.dtype if wkv.dtype in (torch.float32, torch.bfloat16) else None
    if stored is None or any(w.dtype is not stored for w in projections):
        raise ValueError("compress_step: wkv, wgate and wk_index must be all float32 or all "
                         f"bf16, got {', '.join(str(w.dtype) for w in projections)}")
    x = _as(x, torch.float32)
    positions, slots = _as(positions, torch.int64), _as(slots, torch.int64)
    wkv, wk_index = _as(wkv, stored), _as(wk_index, stored)
    wgate = None if wgate is None else _as(wgate, stored)
    norm, index_norm = _as(norm, torch.float32), _as(index_norm, torch.float32)
    freqs = _as(freqs, torch.float64)
    kv, keys = x.new_empty(b, d), x.new_empty(b, di)
    values, gates = partial if ratio > 1 else (None, None)
    args = (_ptr(x), b, dim, _ptr(positions), _ptr(slots), ratio, _ptr(wkv),
            0 if wgate is None else _ptr(wgate), d, 0 if values is None else _ptr(values),
            0 if gates is None else _ptr(gates), _ptr(norm), norm_eps, _ptr(wk_index), di,
            _ptr(index_norm), index_eps, _ptr(freqs), half, _ptr(kv), _ptr(keys))
    how = (int(stored is torch.bfloat16), ISAS.index(weights_isa()), _threads())
    held = (wkv, wk_index, wgate, norm, index_norm, freqs, x, positions, slots)
    if write is None:
        return [*args, rows_out], how, kv, keys, held
    kv_pool, kv_fmt, index_pool, index_fmt, blocks, offsets = write
    targets = []
    for pool, fmt, width in ((kv_pool, kv_fmt, d), (index_pool, index_fmt, di)):
        coding = _row_coding(fmt, width)
        if (coding is None or not pool.is_contiguous() or pool.shape[1] != kv_pool.shape[1]
                or pool.shape[-1] != coding[0]):
            raise ValueError(f"compress_step: the pools must be contiguous rows of "
                             f"block-scaled formats, {width} wide, as many a block")
        targets += [_ptr(pool), *coding[1]]
    blocks, offsets = _as(blocks, torch.int64), _as(offsets, torch.int64)
    return ([*args, *targets, kv_pool.shape[1], _ptr(blocks), _ptr(offsets), rows_out], how,
            kv, keys, (*held, blocks, offsets))


@functools.cache
def _row_coding(fmt: str, width: int) -> tuple[int, tuple[int, ...]] | None:
    """A block-scaled format's row bytes at `width` and how step.c's writes take it (element
    and scale kinds, block, the decode tables' addresses: the tables are kept with the
    cache); None for any other format. Asked at every compression of a decode step."""
    if not decodes(fmt):
        return None
    f = get_format(fmt)
    block, _, elem, scale = _decoding(fmt)
    return bytes_per_entry(fmt, width), (int(f.element != "e2m1"), int(f.scale == "e4m3"),
                                          block, _ptr(elem), _ptr(scale))


def index_queries(qr: torch.Tensor, x: torch.Tensor, positions: torch.Tensor,
                  wq: torch.Tensor, wweights: torch.Tensor, heads: int, freqs: torch.Tensor,
                  query_format: str, scale: float,
                  keep: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`Indexer._queries` for qr [B, n, rank] and x [B, n, dim] at positions [B or 1, n]
    with float32 or bf16 weights (wq [heads * Di, rank], wweights [heads, dim]) and float64
    RoPE freqs [R/2]: the queries [B, n, heads, Di], rotated and, unless query_format is "none",
    rounded through it as the straight-through forward does, and the head weights [B, n,
    heads] times scale, within float rounding of torch's. keep: as
    `attention_block_in`'s (both outputs are kept buffers)."""
    b, n, rank = qr.shape
    dim = x.shape[-1]
    key = (qr.shape, dim, heads, query_format, scale, wq.data_ptr(), wweights.data_ptr(),
           freqs.data_ptr())
    (middle, tail), outs, _held = _plan(
        keep, "index_queries", key,
        lambda: _index_query_plan(qr, x, wq, wweights, heads, freqs, query_format, scale))
    qr, x = _as(qr, torch.float32), _as(x, torch.float32)
    if positions.shape != (b, n):
        positions = positions.expand(b, n)
    positions = _as(positions, torch.int64)
    _load().kv_index_queries(_ptr(qr), _ptr(x), b * n, rank, dim, *middle, _ptr(positions),
                             *tail, _threads())
    return outs


def _index_query_plan(qr: torch.Tensor, x: torch.Tensor, wq: torch.Tensor,
                      wweights: torch.Tensor, heads: int, freqs: torch.Tensor,
                      query_format: str, scale: float) -> tuple[bool, tuple]:
    """`index_queries`' plan: (whether it may be kept, ((kv_index_queries' arguments from
    wq to di), (from freqs to w)), its outputs q [B, n, heads, Di] and w [B, n, heads], the
    weights as the call reads them)."""
    b, n, rank = qr.shape
    dim = x.shape[-1]
    half, di = freqs.shape[0], wq.shape[0] // heads
    if (wq.shape != (heads * di, rank) or wweights.shape != (heads, dim)
            or x.shape[:2] != (b, n) or half > 512 or 2 * half > di):
        raise ValueError(f"index_queries: weights {list(wq.shape)} and "
                         f"{list(wweights.shape)} with {heads} heads and {2 * half} "
                         f"rotated dims do not fit qr {list(qr.shape)} and x "
                         f"{list(x.shape)}")
    if query_format == "none":
        element, scale_kind, block, tables = -1, 0, 0, _weight_tables("fp8")
    else:
        f = get_format(query_format)
        check_width(f, di)
        tables = decode_tables(query_format)
        if tables is None:
            raise ValueError(f"index_queries: the C kernels round to block-scaled "
                             f"formats only, got {query_format}")
        element, scale_kind, block = (int(f.element != "e2m1"), int(f.scale == "e4m3"),
                                      f.scale_block)
    stored = _matrix_dtype(wq, wweights)
    same, held = _converted((wq, wweights, freqs), (stored, stored, torch.float64))
    outs = (qr.new_empty(b, n, heads, di, dtype=torch.float32),
            qr.new_empty(b, n, heads, dtype=torch.float32))
    wq_p, ww_p, freqs_p = map(_ptr, held)
    args = ((wq_p, ww_p, int(stored is torch.bfloat16), heads, di),
            (freqs_p, half, element, scale_kind, block, _ptr(tables[0]), _ptr(tables[1]),
             scale, *map(_ptr, outs)))
    return same, (args, outs, held)


INDEX_SELECT_MODES = ("scores", "candidate_source", "in_pool")  # kv_index_select's numbering


def index_select_block(qr: torch.Tensor, x: torch.Tensor, wq: torch.Tensor,
                       wweights: torch.Tensor, heads: int, freqs: torch.Tensor,
                       query_format: str, scale: float, mode: str, keys: torch.Tensor,
                       fmt: str, n_entries: int, ratio: int, kb: int, span: int,
                       k: int) -> tuple[ArgBlock, tuple]:
    """A decode layer's index selection as one kept C call (step.c's `kv_index_select`):
    `index_queries` of qr [B, 1, rank] and x [B, 1, dim] (kept buffers: their addresses
    are the block's), then by mode, over the index keys of format fmt (keys [blocks, per,
    bytes]):
    - "scores": `index_scores` of the first n_entries entries and `select_topk` of them
      (k <= n_entries);
    - "candidate_source": the same, with `candidate_pool` of kb spans of `span` entries
      first, written to the spans slot's [B, kb];
    - "in_pool": `select_in_pool` of the spans slot's [B, kb] (k <= kb * span).
    Returns the block and what it holds (weights, queries, head weights). A step sets
    slots 10 (positions [B] int64), 25 and 26 (the block table [B, max_blocks] and its
    width), 33 (each sequence's entries [B], "in_pool"), 34 (the spans), 38 (the top-k out
    [B, k] int64) and 39 (threads)."""
    b, n, rank = qr.shape
    if n != 1 or mode not in INDEX_SELECT_MODES or not 0 < k <= (
            kb * span if mode == "in_pool" else n_entries):
        raise ValueError(f"index_select_block: {mode} selection of {k} for {n} queries a "
                         f"sequence over {n_entries} entries, {kb} spans of {span}")
    if not (qr.is_contiguous() and x.is_contiguous() and keys.is_contiguous()
            and qr.dtype is torch.float32 and x.dtype is torch.float32):
        raise ValueError("index_select_block: qr, x and the keys must be contiguous, qr and x "
                         "float32")
    _keepable, ((middle, tail), (q, w), held) = _index_query_plan(
        qr, x, wq, wweights, heads, freqs, query_format, scale)
    block, packed, elem, scale_table = _decoding(fmt)
    args = (_ptr(qr), _ptr(x), b, rank, x.shape[-1], *middle, 0, *tail,
            INDEX_SELECT_MODES.index(mode), _ptr(keys), keys.shape[1], keys.shape[2], 0, 0,
            block, packed, _ptr(elem), _ptr(scale_table), n_entries, ratio, 0, 0, kb, span, k,
            0, _threads())
    return ArgBlock("kv_index_select", args), (held, q, w, qr, x, keys)


def quantize(x: torch.Tensor, fmt: str, rows: bool = True, values: bool = True,
             check: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """`pack_rows(quantize(x, fmt))` [..., bytes_per_entry] and `dequantize` of it [..., d]
    for x [..., d] float32 and a block-scaled format, bit for bit the torch codecs' (each
    only where asked for), in one pass. check: as `kvstack.formats.quantize`'s, the same
    errors from the largest magnitude the pass saw."""
    f = get_format(fmt)
    tables = decode_tables(fmt)
    if tables is None:
        raise ValueError(f"format {fmt}: the C kernels quantise block-scaled formats only")
    d = x.shape[-1]
    check_width(f, d)
    if d > 16384:
        raise ValueError(f"format {fmt}: the C kernels quantise rows of at most 16384 values")
    x = x.contiguous()
    packed = torch.empty(*x.shape[:-1], bytes_per_entry(fmt, d), dtype=torch.uint8) \
        if rows else None
    out = torch.empty_like(x) if values else None
    magnitude = _load().kv_quantize(
        _ptr(x), x.numel() // d if d else 0, d, int(f.element != "e2m1"),
        int(f.scale == "e4m3"), f.scale_block, _ptr(tables[0]), _ptr(tables[1]),
        0 if packed is None else _ptr(packed), 0 if out is None else _ptr(out))
    if check:
        check_magnitude(f, magnitude)
    return packed, out


def ring_write(entries: torch.Tensor, fmt: str, rings: torch.Tensor, ring_pos: torch.Tensor,
               slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Each sequence's new entry (entries [B, D] float32) quantised to a block-scaled fmt
    straight into row positions % W of its slot of rings [slots, W, bytes] (contiguous,
    written in place), ring_pos [slots, W] (int64) set there: the values a read gives
    back, [B, D], bit for bit `quantize`'s. Positions are not negative."""
    f = get_format(fmt)
    block, _, elem, scale = _decoding(fmt)
    if not (rings.is_contiguous() and ring_pos.is_contiguous()
            and ring_pos.dtype is torch.int64):
        raise ValueError("ring_write: rings and ring_pos must be contiguous, ring_pos int64")
    entries = _as(entries, torch.float32)
    values = torch.empty_like(entries)
    slots, positions = _as(slots, torch.int64), _as(positions, torch.int64)
    _load().kv_ring_write(_ptr(entries), entries.shape[0], entries.shape[1],
                          int(f.element != "e2m1"), int(f.scale == "e4m3"), block, _ptr(elem),
                          _ptr(scale), _ptr(rings), _ptr(ring_pos), rings.shape[1],
                          _ptr(slots), _ptr(positions), _ptr(values))
    return values


def stream_write(entries: torch.Tensor, fmt: str, pool: torch.Tensor, blocks: torch.Tensor,
                 offsets: torch.Tensor) -> torch.Tensor:
    """Each sequence's new entry (entries [B, D] float32) quantised to a block-scaled fmt
    straight into row offsets[b] of block blocks[b] of pool [blocks, per, bytes]
    (contiguous, written in place): the values a read gives back, [B, D], bit for bit
    `quantize`'s."""
    f = get_format(fmt)
    block, _, elem, scale = _decoding(fmt)
    if not pool.is_contiguous() or pool.shape[-1] != bytes_per_entry(fmt, entries.shape[1]):
        raise ValueError(f"stream_write: the pool must be contiguous rows of "
                         f"{bytes_per_entry(fmt, entries.shape[1])} bytes")
    entries = _as(entries, torch.float32)
    values = torch.empty_like(entries)
    blocks, offsets = _as(blocks, torch.int64), _as(offsets, torch.int64)
    _load().kv_stream_write(_ptr(entries), entries.shape[0], entries.shape[1],
                            int(f.element != "e2m1"), int(f.scale == "e4m3"), block,
                            _ptr(elem), _ptr(scale), _ptr(pool), pool.shape[1], _ptr(blocks),
                            _ptr(offsets), _ptr(values))
    return values


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """`kvstack.model.model.select_topk` of float32 scores [..., N] with k <= N: the same
    entries, [..., k] int64."""
    scores = scores.contiguous()
    n = scores.shape[-1]
    out = torch.empty(*scores.shape[:-1], k, dtype=torch.int64)
    heap = torch.empty(k, dtype=torch.int64)
    _load().kv_select_topk(_ptr(scores), scores.numel() // n if n else 0, n, k, _ptr(heap),
                           _ptr(out))
    return out


def greedy(logits: torch.Tensor) -> list[int]:
    """Each row's greedy token of float32 logits [B, V] (torch.argmax's: the first index of
    the maximum), -1 for a row holding a NaN or an infinity."""
    logits = _as(logits, torch.float32)
    ids = (ctypes.c_int64 * logits.shape[0])()
    _load().kv_greedy(_ptr(logits), logits.shape[0], logits.shape[1], ids)
    return list(ids)


def candidate_pool(scores: torch.Tensor, positions: torch.Tensor, ratio: int, span: int,
                   k: int) -> torch.Tensor:
    """`kvstack.model.model.candidate_pool` of float32 scores [B, q, N] for queries at
    positions [1 or B, q] of a ratio-`ratio` layer, spans of `span` entries, k <= their
    count: the same spans in the same order, [B, q, k] int64."""
    b, q, n = scores.shape
    n_spans = -(-n // span)
    if not 0 < k <= n_spans or positions.shape[-1] != q or positions.shape[0] not in (1, b):
        raise ValueError(f"candidate_pool: {k} of {n_spans} spans for scores "
                         f"{list(scores.shape)} at positions {list(positions.shape)}")
    scores, positions = _as(scores, torch.float32), _as(positions, torch.int64)
    out = torch.empty(b, q, k, dtype=torch.int64)
    spans, heap = torch.empty(n_spans), torch.empty(k, dtype=torch.int64)
    _load().kv_candidate_pool(_ptr(scores), b, q, n, _ptr(positions), positions.shape[0],
                              ratio, span, k, _ptr(spans), _ptr(heap), _ptr(out))
    return out


def select_in_pool(q: torch.Tensor, w: torch.Tensor, pool: torch.Tensor, fmt: str,
                   block_table: torch.Tensor, held: torch.Tensor, spans: torch.Tensor,
                   span: int, k: int) -> torch.Tensor:
    """`kvstack.model.model.Indexer.select_in_pool` for a decode step from its queries
    q [B, Hi, Di] and head weights w [B, Hi]: each sequence's candidate pool (spans [B, kb]
    of `span` entries each) scored where its index keys lie (pool [blocks, per, bytes] of
    format fmt through block_table; entries at or past held [B] -inf), its best min(k,
    kb * span) entries in ascending order, -1 for none: [B, min(k, kb * span)] int64."""
    b, hi, di = q.shape
    kb = spans.shape[1]
    k = min(k, kb * span)
    block, packed, elem, scale = _decoding(fmt)
    q, w = _as(q, torch.float32), _as(w, torch.float32)
    table, held, spans = (_as(t, torch.int64) for t in (block_table, held, spans))
    pool = pool.contiguous()
    out = torch.empty(b, k, dtype=torch.int64)
    _load().kv_select_in_pool(_ptr(q), _ptr(w), _ptr(pool), pool.shape[1], pool.shape[2],
                              _ptr(table), table.shape[1], _ptr(held), _ptr(spans), kb, span,
                              b, hi, di, block, packed, _ptr(elem), _ptr(scale), k, _ptr(out))
    return out


SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")  # step.c's numbering of the config's


class Router(NamedTuple):
    """A MoE sublayer's routed half, as `moe` and `ffn_block` take it: the router (gate
    [E, dim], bias [E], the config's score function, temperature, k, renormalisation and
    route scale) and the experts (w1, w3 [E, inter, dim], w2 [E, dim, inter]; float32, or
    bf16 with the shared expert's bf16 too). A named tuple: a decode step makes one a
    layer, at a quarter of a frozen dataclass's cost."""

    gate: torch.Tensor
    bias: torch.Tensor
    score_func: str
    gate_temp: float
    k: int
    renormalise: bool
    route_scale: float
    experts: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def moe(x: torch.Tensor, router: Router,
        shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        limit: float) -> torch.Tensor:
    """A MoE sublayer of float32 or bf16 weights for x [T, dim]: the router choosing k experts per
    token, their weighted SwiGLUs added, then the shared expert's (w1, w3 [inter, dim], w2
    [dim, inter]) where there is one: [T, dim], what `MoE.forward` computes, within float
    rounding (ties between equal router scores go to the lower expert)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    args, _held = _ffn_args(x.shape[0], x.shape[1], router, shared, limit)  # alive past the call
    _load().kv_moe(_ptr(x), x.shape[0], x.shape[1], *args, _ptr(out))
    return out


def ffn_block(x: torch.Tensor, hc: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
              norm_eps: float, hc_eps: float, iters: int, collapse_pre: torch.Tensor | None,
              norm: torch.Tensor, router: Router | None,
              shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
              limit: float, keep: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A layer's feed-forward half with its hyper-connection for x [..., h, dim] (h
    residual copies): its mixes (hc: fn, scale, base), the copies collapsed with
    collapse_pre [..., h] or the mixes' own pre (None), RMSNorm (norm), the float MoE
    (router, shared) or, without a router, the dense FFN `shared`, spread back: ([..., h,
    dim], the mixes' pre [..., h]), what `Layer.forward` computes there within float
    rounding. hc None: a layer without hyper-connections, x [..., dim] the residual,
    (x + the feed-forward of RMSNorm(x), None). keep: as `attention_block_in`'s, for the
    weights' addresses and the scratch (both outputs are new tensors)."""
    if hc is None:
        *lead, dim = x.shape
        h = 1
    else:
        *lead, h, dim = x.shape
    n = x.numel() // (h * dim)
    weights = [*(hc or ()), norm, *(() if shared is None else shared)]
    if router is not None:
        weights += [router.gate, router.bias, *router.experts]

    def make() -> tuple[bool, tuple]:
        if (2 + h) * h > 64:
            raise ValueError(f"ffn_block: at most 6 residual copies, got {h}")
        return _ffn_block(n, h, dim, hc, norm_eps, hc_eps, iters, norm, router, shared,
                          limit)

    routing = None if router is None else (router.score_func, router.gate_temp, router.k,
                                           router.renormalise, router.route_scale)
    key = (x.shape, norm_eps, hc_eps, iters, limit, routing, *map(_data_ptr, weights))
    block, _held = _plan(keep, "ffn_block", key, make)
    if collapse_pre is not None and collapse_pre.shape != x.shape[:-1]:
        raise ValueError(f"ffn_block: collapse_pre must be {list(x.shape[:-1])}, got "
                         f"{list(collapse_pre.shape)}")
    x = x.contiguous()
    pre_in = None if collapse_pre is None else collapse_pre.contiguous()
    # Both outputs are new tensors: a chunked prefill keeps a chunk's residual and pre.
    out, pre = torch.empty_like(x), None if hc is None else x.new_empty(*lead, h)
    at = block.slots
    at[0], at[10] = _ptr(x), 0 if pre_in is None else _ptr(pre_in)
    at[32], at[33], at[34] = 0 if pre is None else _ptr(pre), _ptr(out), _threads()
    block()
    return out, pre


def _ffn_block(n: int, h: int, dim: int,
               hc: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, norm_eps: float,
               hc_eps: float, iters: int, norm: torch.Tensor, router: Router | None,
               shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
               limit: float) -> tuple[bool, tuple]:
    """A kv_ffn_block call's plan for n tokens of h copies (`ffn_block`'s): (whether it
    may be kept, (its block, what the block points into)). Kept only where no matrix was
    converted (a copy hides in-place updates)."""
    args, held = _ffn_args(n, dim, router, shared, limit)
    matrices = (*(shared or ()), *(() if router is None else router.experts))
    weights = [*(hc or ()), norm, *matrices,
               *(() if router is None else (router.gate, router.bias))]
    stored = _matrix_dtype(*matrices)
    same = (all(t.is_contiguous() for t in weights)
            and all(m.dtype is stored for m in matrices))
    mixing = (0, 0, 0) if hc is None else tuple(_ptr(t.contiguous()) for t in hc)
    norm_c = norm.contiguous()
    # x, collapse_pre, pre, out and the threads (slots 0, 10, 32-34) are set each call.
    block = ArgBlock("kv_ffn_block", (0, n, h, dim, *mixing, norm_eps, hc_eps, iters, 0,
                                      _ptr(norm_c), *args, 0, 0, 0))
    return same, (block, (held, norm_c, hc))


def _ffn_args(n: int, dim: int, router: Router | None,
              shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
              limit: float) -> tuple[list, list[torch.Tensor]]:
    """kv_moe's arguments after x, n and dim, up to its output (router None: a dense FFN,
    kv_ffn_block's), and the tensors they point into, to be held until the call returns.
    The experts' and shared expert's matrices go as stored where all are bf16, else as
    float32."""
    matrices = [*(shared or ()), *(router.experts if router is not None else ())]
    stored = _matrix_dtype(*matrices)
    s1, s2, s3 = (None, None, None) if shared is None else (_as(w, stored) for w in shared)
    shared_inter = 0 if s1 is None else s1.shape[0]
    if router is None:
        if s1 is None:
            raise ValueError("ffn_block: a dense FFN needs its weights (shared)")
        w1 = w2 = w3 = gate = bias = None
        n_experts = k = inter = 0
        scratch = torch.empty(n * shared_inter)
        ints = torch.empty(n, dtype=torch.int64)
    else:
        if router.k < 1:
            raise ValueError("moe: a token routes to at least one expert")
        w1, w2, w3 = (_as(w, stored) for w in router.experts)
        gate, bias = router.gate.contiguous(), router.bias.contiguous()
        n_experts, k, inter = gate.shape[0], router.k, w1.shape[1]
        pairs = n * k
        scratch = torch.empty(2 * n_experts + 2 * pairs
                              + pairs * (max(inter, shared_inter) + 2 * dim))
        ints = torch.empty(3 * pairs, dtype=torch.int64)
    keep = [t for t in (gate, bias, w1, w2, w3, s1, s2, s3, scratch, ints) if t is not None]

    def ptr(t: torch.Tensor | None) -> int:
        return 0 if t is None else _ptr(t)

    args = [ptr(gate), ptr(bias), n_experts,
            SCORE_FUNCS.index(router.score_func) if router else 0,
            router.gate_temp if router else 1.0, k, int(router.renormalise) if router else 0,
            router.route_scale if router else 1.0, ptr(w1), ptr(w2), ptr(w3), inter, ptr(s1),
            ptr(s2), ptr(s3), shared_inter, limit, int(stored is torch.bfloat16), _ptr(scratch),
            _ptr(ints)]
    return args, keep
