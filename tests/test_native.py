"""The C kernels (kvstack.native) against the torch ops they stand in for."""

import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from kvstack import LLM, SamplingParams, native
from kvstack.cache.batch import _scores
from kvstack.cache.rows import _rows_at
from kvstack.config import preset
from kvstack.engine.config import EngineConfig
from kvstack.formats import dequantize, pack_rows, quantize, unpack_rows
from kvstack.model.model import grouped_mm_by_group

pytestmark = pytest.mark.skipif(not native.resolve("auto"), reason="no C compiler here")


@pytest.mark.parametrize(("fmt", "width"), [("fp4_e4m3_16", 64), ("fp4_ue8m0_32", 64),
                                             ("fp8_ue8m0_32", 96)])
def test_read_rows_equal_the_codecs_bit_for_bit(fmt, width):
    """Every code and scale byte, NaN scales included: the same float32 bits."""
    g = torch.Generator().manual_seed(0)
    values = torch.randn(300, width, generator=g) * torch.rand(300, 1, generator=g) * 50
    rows = pack_rows(quantize(values, fmt))
    rows = torch.cat([rows, torch.randint(0, 256, (256, rows.shape[1]), generator=g,
                                          dtype=torch.uint8)])  # any byte, NaN scales too
    index = torch.randint(0, rows.shape[0], (5, 70), generator=g)
    got = native.read_rows(rows, index, fmt, width)
    want = dequantize(unpack_rows(_rows_at(rows, index), fmt, width))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("ratio, heads, short", [(1, 4, 0), (2, 4, 0), (4, 4, 0), (1, 12, 3),
                                                  (2, 1, 5)])
def test_index_scores_equal_dequantise_then_score(ratio, heads, short):
    """Through a block table with the null block, at positions whose last group is
    incomplete, eight keys a pass and the `short` entries past the last whole eight one
    at a time: the same -inf entries, a NaN scale's NaN score, the scores within float
    rounding."""
    g = torch.Generator().manual_seed(ratio)
    fmt, b, width, per, blocks = "fp4_ue8m0_32", 3, 64, 16, 24
    pool = pack_rows(quantize(torch.randn(blocks * per, width, generator=g), fmt))
    pool = pool.view(blocks, per, -1).clone()
    pool[0] = 0  # the null block
    table = torch.randint(2, blocks, (b, 8), generator=g)
    table[0, 4:] = 0
    table[2, 0] = 1
    pool[1, 3, width // 2] = 0xFF  # a NaN scale (E8M0): sequence 2's entry 3
    positions = torch.tensor([6, 70, 127])
    q, w = torch.randn(b, heads, width, generator=g), torch.randn(b, heads, generator=g)
    n = 128 // ratio - short
    got = native.index_scores(q, w, pool, table, positions, n, ratio, fmt)
    want = _scores(q, w, pool, table, positions, n, ratio, fmt, width)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(got[2, 3])
    assert torch.isinf(want).any() and torch.isfinite(want).any()
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)


def test_grouped_mm_equals_a_matmul_per_group():
    """Empty groups, odd group sizes, experts' [N, K] weights and a contiguous [K, N]."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 64, generator=g)
    w = torch.randn(6, 32, 64, generator=g).transpose(1, 2)  # [G, K, N], stored [N, K]
    ends = torch.tensor([3, 3, 10, 21, 30, 37], dtype=torch.int32)
    for weights in (w, w.contiguous()):
        got = native.grouped_mm(x, weights, ends)
        assert torch.allclose(got, grouped_mm_by_group(x, weights, ends), atol=1e-5)


def test_the_engine_decodes_the_same_tokens_with_the_c_kernels_as_with_torch():
    config = preset("tiny")
    prompts = [[5, 9, 2, 7] * 20, [3, 1] * 33]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = {}
    for choice in ("c", "torch"):
        llm = LLM(config, random_init=True, kv_budget="4MiB", max_num_seqs=2,
                  cpu_kernels=choice)
        assert llm.memory_report()["backend"]["cpu_kernels"] == choice
        outputs[choice] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs["c"] == outputs["torch"]


def test_a_required_c_kernel_that_cannot_build_is_an_error_naming_why(monkeypatch):
    with pytest.raises(ValueError, match="cpu_kernels must be one of auto, c, torch"):
        EngineConfig(cpu_kernels="fast")
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_why_not", None)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(native.NativeUnavailable, match="/nonexistent/cc"):
        native.resolve("c")
    assert native.resolve("auto") is False  # the same reason, logged, and torch runs


def test_the_library_is_built_and_loaded_only_from_a_folder_this_user_owns(tmp_path,
                                                                           monkeypatch):
    """The per-user cache folder is made 0700; one that is a symlink, writable by others or
    another user's is passed over, and a library planted there under the expected name is
    never loaded: the build goes to a fresh private temporary folder instead."""
    # Built unoptimised: which folder a build goes to does not depend on the flags, and
    # the four builds below at -O3 take half a minute.
    monkeypatch.setattr(native, "FLAGS", tuple("-O0" if f == "-O3" else f
                                               for f in native.FLAGS))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    built = native._build()
    folder = tmp_path / "home" / "kvstack" / "native"
    assert built.parent == folder and stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert native._build() == built  # found, not rebuilt

    def plant(home: str) -> Path:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / home))
        planted = tmp_path / home / "kvstack" / "native" / built.name
        planted.parent.mkdir(parents=True, exist_ok=True)
        planted.write_bytes(b"not the kernels")
        return planted

    cases = {"open": lambda p: p.parent.chmod(0o777)}
    if os.getuid() == 0:  # only root can hand a folder to another user
        cases["foreign"] = lambda p: os.chown(p.parent, 65534, 65534)
    for home, spoil in cases.items():
        planted = plant(home)
        spoil(planted)
        got = native._build()
        assert got.parent != planted.parent and got.read_bytes() == built.read_bytes()
        assert stat.S_IMODE(got.parent.stat().st_mode) == 0o700
        shutil.rmtree(got.parent)
    # A symlink where the folder should be is passed over too.
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "linked" / "kvstack").mkdir(parents=True)
    (tmp_path / "linked" / "kvstack" / "native").symlink_to(target)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "linked"))
    got = native._build()
    assert got.parent not in (target, tmp_path / "linked" / "kvstack" / "native")
    shutil.rmtree(got.parent)
