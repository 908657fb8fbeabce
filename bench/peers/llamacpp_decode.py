"""llama.cpp's side of bench/decode.py --peer llama.cpp: batch-1 decode steps of a GGUF
Llama, timed on request, so that the caller can alternate them with its own systems.

Runs in the llama.cpp venv (bench/.peers/llamacpp), driven over a pipe, one JSON object a
line each way:

    {"op": "open", "context": C, "n_ctx": N, "systems": [{"name": ..., "type_k": "q8_0",
     "type_v": "q8_0", "flash_attn": true}, ...]}
        -> {"ok": true, "systems": {name: {"prefill_s": ..., "kv_log": ...}}}
        one llama.cpp context per system, each filled by a real prefill of C tokens
    {"op": "steps", "name": ..., "steps": S}
        -> {"ok": true, "seconds": ...}  S greedy decode steps, one token each
    {"op": "close"}  frees the contexts;  {"op": "quit"}

A decode step is what a server does per token at batch 1: `Llama.eval` of the one token
(llama_decode, logits of that token only) and the argmax of its logits as the next token.
Failures answer {"ok": false, "error": ...} instead of ending the process.
"""

import argparse
import ctypes
import json
import os
import re
import sys
import time
import traceback

import numpy as np

# The protocol owns the original stdout; fd 1 becomes stderr so that nothing llama.cpp
# prints from C can interleave with it.
_proto = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)

import llama_cpp  # noqa: E402  (after the fd juggling: it may print on import)
from llama_cpp import Llama  # noqa: E402

TYPES = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16,
         "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}

# llama.cpp's log, kept to read back the KV cache size it allocated ("llama_kv_cache:
# size = 2.00 MiB (1024 cells, 8 layers, 1/1 seqs), K (f16): 1.00 MiB, V (f16): 1.00 MiB").
_log: list[str] = []


@llama_cpp.llama_log_callback
def _capture(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    _log.append(text.decode("utf-8", "replace"))


llama_cpp.llama_log_set(_capture, ctypes.c_void_p(0))
KV_LINE = re.compile(r"size =\s*([\d.]+) MiB \(\s*(\d+) cells.*K \((\w+)\):\s*([\d.]+) MiB, "
                     r"V \((\w+)\):\s*([\d.]+) MiB")


def kv_from_log(start: int) -> dict | None:
    text = "".join(_log[start:])
    found = list(KV_LINE.finditer(text))
    if not found:
        return None
    m = found[-1]
    mib, cells = float(m.group(1)), int(m.group(2))
    return {"line": m.group(0), "cells": cells, "mib": mib,
            "bytes_per_token": mib * 2**20 / cells}


class System:
    def __init__(self, model: str, spec: dict, context: int, n_ctx: int, threads: int):
        start = len(_log)
        self.llm = Llama(
            model_path=model, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
            type_k=TYPES[spec["type_k"]], type_v=TYPES[spec["type_v"]],
            flash_attn=bool(spec["flash_attn"]), n_batch=2048, n_ubatch=512,
            verbose=True, seed=0)
        self.kv_log = kv_from_log(start)
        self.n_vocab = self.llm.n_vocab()
        rng = np.random.default_rng(context)
        tokens = rng.integers(3, self.n_vocab, context).tolist()  # past the specials
        t0 = time.perf_counter()
        self.llm.eval(tokens)
        self.prefill_s = time.perf_counter() - t0
        self.token = self.next_token()

    def next_token(self) -> int:
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.n_vocab,))
        return int(logits.argmax())

    def steps(self, n: int) -> float:
        if self.llm.n_tokens + n > self.llm.n_ctx():
            raise RuntimeError("context full: open with a larger n_ctx")
        t0 = time.perf_counter()
        for _ in range(n):
            self.llm.eval([self.token])
            self.token = self.next_token()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    systems: dict[str, System] = {}
    _proto.write(json.dumps({"ok": True, "llama_cpp": llama_cpp.__version__,
                             "system_info": llama_cpp.llama_print_system_info().decode()})
                 + "\n")
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["op"] == "open":
                out = {}
                for spec in msg["systems"]:
                    s = System(args.model, spec, msg["context"], msg["n_ctx"], args.threads)
                    systems[spec["name"]] = s
                    out[spec["name"]] = {"prefill_s": s.prefill_s, "kv_log": s.kv_log}
                reply = {"ok": True, "systems": out}
            elif msg["op"] == "steps":
                reply = {"ok": True, "seconds": systems[msg["name"]].steps(msg["steps"])}
            elif msg["op"] == "close":
                for s in systems.values():
                    s.close()
                systems.clear()
                reply = {"ok": True}
            elif msg["op"] == "quit":
                break
            else:
                reply = {"ok": False, "error": f"unknown op {msg['op']!r}"}
        except Exception as e:  # answered, not fatal: the caller reports and carries on
            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}",
                     "log_tail": "".join(_log[-20:])}
        _proto.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
