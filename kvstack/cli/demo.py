"""`kvstack demo`: a long file ingested and continued, its cache beside the dense
control's."""

import argparse
import json
import logging
import sys

from rich.console import Console

from kvstack.units import positive_int


def add_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    demo = sub.add_parser("demo", help="ingest a long file, continue it, and compare the "
                          "cache with the dense control's")
    demo.add_argument("--model", help="model directory (default: the bundled model)")
    demo.add_argument("--control", help="dense control directory (default: the repository's)")
    demo.add_argument("--context", type=positive_int, default=3072)
    demo.add_argument("--max-tokens", type=positive_int, default=48)
    demo.add_argument("--json", action="store_true")
    demo.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvstack.demo import demo

    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    result = demo(args.model, args.control, context=args.context, max_tokens=args.max_tokens,
                  console=Console(stderr=args.json))
    if args.json:
        print(json.dumps(result))
    return 0
