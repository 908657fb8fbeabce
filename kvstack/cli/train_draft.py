"""`kvstack train-draft`: DSpark's draft trained for a trained target, resumable."""

import argparse
import sys

from kvstack.units import positive_float, positive_int


def add_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    from kvstack.train.draft_config import DraftTrainConfig

    d = DraftTrainConfig(target="")
    p = sub.add_parser("train-draft", help="train DSpark's draft layers for a trained model "
                                           "(the model frozen); OUT/model is the model with "
                                           "its draft")
    p.add_argument("--target", help="the model directory to draft for (default: the "
                                    "bundled model)")
    p.add_argument("--out", required=True, help="the run directory (resumes if present)")
    p.add_argument("--steps", type=positive_int, default=d.steps)
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size,
                   help="rows a step (default: %(default)s)")
    p.add_argument("--continuation", type=positive_int, default=d.continuation,
                   help="tokens the target writes greedily after each row's window of "
                        "corpus text (default: %(default)s)")
    p.add_argument("--rows", type=positive_int, default=d.rows,
                   help="rows the target continues once for training (default: "
                        "%(default)s)")
    p.add_argument("--positions", type=positive_int, default=d.positions,
                   help="draft blocks trained per row (default: %(default)s)")
    p.add_argument("--block-size", type=positive_int, default=d.block_size,
                   help="drafts a block proposes (default: %(default)s)")
    p.add_argument("--stages", type=positive_int, default=d.stages,
                   help="draft layers (default: %(default)s)")
    p.add_argument("--markov-rank", type=positive_int, default=d.markov_rank)
    p.add_argument("--lr", type=positive_float, default=d.lr)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--eval-every", type=positive_int, default=d.eval_every)
    p.add_argument("--checkpoint-every", type=positive_int, default=d.checkpoint_every)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--corpus", help="a directory of .py files (default: the stdlib)")
    p.add_argument("--heldout-percent", type=positive_float, default=d.heldout_percent)
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from kvstack.engine.loading import bundled_model
    from kvstack.train.draft_config import DraftTrainConfig
    from kvstack.train.dspark import DraftTrainer

    torch.set_num_threads(args.threads)
    tc = DraftTrainConfig(
        target=args.target or str(bundled_model()), steps=args.steps,
        batch_size=args.batch_size, continuation=args.continuation, rows=args.rows,
        positions=args.positions,
        block_size=args.block_size, stages=args.stages, markov_rank=args.markov_rank,
        lr=args.lr, warmup_steps=args.warmup_steps, eval_every=args.eval_every,
        checkpoint_every=args.checkpoint_every, seed=args.seed, corpus=args.corpus,
        heldout_percent=args.heldout_percent)
    scores = DraftTrainer(tc, args.out).run(log=lambda line: print(line, file=sys.stderr,
                                                                    flush=True))
    print(f"held-out: acceptance length {scores['acceptance']:.2f} (greedy drafts of "
          f"{tc.block_size}), accuracy {scores['accuracy']:.3f}; the model with its draft: "
          f"{args.out}/model")
    return 0
