"""Offline batch generation, kvstack's `LLM.generate` against vLLM's (CPU build), on the
same model shape, the same prompts, one thread each, taking turns in one run.

(a) kvstack: a random-init model of bench/prefill.py's shape (dim 256, 8 layers, 4 heads of
64, the compressed stack) with the bundled tokenizer's 2,048-token vocabulary, `threads=1`,
its weight matrices in bf16 (`--kvstack-dtype`, `dtype=`; activations float32).
(v) vLLM: bench/decode.py's HF Llama peer of the same width, depth, KV heads and active FFN
width, saved as an HF directory and loaded by vLLM's CPU build in bfloat16
(`--vllm-dtype`), run by bench/peers/vllm_offline.py inside bench/.peers/vllm
(bench/peers/setup_vllm.sh; skipped with a message where that venv is missing) with
OMP_NUM_THREADS=1,
VLLM_CPU_OMP_THREADS_BIND=nobind (a shared machine: no pinning) and VLLM_CPU_KVCACHE_SPACE=1.

The workload: `--prompts` prompts (32) of `--prompt-tokens` random token ids (1,024), all
submitted to one `generate` call, `--max-tokens` (32) greedy output tokens each with
ignore_eos, so both make the same number of tokens. Each of `--repeat` rounds runs both
engines on fresh prompts (the same for both; fresh so that no round hits a prefix cache
filled by the one before), after one untimed warm-up call each; each engine keeps its best
round. Reported: output tokens/s, total (prompt + output) tokens/s, and kvstack's over
vLLM's. The machine is shared: the ratio of one run is the figure to quote, with the load
average printed beside it.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from decode import hf_model  # bench/ is on the path: the same Llama as the other peers
from prefill import bench_config
from vllm_peer import VLLM_ENV, VLLM_PYTHON, bf16_note, have_vllm

from kvstack import LLM, SamplingParams
from kvstack.engine.loading import bundled_model
from kvstack.engine.tokenizer import JsonTokenizer

PEERS = Path(__file__).resolve().parent / "peers"


class Vllm:
    """vLLM's LLM in its venv, a JSON line a request."""

    def __init__(self, model_dir: Path, args: argparse.Namespace, log: Path) -> None:
        self.log = log.open("w")
        env = os.environ | VLLM_ENV | {"OMP_NUM_THREADS": str(args.threads),
                                       "TOKENIZERS_PARALLELISM": "false"}
        self.process = subprocess.Popen(
            [str(VLLM_PYTHON), str(PEERS / "vllm_offline.py"), "--model", str(model_dir),
             "--max-num-seqs", str(args.prompts), "--dtype", args.vllm_dtype,
             "--max-model-len", str(args.prompt_tokens + args.max_tokens + 64)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            env=env)
        self.version = self.request(None)["vllm"]

    def request(self, msg: dict | None) -> dict:
        if msg is not None:
            self.process.stdin.write(json.dumps(msg) + "\n")
            self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM worker exited; its log: {self.log.name}")
        reply = json.loads(line)
        if not reply["ok"]:
            raise RuntimeError(f"vLLM: {reply['error']}")
        return reply

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        r = self.request({"op": "generate", "prompts": prompts, "max_tokens": max_tokens})
        return r["seconds"], r["output_tokens"]

    def quit(self) -> None:
        try:
            self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.process.stdin.close()
            self.process.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
        self.log.close()


def kvstack_generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    failed = [o.error for o in outs if o.error]
    if failed:
        raise RuntimeError(f"kvstack: {len(failed)} requests failed: {failed[0]}")
    return seconds, sum(len(o.token_ids) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=2, help="rounds; each keeps its best")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vllm-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="vLLM's weights and activations; bfloat16 runs emulated on a CPU "
                             "without AVX512-BF16 (vLLM logs a oneDNN fallback there)")
    parser.add_argument("--kvstack-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="kvstack's weight matrices (EngineConfig.dtype), as vLLM's "
                             "--vllm-dtype")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = JsonTokenizer(bundled_model() / "tokenizer.json")
    max_len = args.prompt_tokens + args.max_tokens + 64
    config = bench_config(max_seq_len=max_len).replace(vocab_size=tokenizer.vocab_size)

    def batch(seed: int, n: int) -> list[list[int]]:
        rng = random.Random(seed)  # ids past the 3 specials: no <|eos|> inside a prompt
        return [[rng.randrange(3, tokenizer.vocab_size) for _ in range(args.prompt_tokens)]
                for _ in range(n)]

    skipped, vllm = None, None
    with tempfile.TemporaryDirectory(prefix="kvstack-offline-") as tmp:
        if not have_vllm():
            skipped = (f"(v) vLLM skipped: {VLLM_PYTHON.parent.parent} has no vllm; build it "
                       "once with bench/peers/setup_vllm.sh")
        else:
            from transformers import PreTrainedTokenizerFast

            hf_dir = Path(tmp) / "hf"
            hf_model(config, max_len).save_pretrained(hf_dir)
            PreTrainedTokenizerFast(
                tokenizer_file=str(bundled_model() / "tokenizer.json")).save_pretrained(hf_dir)
            log = Path(tempfile.gettempdir()) / f"kvstack-bench-vllm-offline-{os.getpid()}.log"
            try:
                vllm = Vllm(hf_dir, args, log)
            except (OSError, RuntimeError) as e:
                skipped = f"(v) vLLM skipped: it did not start ({e})"
        # Budget for the whole batch at once, as vLLM's 1 GiB holds it.
        llm = LLM(config, random_init=True, threads=args.threads, kv_budget="1GiB",
                  max_num_seqs=args.prompts, max_model_len=max_len, dtype=args.kvstack_dtype,
                  cache_dir=str(Path(tmp) / "cache"))
        systems = {"(a) kvstack": lambda p: kvstack_generate(llm, p, args.max_tokens)}
        if vllm is not None:
            systems["(v) vLLM CPU"] = lambda p: vllm.generate(p, args.max_tokens)
        for run in systems.values():  # warm-up: lazy initialisation, compiled graphs
            run(batch(-1, 2))
        best = dict.fromkeys(systems, (float("inf"), 0))
        for r in range(args.repeat):
            prompts = batch(r, args.prompts)
            for name, run in systems.items():
                seconds, out_tokens = run(prompts)
                if seconds < best[name][0]:
                    best[name] = (seconds, out_tokens)
        version = None
        if vllm is not None:
            version = vllm.version
            vllm.quit()
        llm.close()
    rows = {}
    for name, (seconds, out_tokens) in best.items():
        rows[name] = {"seconds": seconds, "output_tokens": out_tokens,
                      "output_tok_s": out_tokens / seconds,
                      "total_tok_s": (out_tokens + args.prompts * args.prompt_tokens) / seconds}
    a = rows["(a) kvstack"]
    for row in rows.values():
        row["a_over_row"] = a["output_tok_s"] / row["output_tok_s"]
    load = os.getloadavg()
    if args.json:
        print(json.dumps({"rows": rows, "args": vars(args), "vllm": version,
                          "torch": torch.__version__, "load": load, "skipped": skipped}))
        return
    print(f"{args.prompts} prompts × {args.prompt_tokens} tokens, {args.max_tokens} greedy "
          f"output tokens each (ignore_eos), one generate call; best of {args.repeat} "
          f"rounds, the engines taking turns; {args.threads} thread(s) each")
    print(f"{'engine':<16}{'seconds':>10}{'out tok/s':>12}{'total tok/s':>13}{'(a) ×':>9}")
    for name, row in rows.items():
        ratio = "" if row is a else f"{row['a_over_row']:.2f}×"
        print(f"{name:<16}{row['seconds']:>10.2f}{row['output_tok_s']:>12.1f}"
              f"{row['total_tok_s']:>13.1f}{ratio:>9}")
    print(f"(a) × = kvstack's tokens/s over the row's; kvstack's matrices in "
          f"{args.kvstack_dtype}; torch {torch.__version__}"
          + (f", vLLM {version} in {args.vllm_dtype}" if version else "")
          + f"; load average {' '.join(f'{x:.2f}' for x in load)}")
    if skipped:
        print(skipped)
    elif note := bf16_note(args.vllm_dtype):
        print(note)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
