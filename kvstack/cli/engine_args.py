"""What the engine commands (generate, chat, serve) share: their engine options, the
engine those build, and the sampling options of generate and chat."""

import argparse
import atexit
import dataclasses
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from kvstack.config import ATTENTION_BACKENDS, CPU_KERNELS, DTYPES, NUMERICS
from kvstack.engine.config import SPECULATIVE, SPECULATIVE_SCHEDULES, EngineConfig
from kvstack.units import format_bytes, positive_int

if TYPE_CHECKING:  # the engine pulls in the model; parsing the command does not need it
    from kvstack.engine import LLM, SamplingParams

ENGINE_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(EngineConfig)}

# Each option that sets an EngineConfig field: its flag, the field (the option's dest, so
# the parsed arguments become the config with nothing copied by hand) and the rest of its
# argparse settings. Its default is the field's. In the order --help lists them.
ENGINE_OPTIONS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("--kv-budget", "kv_budget", dict(help="bytes for the cache, e.g. 4GiB")),
    ("--host-budget", "host_budget",
     dict(help="host memory that keeps prefix blocks the device pool hands out again, e.g. "
               "2GiB (default: none)")),
    ("--disk-prefix-cache", "disk_prefix_cache",
     dict(action="store_true", help="write the blocks the prefix cache names through to "
                                    "disk (--cache-dir), where a later run finds them")),
    ("--replay", "replay",
     dict(choices=("bounded", "exact"), help="decoder replay span of CED prefill")),
    ("--window-checkpoints", "window_checkpoints",
     dict(type=int, metavar="N",
          help="window states of prefix-cache hits kept so that the next hit on the same "
               "blocks copies one instead of replaying, each a window-ring slot's bytes of "
               "--kv-budget; 0: every hit replays (default: %(default)s)")),
    ("--device", "device", dict(help="cpu or cuda (default: cuda when available)")),
    ("--threads", "threads",
     dict(type=positive_int, help="torch threads (default: half the cores, at most 8: all "
                                  "of them collapse on a busy machine)")),
    ("--compile", "compile_decode",
     dict(action="store_true", help="run decode steps through torch.compile, one graph per "
                                    "batch-size bucket: minutes to compile on a bucket's "
                                    "first step on a small CPU, faster after")),
    ("--attention", "attention",
     dict(choices=ATTENTION_BACKENDS, help="a decode step's attention: the Triton kernel "
                                           "over the packed rows (CUDA), torch, or auto "
                                           "(torch: the kernel is slower on an H200 so far)")),
    ("--cpu-kernels", "cpu_kernels",
     dict(choices=CPU_KERNELS, help="a CPU step's packed-row reads, index scoring, expert "
                                    "matmuls and packed-weight matmuls: C kernels built on "
                                    "first use (c: or fail), torch, or auto (C where the "
                                    "system's C compiler builds them)")),
    ("--speculative", "speculative",
     dict(choices=SPECULATIVE, help="dspark: greedy requests' next tokens drafted by the "
                                    "model's DSpark layers and verified in one target call "
                                    "(lossless); none: one token a step (default: "
                                    "%(default)s)")),
    ("--speculative-tokens", "speculative_tokens",
     dict(type=positive_int, metavar="N",
          help="with --speculative dspark: at most N drafts verified a step (default: the "
               "draft's block, dspark_block_size; more is refused)")),
    ("--speculative-schedule", "speculative_schedule",
     dict(choices=SPECULATIVE_SCHEDULES,
          help="with --speculative dspark: measured drafts for a sequence while its verifies "
               "keep more tokens than plain steps would make in their time (timed as the "
               "engine runs); always drafts every step (default: %(default)s)")),
    ("--max-num-batched-tokens", "max_num_batched_tokens",
     dict(type=positive_int, metavar="N",
          help="tokens one step runs: its decode batch's, its prompt parts' and the replay "
               "of each prefix-cache hit it starts; a longer prompt is prefilled in parts "
               "over several steps (default: %(default)s)")),
    ("--max-model-len", "max_model_len",
     dict(type=positive_int, metavar="N",
          help="tokens a sequence may hold, below the model's max_seq_len")),
    ("--numerics", "numerics",
     dict(choices=NUMERICS, help="reference: round activations to FP8 before FP8/FP4 weights "
                                 "and form RoPE angles in float32, as DeepSeek's code does "
                                 "(parity checks)")),
    ("--dtype", "dtype",
     dict(choices=DTYPES, help="the weight matrices: auto holds them as the checkpoint "
                               "stores them (bf16 where all are bf16), bfloat16 narrows "
                               "float32 ones at load (half the bytes a step reads; "
                               "activations stay float32) (default: auto)")),
    ("--cache-dir", "cache_dir",
     dict(help="where the disk tier and saved sessions live (default: %(default)s)")),
    ("--tensor-parallel-size", "tensor_parallel_size",
     dict(type=positive_int, metavar="N",
          help="split the model over N processes, one device each (gloo on CPUs, NCCL on "
               "GPUs); under torchrun, over its ranks (default: 1)")),
    ("--expert-parallel", "expert_parallel",
     dict(action="store_true", help="with --tensor-parallel-size: whole routed experts by "
                                    "rank instead of a slice of every expert")),
    ("--max-image-bytes", "max_image_bytes",
     dict(help="the largest encoded picture a request may carry, e.g. 8MiB (a model with a "
               "vision tower; default: %(default)s)")),
    ("--parallel-timeout", "parallel_timeout_s",
     dict(type=float, metavar="S",
          help="with --tensor-parallel-size: seconds a rank may take to answer before the "
               "engine counts it lost (idle ranks are kept alive by a heartbeat) (default: "
               "%(default)s)")),
)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="a model directory, or a preset name with --random-init "
                        "(default: the bundled model)")
    p.add_argument("--random-init", action="store_true",
                   help="random weights and a byte tokenizer (tests, benchmarks)")
    p.add_argument("--init-seed", type=int, default=0, help="seed of --random-init")
    for flag, field, settings in ENGINE_OPTIONS:
        p.add_argument(flag, dest=field, default=ENGINE_DEFAULTS[field], **settings)


def engine_config(args: argparse.Namespace, **settings: Any) -> EngineConfig:
    """The config of the parsed engine options; `settings`: fields a command sets itself."""
    return EngineConfig(**{field: getattr(args, field) for _, field, _ in ENGINE_OPTIONS},
                        **settings)


def load_llm(args: argparse.Namespace, **settings: Any) -> "LLM":
    """The engine the command runs. Under torchrun with --tensor-parallel-size, rank 0
    returns it and every other rank serves as a worker until rank 0 stops, then exits."""
    from kvstack.engine import LLM

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    config = engine_config(args, **settings)
    rank = int(os.environ.get("RANK", "0"))
    if config.tensor_parallel_size > 1 and rank > 0:
        from kvstack.engine.workers import ModelSource, serve_worker

        serve_worker(rank, config.tensor_parallel_size, None, None,
                     ModelSource(args.model, args.random_init, args.init_seed), config)
        raise SystemExit(0)
    llm = LLM(args.model, config, random_init=args.random_init, seed=args.init_seed)
    atexit.register(llm.close)  # a sharded engine's workers stop with the command
    return llm


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    # The command's sampling defaults suit reading a model's text; SamplingParams() keeps
    # vLLM's library defaults (temperature 1, top-p 1).
    p.add_argument("--max-tokens", type=positive_int, default=128,
                   help="tokens to generate at most (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=0.95,
                   help="nucleus sampling mass (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample among the k likeliest tokens; 0 = all (default: %(default)s)")
    p.add_argument("--seed", type=int, help="sampling seed (default: none)")
    p.add_argument("--stop", action="append", default=[],
                   help="end the text before this string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the end-of-sequence token")
    p.add_argument("--truncate", choices=("error", "left"), default="error",
                   help="a prompt (chat: a conversation) longer than the model takes: refuse "
                        "it (error, the default), or keep its last tokens (left), leaving "
                        "room for --max-tokens")


def sampling(args: argparse.Namespace) -> "SamplingParams":
    from kvstack.engine import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                          stop=tuple(args.stop), ignore_eos=args.ignore_eos)


def cache_line(llm: "LLM") -> str:
    """The cache a finished reply leaves, in one line under it."""
    report = llm.memory_report()
    tokens, per_token = report["tokens_in_use"], report["in_use_bytes_per_token"] or 0
    held = tokens * per_token + report["window_bytes_per_sequence"]
    return (f"cache {format_bytes(held)} for {tokens:,} tokens ({report['bytes_per_token']:g} "
            f"B/token measured, plan {report['planned_bytes_per_token']:g})")
