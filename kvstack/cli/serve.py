"""`kvstack serve`: the OpenAI-compatible HTTP server over one engine."""

import argparse
import functools
import logging
import os
import sys
from pathlib import Path

from kvstack.cli.engine_args import add_engine_args, engine_config, load_llm
from kvstack.serve.tool_calls import PARSERS
from kvstack.units import parse_bytes, positive_int

# A server's step is smaller than offline generation's (EngineConfig's 2,048), as vLLM
# gives its API server a smaller default than its LLM class: a prefix-cache hit replays a
# window of tokens before its prompt, and a step of 2,048 held every waiting hit's replay,
# so each waited for the last (bench/serve.py, 8 clients, one thread: TTFT p50 1,608 ms at
# 2,048, 973 at 512, 444 at 256, output rate unchanged). Offline, where only throughput
# counts, 256 cost 15 % (32 x 1K prompts).
SERVE_MAX_NUM_BATCHED_TOKENS = 256


def add_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, "
                           "chat, streaming, sessions, /metrics)")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    serve.add_argument("--served-model-name", metavar="NAME",
                       help="the model name requests give (default: the model directory's "
                            "name, or kvstack-default for the bundled model)")
    serve.add_argument("--api-key", action="append",
                       help="require 'Authorization: Bearer KEY' on /v1; repeat it (or use "
                            "--api-key-file) for several tenants, each seeing only its own "
                            "sessions and prefix cache (default: $KVSTACK_API_KEY, else none)")
    serve.add_argument("--api-key-file", metavar="FILE",
                       help="API keys, one per line ('#' starts a comment)")
    serve.add_argument("--share-prefix-cache", action="store_true",
                       help="with several API keys: let their requests hit each other's "
                            "cached prompt blocks (faster, but a hit tells one tenant that "
                            "another sent that prefix)")
    serve.add_argument("--max-num-seqs", type=positive_int, default=32,
                       help="sequences decoded together at most (default: %(default)s)")
    serve.set_defaults(max_num_batched_tokens=SERVE_MAX_NUM_BATCHED_TOKENS)
    serve.add_argument("--max-waiting", type=int, default=256,
                       help="requests queued beyond the running batch before 429 "
                            "(default: %(default)s)")
    serve.add_argument("--grace-period", type=float, default=30.0,
                       help="seconds a shutdown (SIGTERM) lets running requests finish "
                            "(default: %(default)s)")
    serve.add_argument("--default-max-tokens", type=int, default=1024,
                       help="max_tokens of a request that sets none; 0: the rest of the "
                            "context (default: %(default)s)")
    serve.add_argument("--max-body-size", default="16MiB",
                       help="a request body past this is refused (413) before it is read, "
                            "as is one without the API key (401) (default: %(default)s)")
    serve.add_argument("--request-timeout", type=float, default=30.0,
                       help="seconds a request has to arrive whole, headers and body; a "
                            "slower client is disconnected (default: %(default)s)")
    serve.add_argument("--max-connections", type=int, default=1024,
                       help="open connections at most; past it a new one replaces the "
                            "oldest that is still waiting for a request (default: "
                            "%(default)s)")
    serve.add_argument("--tool-call-parser", choices=tuple(PARSERS),
                       help="the syntax the model writes tool calls in (vLLM's names): json "
                            "(kvstack's {\"name\", \"arguments\"}), hermes (<tool_call>), "
                            "llama3_json, mistral ([TOOL_CALLS]) (default: the one the chat "
                            "template's text names, else json)")
    serve.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvstack.engine.async_llm import AsyncLLM
    from kvstack.engine.process import EngineProcess
    try:
        from kvstack.serve.app import ServeConfig, bind, build_app, serve_app
        from kvstack.serve.engine_ops import ServeOps
    except ImportError as e:
        raise ValueError(f"kvstack serve needs its extra ({e.name} is missing): pip install "
                         "-e '.[serve]'") from None

    name = args.served_model_name or (
        "kvstack-default" if args.model == "default" else Path(args.model).name)
    keys = list(args.api_key or [])
    if args.api_key_file:
        text = Path(args.api_key_file).expanduser().read_text()
        keys += [line.strip() for line in text.splitlines()
                 if line.strip() and not line.lstrip().startswith("#")]
    if not keys and os.environ.get("KVSTACK_API_KEY"):
        keys = [os.environ["KVSTACK_API_KEY"]]
    config = ServeConfig(
        name, tuple(dict.fromkeys(keys)), args.share_prefix_cache, args.max_waiting,
        host=args.host, port=args.port, grace_period_s=args.grace_period,
        max_body_bytes=parse_bytes(args.max_body_size, "--max-body-size"),
        request_timeout_s=args.request_timeout, max_connections=args.max_connections,
        default_max_tokens=args.default_max_tokens, tool_call_parser=args.tool_call_parser)
    # A port in use is said before the model loads (by rank 0 alone: under torchrun the
    # other ranks serve as workers inside load_llm and never listen).
    sock = bind(config) if int(os.environ.get("RANK", "0")) == 0 else None
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if engine_config(args).tensor_parallel_size > 1:
        # A sharded engine's rank 0 is this process, in the ranks' process group: its
        # core steps in a thread here.
        engine: AsyncLLM | EngineProcess = AsyncLLM(load_llm(args, max_num_seqs=args.max_num_seqs))
    else:
        engine = EngineProcess(functools.partial(load_llm, args, max_num_seqs=args.max_num_seqs),
                               ServeOps)
    logging.getLogger("kvstack").info("kvstack serve: %s on http://%s:%d/v1", name,
                                      args.host, args.port)
    serve_app(build_app(engine, config), config, sock)
    return 0
