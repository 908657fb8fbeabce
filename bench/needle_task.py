"""Write an lm-eval needle-in-a-haystack task for `kvstack serve`: one JSONL file of
prompts at each context length (a key assigned once, deep in filler code, then asked
for at the end) and one YAML task per length, ready for EleutherAI's harness:

    python bench/needle_task.py --lengths 8192 32768 --out needle/
    lm_eval --model local-completions --include_path needle/ --tasks kvstack_needle_8192 \
        --model_args base_url=http://127.0.0.1:8000/v1/completions,model=kvstack-default,\
tokenizer_backend=remote,num_concurrent=4,max_length=33000

Lengths are counted in the served model's tokens (its tokenizer.json), so a prompt fills
the context it is meant to; the depth of the key runs evenly from 10 % to 90 %. Seeded:
the same command writes the same files.
"""

import argparse
import json
import random
from pathlib import Path

from kvstack.engine.loading import bundled_model
from kvstack.engine.tokenizer import JsonTokenizer

FILLER = ("def handler_{i}(request):\n    values = [x * {i} for x in request.items]\n"
          "    return sum(values) % {m}\n\n\n")
TASK = """task: kvstack_needle_{length}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n", ","]
  max_gen_toks: 12
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def needle_prompt(tokenizer: JsonTokenizer, length: int, depth: float,
                  rng: random.Random) -> tuple[str, str]:
    """A prompt of about `length` tokens with the key at `depth`, and its answer."""
    key, value = f"SECRET_{rng.randrange(10**6):06d}", f"{rng.randrange(10**8):08d}"
    needle = f"{key} = \"{value}\"\n\n\n"
    question = f"assert {key} == \""
    blocks, used = [], len(tokenizer.encode(needle + question))
    while used < length:
        block = FILLER.format(i=len(blocks), m=rng.randrange(7, 997))
        used += len(tokenizer.encode(block))
        blocks.append(block)
    blocks.pop()  # stay under the length
    at = int(depth * len(blocks))
    return "".join(blocks[:at]) + needle + "".join(blocks[at:]) + question, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default",
                        help="the served model's directory (default: the bundled model)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--samples", type=int, default=10, help="prompts per length")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    directory = bundled_model() if args.model == "default" else Path(args.model)
    tokenizer = JsonTokenizer(directory / "tokenizer.json")
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    for length in args.lengths:
        data = args.out / f"needle_{length}.jsonl"
        with data.open("w") as f:
            for i in range(args.samples):
                depth = 0.1 + 0.8 * i / max(args.samples - 1, 1)
                prompt, answer = needle_prompt(tokenizer, length, depth, rng)
                f.write(json.dumps({"prompt": prompt, "answer": answer,
                                    "depth": round(depth, 2)}) + "\n")
        (args.out / f"needle_{length}.yaml").write_text(
            TASK.format(length=length, data=data.resolve()))
        print(f"wrote {data} and task kvstack_needle_{length}")


if __name__ == "__main__":
    main()
