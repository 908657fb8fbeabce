"""`kvstack generate`: one prompt's continuation, streamed, or whole as JSON."""

import argparse
import json
import sys
import time
from pathlib import Path

from kvstack.cli.engine_args import (
    add_engine_args,
    add_sampling_args,
    cache_line,
    load_llm,
    sampling,
)


def add_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    generate = sub.add_parser("generate", help="generate a continuation of a prompt")
    add_engine_args(generate)
    add_sampling_args(generate)
    prompt = generate.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="the prompt text")
    prompt.add_argument("--prompt-file", metavar="FILE", help="read the prompt from a file")
    generate.add_argument("--image", action="append", default=[], metavar="FILE",
                          help="a picture for a model with a vision tower (repeatable): at "
                               "the prompt's image placeholders in order, else before its "
                               "text")
    generate.add_argument("--json", action="store_true",
                          help="print text, token ids, timings and the memory report as JSON")
    generate.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    prompt = _read_prompt(args)
    llm = load_llm(args)
    params = sampling(args)
    if args.truncate == "left":  # the prompt's last tokens, leaving room for the reply
        if args.image:
            raise ValueError("--truncate left cuts token ids, and would cut a picture's segment: "
                             "shorten the prompt instead")
        prompt = llm.encode(prompt)[-max(1, llm.core.max_model_len - params.max_tokens):]
    if args.image:
        prompt = {"prompt": prompt, "multi_modal_data": {"image": list(args.image)}}
    start = time.perf_counter()
    if args.json:
        out = llm.generate(prompt, params)[0]
        print(json.dumps({
            "text": out.text, "token_ids": out.token_ids,
            "prompt_token_ids": out.prompt_token_ids, "finish_reason": out.finish_reason,
            "error": out.error, "num_cached_tokens": out.num_cached_tokens,
            "timings": {**out.metrics, "total_s": time.perf_counter() - start},
            "memory": llm.memory_report(),
        }))
        return 0
    shown, out = "", None
    for out in llm.stream(prompt, params, keep_cache=True):
        print(out.text[len(shown):], end="", flush=True)
        shown = out.text
    if out.finish_reason == "error":
        print(f"\nkvstack generate: the engine failed on the request: {out.error}",
              file=sys.stderr)
        return 1
    rate = out.metrics.get("decode_tokens_per_s", 0.0)
    print(f"\n[{len(out.token_ids)} tokens, {out.finish_reason}; first token after "
          f"{out.metrics['time_to_first_token_s']:.2f} s; {rate:.1f} tokens/s; "
          f"{cache_line(llm)}]", file=sys.stderr)
    return 0


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file is not None:
        try:
            return Path(args.prompt_file).read_text()
        except OSError as e:
            raise ValueError(f"prompt file {args.prompt_file}: cannot read ({e.strerror})") from e
        except UnicodeDecodeError as e:
            raise ValueError(f"prompt file {args.prompt_file}: not UTF-8 text (byte "
                             f"{e.start}: {e.reason})") from None
    if not sys.stdin.isatty():
        return sys.stdin.read()
    raise ValueError("no prompt: pass --prompt, --prompt-file, or pipe text on stdin")
