"""`kvstack export`: a model written in DeepSeek's published V4.1 layout (FP8/FP4,
sharded) or in kvstack's own (float)."""

import argparse
from pathlib import Path

from kvstack.config import PRESETS, preset
from kvstack.units import parse_bytes


def add_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    export = sub.add_parser("export", help="write a model in DeepSeek's published V4.1 "
                            "layout (FP8/FP4, sharded) or in kvstack's own (float)")
    export.add_argument("out", metavar="DIR", help="the new model directory")
    export.add_argument("--format", choices=("v41", "kvstack"), required=True)
    export.add_argument("--model", default="default",
                        help="a model directory, kvstack's or V4.1's (default: the bundled "
                             "model)")
    export.add_argument("--preset", choices=PRESETS, help="with --random-init: its config")
    export.add_argument("--random-init", action="store_true",
                        help="random weights of --preset (a tiny V4.1-format checkpoint)")
    export.add_argument("--init-seed", type=int, default=0)
    export.add_argument("--shard-size", default="4GiB", help="bytes per shard (v41)")
    export.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from kvstack.engine.loading import bundled_model
    from kvstack.engine.tokenizer import byte_level_tokenizer_json
    from kvstack.model import Model
    from kvstack.model.checkpoint import INDEX_FILE, export_v41, save_kvstack

    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty: export writes a new directory")
    shard_bytes = parse_bytes(args.shard_size, "shard-size")
    if args.random_init:
        if not args.preset:
            raise ValueError("--random-init needs --preset")
        torch.manual_seed(args.init_seed)
        model = Model(preset(args.preset))
        tokenizer_json = byte_level_tokenizer_json()
    else:
        if args.preset:
            raise ValueError("--preset goes with --random-init; a model comes from --model")
        source = bundled_model() if args.model == "default" else Path(args.model)
        if not (source / "tokenizer.json").is_file():
            raise ValueError(f"model {source}: tokenizer.json is missing (an export ships it)")
        model = Model.from_pretrained(source)
        tokenizer_json = (source / "tokenizer.json").read_text()
    if args.format == "v41":
        files = export_v41(model, out, shard_bytes)
        written = f"{len(files)} shards + {INDEX_FILE}"
    else:
        save_kvstack(model, out)
        written = "model.safetensors"
    (out / "tokenizer.json").write_text(tokenizer_json)
    print(f"wrote {out}: config.json, {written}, tokenizer.json")
    return 0
