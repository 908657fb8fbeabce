"""`kvstack train`: a model of the family trained from scratch or fine-tuned, resumable."""

import argparse
import json
import sys

from kvstack.config import PRESETS
from kvstack.units import positive_float, positive_int


def add_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    train = sub.add_parser("train", help="train a model of the family from scratch")
    train.add_argument("--preset", choices=PRESETS, required=True)
    train.add_argument("--out", required=True, help="the run directory (resumes if present)")
    train.add_argument("--steps", type=positive_int, default=200)
    train.add_argument("--seq-len", type=positive_int, default=256)
    train.add_argument("--batch-size", type=positive_int, default=8)
    train.add_argument("--grad-accum", type=positive_int, default=1)
    train.add_argument("--lr", type=positive_float, default=3e-3)
    train.add_argument("--min-lr", type=float, default=3e-4,
                       help="where the cosine schedule ends")
    train.add_argument("--warmup-steps", type=int, default=20)
    train.add_argument("--dense-warmup-steps", type=int, default=50)
    train.add_argument("--dense-warmup-indexer-only", action="store_true",
                       help="the dense warm-up trains the indexers alone on the KL to dense "
                            "attention, every other weight frozen")
    train.add_argument("--index-target-rows", type=int, default=0,
                       help="with --dense-warmup-indexer-only: dense indexer targets at this "
                            "many query positions per row (up to half where an answer is "
                            "predicted), attention sparse: for rows too long for dense attention "
                            "(0: dense at every position)")
    train.add_argument("--eval-every", type=positive_int, default=50)
    train.add_argument("--checkpoint-every", type=positive_int, default=50)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--vocab-size", type=int, default=0, help="0: the preset's")
    train.add_argument("--corpus", help="a directory of .py files (default: the stdlib)")
    train.add_argument("--heldout-percent", type=positive_float, default=2.0,
                       help="share of files held out for evaluation")
    train.add_argument("--retrieval-rate", type=float, default=0.0,
                       help="share of rows replaced by synthetic key-retrieval samples")
    train.add_argument("--retrieval-keys", type=positive_int, default=1,
                       help="keys defined and asked in each retrieval sample")
    train.add_argument("--retrieval-families", default="key",
                       help="how retrieval samples write their keys: key (the bundled "
                            "model's first form), six (the forms of its first long-context "
                            "stages), trained (the forms of its later stages), crossed "
                            "(those and the same definitions asked in another spelling of "
                            "the name), indirect (those and values stated through a call or "
                            "a second name), or family names "
                            "(default: %(default)s)")
    train.add_argument("--no-define-loss", action="store_true",
                       help="no loss on the planted definitions: only the answers teach")
    train.add_argument("--answer-loss-weight", type=positive_float, default=1.0,
                       help="weigh the loss where a retrieval answer token is predicted by "
                            "this factor, every other position 1 (default: %(default)s)")
    train.add_argument("--set", action="append", type=_config_setting, metavar="KEY=VALUE",
                       help="change one key of the preset's model config (a JSON value: "
                            "--set window_size=128 --set 'compress_ratios=[0,2,2,2,1,1,1,1]'); "
                            "repeatable")
    train.add_argument("--init-from", metavar="MODEL_DIR",
                       help="start from this model's weights and tokenizer instead of a "
                            "fresh initialisation (fine-tuning; e.g. kvstack/data/default); "
                            "its parameter shapes must be the run's")
    train.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    train.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvstack.train.trainer import TrainConfig, Trainer

    tc = TrainConfig(preset=args.preset, steps=args.steps, seq_len=args.seq_len,
                     batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
                     min_lr=args.min_lr,
                     warmup_steps=args.warmup_steps, dense_warmup_steps=args.dense_warmup_steps,
                     dense_warmup_indexer_only=args.dense_warmup_indexer_only,
                     index_target_rows=args.index_target_rows,
                     eval_every=args.eval_every, checkpoint_every=args.checkpoint_every,
                     seed=args.seed, vocab_size=args.vocab_size, corpus=args.corpus or "",
                     heldout_percent=args.heldout_percent, retrieval_rate=args.retrieval_rate,
                     retrieval_keys=args.retrieval_keys,
                     retrieval_families=args.retrieval_families,
                     retrieval_define_loss=not args.no_define_loss,
                     answer_loss_weight=args.answer_loss_weight,
                     model_overrides=dict(args.set or []), init_from=args.init_from or "")
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    terminal = sys.stderr.isatty()
    Trainer(tc, args.out, device=device).run(progress=terminal, lines=not terminal)
    return 0


def _config_setting(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value  # a bare string such as kv_format=bf16
