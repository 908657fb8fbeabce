"""Tensor and expert parallelism: a model split over two gloo processes computes what the
whole model computes, and the engine over two ranks serves what one serves."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvstack import LLM, SamplingParams
from kvstack.cache.contiguous import ContiguousCache
from kvstack.config import preset
from kvstack.engine.core import EngineError
from kvstack.model import Model
from kvstack.model.packed import PackedExperts, PackedLinear
from kvstack.model.params import parameter_shapes
from kvstack.parallel.plan import ShardingPlan
from kvstack.parallel.shard import TorchShard, init_group, shard_model
from tests.v41_checkpoint import write_v41_checkpoint

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, fn_name: str, port: int, out: str, args: tuple) -> None:
    torch.set_num_threads(1)
    init_group(rank, WORLD, "127.0.0.1", port, torch.device("cpu"), TIMEOUT_S)
    try:
        result = globals()[fn_name](rank, *args)
        torch.save(result, f"{out}.{rank}")
    except BaseException:
        Path(f"{out}.{rank}.error").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(fn_name: str, tmp_path: Path, *args: object) -> list:
    """fn_name(rank, *args) on WORLD gloo processes; their results, by rank."""
    out = str(tmp_path / fn_name)
    try:
        mp.start_processes(_rank_main, args=(fn_name, free_port(), out, args), nprocs=WORLD,
                           start_method="spawn")
    except Exception:
        errors = [Path(f"{out}.{r}.error") for r in range(WORLD)]
        raise AssertionError("\n".join(e.read_text() for e in errors if e.exists())) from None
    return [torch.load(f"{out}.{r}") for r in range(WORLD)]


def _greedy(model: Model, ids: torch.Tensor, n: int) -> tuple[list[int], torch.Tensor]:
    cache = ContiguousCache(model.config, batch_size=1, max_tokens=ids.shape[1] + n + 1)
    logits = model.prefill(ids, cache)
    tokens, all_logits = [], [logits]
    for _ in range(n):
        tokens.append(int(logits.argmax(-1)))
        logits = model.decode([tokens[-1]], cache)
        all_logits.append(logits)
    return tokens, torch.cat(all_logits)


def split_forward(rank: int, name: str, expert_parallel: bool) -> dict:
    torch.manual_seed(0)
    model = Model(preset(name)).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator()
                        .manual_seed(1))
    whole_tokens, whole_logits = _greedy(model, ids, 12)
    with torch.no_grad():
        whole_forward = model(ids).logits
    plan = ShardingPlan(model.config, WORLD, expert_parallel)
    shard_model(model, plan, TorchShard())
    tokens, logits = _greedy(model, ids, 12)
    with torch.no_grad():
        forward = model(ids).logits
    held = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    return dict(whole_tokens=whole_tokens, whole_logits=whole_logits, tokens=tokens,
                logits=logits, whole_forward=whole_forward, forward=forward, held=held)


SPLITS = [("tiny-v41", False), ("tiny-v41", True), ("tiny", True)]


def split_all(rank: int) -> dict:
    """Every split case in one pair of processes (each start imports torch anew)."""
    return {"models": [split_forward(rank, *case) for case in SPLITS],
            "experts": split_experts(rank)}


@pytest.fixture(scope="module")
def splits(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks("split_all", tmp_path_factory.mktemp("splits"))


@pytest.mark.parametrize("case", range(len(SPLITS)), ids=[f"{n}-ep{e}" for n, e in SPLITS])
def test_a_model_split_over_two_ranks_computes_what_the_whole_model_does(
        splits: list[dict], case: int) -> None:
    name, expert_parallel = SPLITS[case]
    results = [r["models"][case] for r in splits]
    for r in results:
        assert (r["forward"] - r["whole_forward"]).abs().max() < 1e-4
        assert (r["logits"] - r["whole_logits"]).abs().max() < 1e-3
        # Greedy tokens agree where the whole model's choice is not a near tie.
        top2 = r["whole_logits"][:-1].topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-3
        for t, (a, b) in enumerate(zip(r["tokens"], r["whole_tokens"], strict=True)):
            if clear[: t + 1].all():
                assert a == b
    # Every rank ends with the same logits (the collectives hand out the same bytes).
    assert torch.equal(results[0]["logits"], results[1]["logits"])
    # What the ranks hold adds up to the whole model, the replicated parts once per rank.
    config = preset(name)
    plan = ShardingPlan(config, WORLD, expert_parallel)
    for n, shape in parameter_shapes(config).items():
        split = plan.split(n, shape)
        held = [r["held"][n] for r in results]
        if split is None:
            assert held == [shape] * WORLD
        else:
            total = sum(h[split.dim] for h in held)
            assert total == (split.piece * WORLD if n in ("embed.weight", "head.weight")
                             else shape[split.dim])


def split_experts(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = Model(preset("tiny-v41")).eval()
    moe = model.layers[0].ffn
    inputs = [torch.randn(1, t, model.config.dim, generator=torch.Generator().manual_seed(t))
              for t in (1, 6)]

    def outputs() -> list[torch.Tensor]:
        with torch.no_grad():  # the gathered and the grouped paths
            out = [moe(x) for x in inputs]
        return [*out, moe(inputs[1]).detach()]  # with autograd: each expert on its tokens

    whole = outputs()
    shard_model(model, ShardingPlan(model.config, WORLD, expert_parallel=True), TorchShard())
    assert moe.experts.w1.shape[0] == 2 and moe.first_expert == 2 * rank
    return list(zip(whole, outputs(), strict=True))


def test_experts_split_by_rank_sum_to_the_whole_layer(splits: list[dict]) -> None:
    for r in splits:
        for whole, split in r["experts"]:
            assert (whole - split).abs().max() < 1e-5


def test_a_plan_refuses_a_split_that_does_not_divide() -> None:
    with pytest.raises(ValueError, match="does not divide n_heads"):
        ShardingPlan(preset("tiny"), 3)
    with pytest.raises(ValueError, match="dense control"):
        ShardingPlan(preset("dense-tiny"), 2)


def expected_rank_bytes(model: Model, expert_parallel: bool) -> int:
    """The weight bytes of WORLD ranks together: every split tensor once (vocabulary rows
    padded to one length per rank), every replicated one WORLD times."""
    plan = ShardingPlan(model.config, WORLD, expert_parallel)
    packed = {path: m for path, m in model.named_modules()
              if isinstance(m, PackedLinear | PackedExperts)}
    total = 0
    for name, t in model.state_dict().items():
        size = t.numel() * t.element_size()
        path = name.rpartition(".")[0]
        if isinstance(packed.get(path), PackedLinear):  # stored codes and scales
            m = packed[path]
            name = "head.weight" if path == "head" else f"{path}.weight"
            split = plan.split(name, (m.out_features, m.in_features))
            if split is not None and name == "head.weight":
                total += WORLD * split.piece * size // t.shape[0]
                continue
        elif isinstance(packed.get(path.rpartition(".")[0]), PackedExperts):
            total += size  # every expert split or held once
            continue
        split = plan.split(name, tuple(t.shape))
        if split is None:
            total += WORLD * size
        elif name in ("embed.weight", "head.weight"):
            total += WORLD * split.piece * size // t.shape[0]
        else:
            total += size
    return total


GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPTS = [list(range(5, 60)), list(range(100, 121)), [7] * 30]


def tp_llm(tmp_path: Path, size: int, **kwargs: object) -> LLM:
    settings = {"kv_budget": "4MiB", "block_tokens": 8, "threads": 1, "cache_dir": tmp_path,
                "parallel_timeout_s": 60.0} | kwargs
    return LLM("tiny-v41", random_init=True, seed=0, tensor_parallel_size=size, **settings)


def test_an_engine_over_two_ranks_serves_what_one_serves(tmp_path: Path) -> None:
    one = tp_llm(tmp_path, 1)
    expected = [o.token_ids for o in one.generate(PROMPTS, GREEDY)]
    session = one.session("s")
    session.append(list(range(3, 50)))
    first_turn = session.generate(GREEDY).token_ids
    session.save()
    with tp_llm(tmp_path, 2, expert_parallel=True) as two:
        assert [o.token_ids for o in two.generate(PROMPTS, GREEDY)] == expected
        # A session saved in one process, resumed over two ranks: its blocks go into every
        # rank's pools, and its next turn is what one process makes of it.
        resumed_here = two.resume("s")
        resumed_here.append([5, 6, 7])
        next_turn = resumed_here.generate(GREEDY).token_ids
        # A prefix hit: the second rank's pools hold the same rows as rank 0's.
        again = two.generate(PROMPTS[0], GREEDY)[0]
        assert again.num_cached_tokens > 0 and again.token_ids == expected[0]
        # Another: every rank copies the window checkpoint its own replay left.
        restored = two.memory_report()["window_checkpoints"]["restored"]
        assert two.generate(PROMPTS[0], GREEDY)[0].token_ids == expected[0]
        assert two.memory_report()["window_checkpoints"]["restored"] == restored + 1
        # A session saved under two ranks resumes in one process and goes on the same.
        saved = two.session("tp")
        saved.append(list(range(3, 50)))
        assert saved.generate(GREEDY).token_ids == first_turn
        saved.save()
        report = two.memory_report()["parallel"]
    assert report["tensor_parallel_size"] == 2 and report["experts_per_rank"] == 2
    ranks = report["ranks"]
    assert ranks[0]["cache_bytes"] == ranks[1]["cache_bytes"]  # every token's whole record
    assert sum(r["weight_bytes"] for r in ranks) == report["weight_bytes_total"]
    assert report["weight_bytes_total"] == expected_rank_bytes(one.model, True)
    session.append([5, 6, 7])
    assert session.generate(GREEDY).token_ids == next_turn
    resumed = one.resume("tp")
    resumed.append([9, 9, 9])
    fresh = one.session("fresh")
    fresh.append(list(range(3, 50)))
    assert fresh.generate(GREEDY).token_ids == first_turn
    fresh.append([9, 9, 9])
    assert resumed.generate(GREEDY).token_ids == fresh.generate(GREEDY).token_ids


def test_a_killed_rank_fails_the_engine_within_the_timeout(tmp_path: Path) -> None:
    llm = tp_llm(tmp_path, 2, parallel_timeout_s=20.0)
    try:
        with pytest.raises(ValueError, match="one sharded engine per process"):
            tp_llm(tmp_path, 2)
        llm.generate(PROMPTS[1], GREEDY)
        worker = llm.runner.workers[0]
        request = llm.add_request(PROMPTS[0], GREEDY, watch=True)
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=10)
        with pytest.raises(EngineError, match=r"rank 1 .* exited"):
            while not llm.wait(request).finished:
                pass
        out = llm.core.router.take(request)
        assert out is not None and out.finish_reason == "error"
        with pytest.raises(EngineError):
            llm.add_request(PROMPTS[1], GREEDY)
    finally:
        llm.close()


def test_a_hung_rank_fails_the_engine_after_the_timeout(tmp_path: Path) -> None:
    llm = tp_llm(tmp_path, 2, parallel_timeout_s=5.0)
    worker = llm.runner.workers[0]
    try:
        llm.generate(PROMPTS[1], GREEDY)
        os.kill(worker.pid, signal.SIGSTOP)  # alive, answering nothing
        with pytest.raises(EngineError, match="did not answer within 5 s"):
            llm.generate(PROMPTS[0], GREEDY)
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        llm.close()


def test_a_sharded_engine_refuses_what_it_cannot_run(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not divide n_heads"):
        tp_llm(tmp_path, 3)
    with pytest.raises(ValueError, match="compile_decode"):
        tp_llm(tmp_path, 2, compile_decode=True)


def _tokens(llm: LLM, prompts: list, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


def test_the_bundled_checkpoint_read_slice_by_slice_serves_what_it_serves_whole(
        tmp_path: Path) -> None:
    prompt = "def read_config(path):\n    with open(path) as f:\n"
    settings = {"kv_budget": "16MiB", "threads": 1, "cache_dir": tmp_path}
    expected = _tokens(LLM("default", **settings), [prompt])
    with LLM("default", tensor_parallel_size=2, **settings) as two:
        assert _tokens(two, [prompt]) == expected


def test_a_deepseek_checkpoint_split_over_two_ranks_serves_what_one_serves(
        tmp_path: Path) -> None:
    # Experts 64 wide: a rank's half of each falls on the 32-wide blocks of its scales.
    directory = tmp_path / "v41"
    write_v41_checkpoint(directory, preset("tiny-v41").replace(moe_inter_dim=64), seed=1)
    settings = {"kv_budget": "4MiB", "block_tokens": 8, "threads": 1, "cache_dir": tmp_path}
    one = LLM(directory, **settings)
    expected = _tokens(one, PROMPTS[:2])
    for expert_parallel in (False, True):
        with LLM(directory, tensor_parallel_size=2, expert_parallel=expert_parallel,
                 **settings) as two:
            assert _tokens(two, PROMPTS[:2]) == expected
            # Each rank read only its slices of the packed tensors (and its own experts).
            parallel = two.memory_report()["parallel"]
            assert parallel["weight_bytes_total"] == expected_rank_bytes(one.model,
                                                                         expert_parallel)


def test_torchrun_ranks_serve_what_one_process_serves(tmp_path: Path) -> None:
    args = ["generate", "--model", "tiny-v41", "--random-init", "--prompt", "def f(x):",
            "--temperature", "0", "--max-tokens", "8", "--ignore-eos", "--json",
            "--kv-budget", "4MiB", "--threads", "1", "--cache-dir", str(tmp_path)]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", "-m", "kvstack.cli", *args,
                           "--tensor-parallel-size", "2"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    one = LLM("tiny-v41", random_init=True, kv_budget="4MiB", threads=1, cache_dir=tmp_path)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert out["token_ids"] == one.generate("def f(x):", params)[0].token_ids
    assert out["memory"]["parallel"]["tensor_parallel_size"] == 2


def test_an_idle_engine_over_two_ranks_outlives_its_timeout(tmp_path: Path) -> None:
    llm = tp_llm(tmp_path, 2, parallel_timeout_s=3.0)
    try:
        first = _tokens(llm, PROMPTS[:1])
        time.sleep(3 * 3.0 + 1)  # idle for three timeouts
        assert llm.core.failure is None
        assert _tokens(llm, PROMPTS[:1]) == first
        worker = llm.runner.workers[0]
        os.kill(worker.pid, signal.SIGKILL)  # dies while nothing runs
        deadline = time.time() + 30
        while llm.core.failure is None and time.time() < deadline:
            time.sleep(0.2)
        assert "rank 1" in llm.core.failure  # found by the heartbeat, before any request
        with pytest.raises(EngineError, match="rank 1"):
            llm.add_request(PROMPTS[1], GREEDY)
    finally:
        llm.close()


def test_pictures_over_two_ranks_give_what_one_process_gives(tmp_path: Path) -> None:
    """A prompt with a picture on a model split over two ranks: every rank encodes the
    picture with its whole tower and the tokens are one process's; a prefix hit on its
    blocks (replayed over the picture's segment on every rank) too."""
    import io

    from PIL import Image

    g = torch.Generator().manual_seed(5)
    pixels = torch.randint(0, 256, (70, 100, 3), generator=g, dtype=torch.uint8)
    picture = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(picture, format="PNG")
    prompt = {"prompt_token_ids": list(range(3, 20)),
              "multi_modal_data": {"image": picture.getvalue()}}
    settings = {"kv_budget": "4MiB", "block_tokens": 8, "threads": 1,
                "parallel_timeout_s": 60.0, "random_init": True, "seed": 0}
    one = LLM("tiny-v41-vision", cache_dir=tmp_path / "one", **settings)
    expected = [one.generate(prompt, GREEDY)[0] for _ in range(2)]  # cold, then a hit
    with LLM("tiny-v41-vision", tensor_parallel_size=2, expert_parallel=True,
             cache_dir=tmp_path / "two", **settings) as two:
        outs = [two.generate(prompt, GREEDY)[0] for _ in range(2)]
    assert outs[1].num_cached_tokens == expected[1].num_cached_tokens > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
