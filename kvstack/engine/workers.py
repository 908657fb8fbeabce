"""Tensor-parallel execution: rank 0's runner and the worker ranks it drives in lockstep.

Rank 0, the process of the `LLM`, keeps everything that decides: the scheduler, the
block tables, the prefix cache and its tiers, sessions. Every rank holds its shard of the
weights (`kvstack.parallel`) and its own copy of the cache pools, of one geometry: V4.1's
heads all read one KV vector per token, so each rank keeps every token's whole record.
Before each model call rank 0 broadcasts a `Call` -- the stores it runs (their block
tables, new token ids, stream lengths), their tokens, and the blocks and ring slots
changed outside model calls since the last one -- and every rank runs the same call: its
collectives keep the ranks in step, and its writes land in the same rows of every copy.

Workers are spawned by the LLM (one machine), or started by torchrun on every machine
(`kvstack serve` on ranks above 0 runs `serve_worker`). A worker that dies or stops
answering fails rank 0's next collective within `parallel_timeout_s`: the engine then
stops with a `WorkerLost`, naming the rank. Idleness is not a failure: the workers wait
for the next call with the group's timeout, so while no call runs rank 0 sends an empty
one every quarter of it (a heartbeat, which also finds a rank that died meanwhile: the
engine then reports itself failed before the next request arrives).
"""

import logging
import multiprocessing
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kvstack.cache.paged import PagedCache, PagedSequenceStore, StoreState
from kvstack.config import ModelConfig, preset
from kvstack.engine.config import EngineConfig
from kvstack.engine.core import EngineError
from kvstack.engine.runner import ModelRunner
from kvstack.engine.tokenizer import Tokenizer
from kvstack.model import Model
from kvstack.model.vision import ImageSegment
from kvstack.parallel.plan import ShardingPlan
from kvstack.parallel.shard import (
    TorchShard,
    init_group,
    load_shard,
    load_v41_shard,
    shard_model,
)

log = logging.getLogger("kvstack")


class WorkerLost(EngineError):
    """A rank died, or did not answer within the timeout: the group cannot go on."""


@dataclass
class Call:
    """One model call, as rank 0 hands it to every rank."""

    kind: str  # "prefill" | "decode" | "idle" (a heartbeat) | "stop"
    states: list[StoreState] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # prefill: the new ids; decode: one each
    blocks: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # written outside
    dropped: list[slice] = field(default_factory=list)  # ring slots emptied outside
    images: list[ImageSegment] = field(default_factory=list)  # prefill: its pictures


@dataclass(frozen=True)
class ModelSource:
    """What every rank loads: a model directory, or a preset / config with seeded random
    weights."""

    model: str | Path | ModelConfig
    random_init: bool
    seed: int


PlanOf = Callable[[ModelConfig], ShardingPlan]


def load_sharded(source: ModelSource, plan_of: PlanOf, shard: TorchShard,
                 device: torch.device, numerics: str) -> tuple[Model, str]:
    """This rank's shard of the model, and the whole model's fingerprint (what it would
    be in one process, so that caches and sessions are shared with unsharded engines).
    A checkpoint (kvstack's or DeepSeek's) is read slice by slice, only what the rank
    holds; random weights are made whole (seeded alike on every rank) and then cut."""
    from kvstack.engine.loading import bundled_model, load_model
    from kvstack.model.checkpoint import is_v41_checkpoint

    if not source.random_init:
        directory = bundled_model() if str(source.model) == "default" else Path(source.model)
        plan = plan_of(ModelConfig.from_json(directory / "config.json"))
        read = load_v41_shard if is_v41_checkpoint(directory) else load_shard
        model = read(directory, plan, shard)
        model.set_numerics(numerics)
        return model.to(device).eval(), model.fingerprint()
    # float32: a model split over ranks holds float32 matrices (EngineConfig.dtype).
    model, _ = load_model(source.model, source.random_init, source.seed, torch.device("cpu"),
                          numerics, "float32")
    fingerprint = model.fingerprint()
    shard_model(model, plan_of(model.config), shard)
    return model.to(device).eval(), fingerprint


def weight_bytes(model: Model) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


class ParallelRunner(ModelRunner):
    """Rank 0's runner: each call goes to every rank first, then runs here."""

    def __init__(self, model: Model, config: EngineConfig, cache: PagedCache,
                 workers: list[multiprocessing.Process]) -> None:
        super().__init__(model, config)
        self.cache, self.workers = cache, workers
        self.lost: str | None = None
        cache.pools.journal, cache.rings.journal = [], []
        # Tokens each store's mirrors already hold (a store seen first sends them all).
        self._sent: weakref.WeakKeyDictionary[PagedSequenceStore, int] = (
            weakref.WeakKeyDictionary())
        # One collective sequence at a time: a call (its broadcast and the model's own
        # collectives) or a heartbeat, never interleaved.
        self._group_lock = threading.Lock()
        self._last_call = time.monotonic()
        self._closing = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="kvstack-heartbeat",
                                           daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        interval = self.config.parallel_timeout_s / 4
        while not self._closing.wait(interval / 2):
            with self._group_lock:
                if self.lost is not None or self._closing.is_set():
                    return
                if time.monotonic() - self._last_call < interval:
                    continue
                try:
                    broadcast_call(Call("idle"))
                except Exception as e:
                    self.lost = self._why(e)
                    log.error("kvstack engine stopped: %s", self.lost)
                    return
                self._last_call = time.monotonic()

    def prefill_store(self, store: PagedSequenceStore, fresh: list[int],
                      final: bool = True, images: list[ImageSegment] | None = None
                      ) -> torch.Tensor | None:
        # Every rank encodes the pictures itself (the tower is whole on each).
        return self._run("prefill" if final else "prefill_part", [store], list(fresh),
                         lambda: super(ParallelRunner, self).prefill_store(store, fresh, final,
                                                                           images),
                         images)

    def decode_logits(self, stores: list[PagedSequenceStore], tokens: list[int]) -> torch.Tensor:
        return self._run("decode", stores, list(tokens),
                         lambda: super(ParallelRunner, self).decode_logits(stores, tokens))

    def _run(self, kind: str, stores: list[PagedSequenceStore], tokens: list[int],
             local: Callable[[], torch.Tensor | None],
             images: list[ImageSegment] | None = None) -> torch.Tensor | None:
        if self.lost is not None:
            raise WorkerLost(self.lost)
        pools, rings = self.cache.pools, self.cache.rings
        call = Call(kind, [s.state(self._sent.get(s, 0)) for s in stores], tokens,
                    pools.journal, rings.journal, list(images or []))
        # The model's own writes happen on every rank alike: not journalled.
        pools.journal = rings.journal = None
        try:
            with self._group_lock:
                if self.lost is not None:  # found by the heartbeat meanwhile
                    raise WorkerLost(self.lost)
                broadcast_call(call)
                out = local()
                self._last_call = time.monotonic()
            for s in stores:  # the call added the same tokens to every mirror
                self._sent[s] = s.num_tokens
            return out
        except WorkerLost:
            raise
        except Exception as e:
            self.lost = self._why(e)
            raise WorkerLost(self.lost) from e
        finally:
            pools.journal, rings.journal = [], []

    def _why(self, error: Exception) -> str:
        return (f"tensor-parallel step failed: {lost_ranks(self.workers, self.config, error)}"
                "; the engine cannot go on, start it again")

    def gather_report(self) -> list[dict[str, int]]:
        """Every rank's weight and cache bytes as allocated, for memory_report (once, at
        start-up)."""
        try:
            with self._group_lock:
                return gather_report(self.model, self.cache)
        except Exception as e:
            self.lost = self._why(e)
            self.stop()
            raise WorkerLost(self.lost) from e

    def stop(self) -> None:
        """Tell the workers to exit, and wait for them."""
        self._closing.set()
        with self._group_lock:
            if self.lost is None:
                try:
                    broadcast_call(Call("stop"))
                except Exception as e:  # already gone: nothing to tell
                    log.warning("kvstack: stopping workers: %s", e)
        self._heartbeat.join()
        for p in self.workers:
            p.join(timeout=self.config.parallel_timeout_s)
            if p.is_alive():
                p.kill()
        dist.destroy_process_group()


def start_rank_zero(model: str | Path | ModelConfig, random_init: bool, seed: int,
                    config: EngineConfig,
                    ) -> tuple[Model, Tokenizer, str, list[multiprocessing.Process]]:
    """Rank 0 of a sharded model (the LLM's process): the other ranks spawned on this
    machine (or started by torchrun), the group joined, this rank's shard loaded. Returns
    the shard, the tokenizer, the whole model's fingerprint and the worker processes."""
    from kvstack.engine.loading import bundled_model, check_vocab, load_tokenizer

    if dist.is_initialized():
        raise ValueError("this process already belongs to a torch.distributed group (another "
                         "sharded LLM, or training): one sharded engine per process")
    # A bad path or a split that does not divide fails before anything starts.
    tokenizer = load_tokenizer(model, random_init)
    if isinstance(model, ModelConfig):
        model_config = model
    elif random_init:
        model_config = preset(str(model))
    else:
        model_config = ModelConfig.from_json(
            (bundled_model() if str(model) == "default" else Path(model)) / "config.json")
    plan_for(config)(model_config)
    source = ModelSource(model, random_init, seed)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun started every rank (any machines)
        workers, address, port = [], None, None
    else:
        workers, port = spawn_workers(config.tensor_parallel_size, source, config)
        address = "127.0.0.1"
    device = rank_device(config, 0)
    try:
        init_group(0, config.tensor_parallel_size, address, port, device,
                   config.parallel_timeout_s)
        loaded, fingerprint = load_sharded(source, plan_for(config), TorchShard(), device,
                                           config.numerics)
        check_vocab(loaded, tokenizer, model)
    except BaseException as e:
        for p in workers:
            p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        if isinstance(e, ValueError):
            raise
        raise WorkerLost(f"the ranks did not start: {lost_ranks(workers, config, e)}") from e
    log.info("kvstack: %d ranks, %s", config.tensor_parallel_size,
             ", ".join(f"{k} {v}" for k, v in plan_for(config)(loaded.config).describe().items()
                       if k.endswith("per_rank") and not isinstance(v, str)))
    return loaded, tokenizer, fingerprint, workers


def lost_ranks(workers: list[multiprocessing.Process], config: EngineConfig,
               error: BaseException) -> str:
    """Which ranks are gone (their exit codes), or that one did not answer in time."""
    gone = [f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
            for rank, p in enumerate(workers, start=1) if p.exitcode is not None]
    what = "; ".join(gone) if gone else (
        f"a rank did not answer within {config.parallel_timeout_s:g} s, or failed its part")
    return f"{what} ({type(error).__name__}: {error})"


def broadcast_call(call: Call | None) -> Call:
    box = [call]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_workers(world_size: int, source: ModelSource,
                  config: EngineConfig) -> tuple[list[multiprocessing.Process], int]:
    """Ranks 1..world_size-1 as processes on this machine; they wait for rank 0 at the
    returned port."""
    port = free_port()
    context = multiprocessing.get_context("spawn")
    workers = []
    for rank in range(1, world_size):
        p = context.Process(target=serve_worker, args=(rank, world_size, "127.0.0.1", port,
                                                       source, config), daemon=True,
                            name=f"kvstack-rank-{rank}")
        p.start()
        workers.append(p)
    return workers, port


def plan_for(config: EngineConfig) -> PlanOf:
    return lambda model_config: ShardingPlan(model_config, config.tensor_parallel_size,
                                             config.expert_parallel)


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """cuda:<local rank> on GPUs (one device per rank), else the CPU."""
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    return device


def gather_report(model: Model, cache: PagedCache) -> list[dict[str, int]]:
    """Every rank's weight and cache bytes as allocated, for rank 0's memory_report."""
    mine = {"weight_bytes": weight_bytes(model),
            "cache_bytes": cache.pools.nbytes + cache.rings.nbytes + cache.partials.nbytes}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def serve_worker(rank: int, world_size: int, address: str | None, port: int | None,
                 source: ModelSource, config: EngineConfig) -> None:
    """A worker rank: load this rank's shard, keep a copy of the pools, and run every
    call rank 0 broadcasts until it says stop. address None: torchrun's rendezvous."""
    config.apply_threads()
    device = rank_device(config, rank)
    init_group(rank, world_size, address, port, device, config.parallel_timeout_s)
    try:
        model, _ = load_sharded(source, plan_for(config), TorchShard(), device,
                                config.numerics)
        cache = PagedCache(model.config, config.kv_budget, config.block_tokens,
                           config.max_num_seqs, device,
                           window_checkpoints=config.kept_window_checkpoints)
        runner = ModelRunner(model, config)
        gather_report(model, cache)
        mirrors: dict[int, PagedSequenceStore] = {}
        while (call := broadcast_call(None)).kind != "stop":
            if call.kind == "idle":
                continue
            for slots in call.dropped:
                cache.rings.drop(slots)
            for block, payload in call.blocks:
                cache.pools.write_block(block, payload)
            stores = []
            for state in call.states:
                if state.slot not in mirrors:
                    mirrors[state.slot] = PagedSequenceStore(
                        model.config, cache.pools, cache.manager, cache.rings, cache.partials,
                        state.slot, model.config.max_seq_len, cache.checkpoints)
                mirrors[state.slot].follow(state)
                stores.append(mirrors[state.slot])
            if call.kind in ("prefill", "prefill_part"):
                runner.prefill_store(stores[0], call.tokens, final=call.kind == "prefill",
                                     images=call.images)
            else:
                runner.decode_logits(stores, call.tokens)
    finally:
        dist.destroy_process_group()

