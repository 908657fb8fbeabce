"""`kvstack eval`: its sub-commands, each scoring a model on the held-out split
(`kvstack.eval.quality`, `kvstack.eval.replay`), and how each prints its result."""

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.table import Table

from kvstack.units import positive_float, positive_int

if TYPE_CHECKING:
    from kvstack.corpus.data import TokenCache
    from kvstack.model import Model


def add_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    evaluate = sub.add_parser("eval", help="evaluate a trained model")
    kinds = evaluate.add_subparsers(dest="eval_kind", required=True)
    ppl = kinds.add_parser("ppl", help="held-out perplexity, FP4 caches against bf16")
    ppl.add_argument("--seq-len", type=positive_int, default=512)
    ppl.add_argument("--windows", type=positive_int, default=16)
    ppl.add_argument("--short-context", type=positive_int, metavar="N",
                     help="also score the same tokens through windows of N tokens sliding "
                          "by N/2: what the long context does, apart from the text")
    ppl.set_defaults(run=_ppl)
    ret = kinds.add_parser("retrieval", help="key retrieval by context length and depth")
    ret.add_argument("--lengths", type=positive_int, nargs="+", default=[512, 1024, 2048])
    ret.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    ret.add_argument("--samples", type=positive_int, default=8)
    ret.add_argument("--replay", choices=("bounded", "exact"), default="exact")
    ret.add_argument("--seed", type=int, default=0,
                     help="draws the questions: another seed, another set (default: 0)")
    ret.add_argument("--plot", help="write the heat map to this PNG")
    ret.add_argument("--families", default="key",
                     help="how the keys are written: key (KEY_0042 = \"...\", the bundled "
                          "model's first form), six, trained, crossed, indirect, held-out "
                          "(forms no training run samples), or family names (default: "
                          "%(default)s)")
    ret.set_defaults(run=_retrieval)
    planted = kinds.add_parser("planted", help="how often free generation opens with a key "
                               "definition as retrieval samples write them")
    planted.add_argument("--samples", type=positive_int, default=50)
    planted.add_argument("--context", type=positive_int, default=256,
                         help="tokens of held-out code before each continuation")
    planted.add_argument("--new-tokens", type=positive_int, default=24)
    planted.set_defaults(run=_planted)
    rep = kinds.add_parser("replay", help="resume cost and fidelity: the window rebuilt by "
                           "replay against a re-prefill and the uninterrupted session")
    rep.add_argument("--lengths", type=positive_int, nargs="+",
                     help="context lengths (default: 512 1024 2048 4000)")
    rep.add_argument("--replay", choices=("bounded", "exact"), nargs="+",
                     default=["bounded", "exact"])
    rep.add_argument("--decode-tokens", type=positive_int, default=8,
                     help="tokens decoded after the resume (KL over these + 1 positions)")
    rep.add_argument("--repeats", type=positive_int, default=3,
                     help="timed runs of each rebuild and re-prefill; the best is kept")
    rep.set_defaults(run=_replay)
    att = kinds.add_parser("attention", help="where each layer's attention goes: window, "
                           "compressed entries near and beyond it, sink")
    att.add_argument("--seq-len", type=positive_int, default=512)
    att.add_argument("--windows", type=positive_int, default=8)
    att.add_argument("--from-position", type=int,
                     help="probe queries from this position on (default: half of --seq-len)")
    att.set_defaults(run=_attention)
    knock = kinds.add_parser("knockout", help="which layers' compressed attention "
                             "retrieval needs: one layer at a time left to its window")
    knock.add_argument("--length", type=positive_int, default=512)
    knock.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5])
    knock.add_argument("--samples", type=positive_int, default=8)
    knock.set_defaults(run=_knockout)
    sel = kinds.add_parser("selection", help="whether a retrieval miss is the indexer's "
                           "choice or the read: the definition's entries in each top-k")
    sel.add_argument("--lengths", type=positive_int, nargs="+", default=[512, 2048, 8192])
    sel.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    sel.add_argument("--samples", type=positive_int, default=4)
    sel.add_argument("--trunk-picks", action="store_true",
                     help="each picking layer selects by its own attention logits instead of "
                          "its indexer: what a perfect indexer would buy")
    sel.add_argument("--logit-scale", type=_layer_factor, action="append", metavar="LAYER=F",
                     help="multiply a layer's attention logits by F (repeatable): what a "
                          "sharper read would buy")
    sel.add_argument("--families", default="held-out",
                     help="how the keys are written, as for retrieval (default: %(default)s)")
    sel.set_defaults(run=_selection)
    for p in (ppl, ret, planted, rep, att, knock, sel):
        p.add_argument("--model", required=True, help="a model directory")
        p.add_argument("--heldout-percent", type=positive_float, default=2.0)
        p.add_argument("--json", action="store_true")


def _eval_data(args: argparse.Namespace) -> tuple["Model", Any, "TokenCache"]:
    """The model, its tokenizer and the held-out split in its tokens (cached by tokenizer)."""
    import hashlib

    from kvstack.eval.quality import heldout_tokens, load_eval_model

    model, tokenizer = load_eval_model(args.model)
    digest = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()[:16]
    cache = Path.home() / ".cache" / "kvstack" / "eval" / f"heldout-{digest}.npy"
    return model, tokenizer, heldout_tokens(tokenizer, cache, args.heldout_percent)


def _ppl(args: argparse.Namespace) -> int:
    from kvstack.eval.quality import perplexity

    model, _, data = _eval_data(args)
    result = perplexity(model, data, args.seq_len, args.windows,
                        short_context=args.short_context)
    if args.json:
        print(json.dumps(result))
    else:
        Console().print(
            f"held-out perplexity {result['ppl']:.3f} with {model.config.kv_format} caches, "
            f"{result['ppl_bf16']:.3f} with bf16 caches ({result['ppl_increase']:+.2%}); "
            f"KL {result['kl_vs_bf16']:.2e}, top-1 agreement {result['top1_agreement']:.1%} "
            f"over {args.windows} windows of {args.seq_len} tokens")
        table = Table(box=box.SIMPLE_HEAD, title="perplexity by position in the window")
        for bucket in result["ppl_by_position"]:
            table.add_column(bucket, justify="right")
        table.add_row(*(f"{v:.2f}" for v in result["ppl_by_position"].values()))
        if args.short_context:
            table.add_row(*(f"{v:.2f}" for v in
                            result["ppl_by_position_short_context"].values()))
            table.caption = (f"first row: the whole window before each token; second: the "
                             f"same tokens through windows of {args.short_context} "
                             f"(perplexity {result['ppl_short_context']:.3f})")
        Console().print(table)
    return 0


def _retrieval(args: argparse.Namespace) -> int:
    from kvstack.eval.quality import heat_map, retrieval

    model, tokenizer, data = _eval_data(args)
    result = retrieval(model, tokenizer, data, args.lengths, args.depths, args.samples,
                       replay=args.replay, seed=args.seed, forms=args.families)
    if args.plot:
        heat_map(result, args.plot)
        result["plot"] = args.plot
    if args.json:
        print(json.dumps(result))
        return 0
    console = Console()
    console.print(f"retrieval accuracy ({args.samples} samples per cell, {args.replay} "
                  f"replay, keys written as {', '.join(result['families'])}; rows: context "
                  "tokens, columns: depth of the key)")
    table = Table(box=box.SIMPLE_HEAD)
    table.add_column("tokens", justify="right")
    for d in args.depths:
        table.add_column(f"{d:.0%}", justify="right")
    for n, row in zip(args.lengths, result["accuracy"], strict=True):
        table.add_row(str(n), *(f"{a:.0%}" for a in row))
    console.print(table)
    if len(result["families"]) > 1:
        console.print("answered / asked, by the family the key was written in")
        by_family = Table(box=box.SIMPLE_HEAD)
        by_family.add_column("tokens", justify="right")
        for name in result["families"]:
            by_family.add_column(name, justify="right")
        for n, tally in zip(args.lengths, result["by_family"], strict=True):
            by_family.add_row(str(n), *(f"{hit} / {asked}" for hit, asked in tally.values()))
        console.print(by_family)
    for n, missed in zip(args.lengths, result["misses"], strict=True):
        if missed:
            first = sum(m["at"] == 0 for m in missed)
            shown = "; ".join(f"{m['answer']!r}: {m['chose']!r} for {m['expected']!r}"
                              for m in missed[:3])
            console.print(f"{n} tokens: {len(missed)} wrong, {first} from the answer's "
                          f"first token, {len(missed) - first} later; chosen for expected: "
                          f"{shown}")
    return 0


def _planted(args: argparse.Namespace) -> int:
    from kvstack.eval.quality import planted_starts

    model, tokenizer, data = _eval_data(args)
    result = planted_starts(model, tokenizer, data, args.samples, args.context, args.new_tokens)
    if args.json:
        print(json.dumps(result))
        return 0
    for name, what in (("code", f"greedy continuations of held-out code ({args.context} "
                                 "tokens each)"), ("chat", "greedy chat replies")):
        r = result[name]
        print(f"{r['planted_share']:.1%} of {r['prompts']} {what} open with a key definition")
        for line in r["examples"]:
            print(f"  {line}")
    return 0


def _replay(args: argparse.Namespace) -> int:
    from kvstack.eval.replay import LENGTHS, replay

    model, _, data = _eval_data(args)
    result = replay(model, data, args.lengths or LENGTHS, args.replay, args.decode_tokens,
                    args.repeats)
    if args.json:
        print(json.dumps(result))
        return 0
    console = Console()
    console.print(f"resuming a paused session: the window state rebuilt by replay from the "
                  f"streams (window {result['window_size']}) against a prefill of the whole "
                  f"context (a cache miss), best of {args.repeats} runs; KL and top-1 "
                  f"agreement with the uninterrupted session over the next "
                  f"{args.decode_tokens + 1} positions")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    table.add_column("tokens", justify="right", no_wrap=True)
    table.add_column("replay", no_wrap=True)
    for name in ("enc/dec", "rebuild\nms", "prefill\nms", "prefill/\nrebuild",
                 "KL\nmean", "KL\nmax", "top-1"):
        table.add_column(name, justify="right", no_wrap=True)
    for row in result["results"]:
        for mode, r in row["replay"].items():
            table.add_row(str(row["tokens"]), mode,
                          f"{r['encoder_tokens']}/{r['decoder_tokens']}",
                          f"{r['rebuild_s'] * 1e3:.1f}", f"{row['reprefill_s'] * 1e3:.1f}",
                          f"{r['reprefill_over_rebuild']:.1f}x", f"{r['kl_mean']:.1e}",
                          f"{r['kl_max']:.1e}", f"{r['top1_agreement']:.0%}")
    console.print(table)
    return 0


def _attention(args: argparse.Namespace) -> int:
    from kvstack.eval.quality import attention_mass

    model, _, data = _eval_data(args)
    from_position = args.seq_len // 2 if args.from_position is None else args.from_position
    result = attention_mass(model, data, args.seq_len, args.windows, from_position)
    if args.json:
        print(json.dumps(result))
        return 0
    console = Console()
    console.print(f"where attention goes: queries at positions {from_position}.."
                  f"{args.seq_len - 1} of {args.windows} held-out windows, averaged over heads "
                  f"(window {result['window_size']}; near: compressed entries the window also "
                  "holds raw; far: entries beyond it)")
    table = Table(box=box.SIMPLE_HEAD)
    for name in ("layer", "mode", "ratio", "window", "near", "far", "sink",
                 "top-k picks near"):
        table.add_column(name, justify="left" if name == "mode" else "right")
    for row in result["layers"]:
        near = row["selected_near"]
        table.add_row(str(row["layer"]), row["mode"], str(row["ratio"]),
                      *(f"{row[k]:.1%}" for k in ("window", "near", "far", "sink")),
                      "-" if near is None else f"{near:.0%}")
    console.print(table)
    return 0


def _knockout(args: argparse.Namespace) -> int:
    from kvstack.eval.quality import knockout

    model, tokenizer, data = _eval_data(args)
    result = knockout(model, tokenizer, data, args.length, args.depths, args.samples)
    if args.json:
        print(json.dumps(result))
        return 0
    console = Console()
    console.print(f"retrieval at {args.length} tokens (depths "
                  f"{', '.join(f'{d:.0%}' for d in args.depths)}, {args.samples} questions "
                  "each) with one layer's compressed entries left out of its attention")
    table = Table(box=box.SIMPLE_HEAD)
    for name in ("left out", "mode", "ratio", "answer NLL", "accuracy"):
        table.add_column(name, justify="left" if name == "mode" else "right")
    for row in result["layers"]:
        name = "none" if row["layer"] is None else f"layer {row['layer']}"
        table.add_row(name, row.get("mode", ""), str(row.get("ratio", "")),
                      f"{row['answer_nll']:.3f}", f"{row['accuracy']:.0%}")
    console.print(table)
    return 0


def _selection(args: argparse.Namespace) -> int:
    from kvstack.eval.quality import selection

    model, tokenizer, data = _eval_data(args)
    result = selection(model, tokenizer, data, args.lengths, args.depths, args.samples,
                       forms=args.families, trunk_picks=args.trunk_picks,
                       logit_scale=dict(args.logit_scale or []))
    if args.json:
        print(json.dumps(result))
        return 0
    console = Console()
    picks = f"top-{result['index_topk']}" + (" by each layer's own attention logits"
                                              if args.trunk_picks else "")
    picks += "".join(f"; layer {k}'s logits x{v}" for k, v in result["logit_scale"].items())
    console.print(f"the definition's compressed entries at the query before the answer "
                  f"({len(args.depths) * args.samples} questions per length, keys written as "
                  f"{', '.join(result['families'])}; {picks}): the share "
                  "of them each picking layer selects and its compressed attention on them, "
                  "for the whole definition and for the value's tokens, and exact answers "
                  "where it selected some value entry (found) and where none (missed)")
    table = Table(box=box.SIMPLE_HEAD)
    for name in ("tokens", "exact", "layer", "whole", "mass", "value", "mass",
                 "found", "missed"):
        table.add_column(name, justify="right")
    for row in result["lengths"]:
        for i, layer in enumerate(row["layers"]):
            head = (str(row["length"]), f"{row['exact']:.0%}") if i == 0 else ("", "")
            table.add_row(*head, f"{layer['layer']} {layer['mode']}",
                          *(f"{layer[k]:.0%}" for k in ("selected", "mass",
                                                         "value_selected", "value_mass")),
                          *(f"{hit} / {n}" for hit, n in (layer["found"], layer["missed"])))
    console.print(table)
    return 0


def _layer_factor(text: str) -> tuple[int, float]:
    layer, sep, factor = text.partition("=")
    try:
        pair = int(layer), float(factor)
    except ValueError:
        pair = None
    if not sep or pair is None or not pair[1] > 0:
        raise argparse.ArgumentTypeError(f"expected LAYER=FACTOR with a positive factor, "
                                         f"got {text!r}")
    return pair
