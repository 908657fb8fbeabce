"""vLLM's side of bench/offline.py: offline `LLM.generate` of the batches it is sent, timed.

Runs in the vLLM CPU venv (bench/.peers/vllm), driven over a pipe, one JSON object a line
each way:

    {"op": "generate", "prompts": [[token ids], ...], "max_tokens": N}
        -> {"ok": true, "seconds": ..., "output_tokens": ..., "prompt_tokens": ...}
    {"op": "quit"}

Greedy, ignore_eos (every request makes exactly max_tokens), the prompts given as token ids
so both engines read the same tokens. The environment (VLLM_CPU_OMP_THREADS_BIND,
VLLM_CPU_KVCACHE_SPACE, OMP_NUM_THREADS) is the caller's.
"""

import argparse
import json
import os
import sys
import time
import traceback

# The protocol owns the original stdout; vLLM logs to stdout, so fd 1 becomes stderr.
_proto = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len, seed=0)
    import vllm

    _proto.write(json.dumps({"ok": True, "vllm": vllm.__version__}) + "\n")
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["op"] == "quit":
                break
            params = SamplingParams(max_tokens=msg["max_tokens"], temperature=0,
                                    ignore_eos=True)
            prompts = [TokensPrompt(prompt_token_ids=p) for p in msg["prompts"]]
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            reply = {"ok": True, "seconds": seconds,
                     "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                     "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs)}
        except Exception as e:  # answered, not fatal
            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        _proto.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
