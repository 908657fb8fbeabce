"""Quality of a trained model: held-out perplexity (FP4 caches against bf16 caches) and
long-range retrieval by context length and depth.

Held-out data is the split the trainer never saw (`kvstack.corpus.data`), tokenised with
the model's own tokenizer. Perplexity runs the reference forward over fixed windows, once
with the model's configured cache formats and once with every cache in bf16 (same
weights), and reports the KL divergence between their next-token distributions, as
llama.cpp does for quantised caches. Retrieval asks for a key defined at a given depth of
real code and scores the greedy answer, through CED prefill and decode as served. The
attention probe says where each layer's attention goes on held-out text: its window, the
compressed entries the window also holds raw, the entries beyond it, the sink. The
knockout says which layers' compressed attention retrieval needs: the same questions with
one layer at a time attending to its window and sink only. The selection probe says
whether a wrong answer is the indexer's choice or the read: whether each top-k holds the
definition's entries at the query before the answer, and how much attention they get.
"""

import itertools
import math
from pathlib import Path
from statistics import fmean
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from kvstack.cache.contiguous import ContiguousCache
from kvstack.corpus.data import TokenCache, check_depth, retrieval_sample, split_corpus, stdlib_root
from kvstack.corpus.families import families, starts_with_planted_key
from kvstack.model import Instruments, Model

BF16 = dict(kv_format="bf16", index_format="bf16", window_format="bf16")


def load_eval_model(directory: str | Path) -> tuple[Model, Any]:
    from tokenizers import Tokenizer

    from kvstack.engine.loading import bundled_model

    # "default" is the bundled model, as every other command takes it.
    directory = bundled_model() if str(directory) == "default" else Path(directory)
    model = Model.from_pretrained(directory).eval()
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"model {directory}: tokenizer.json is missing")
    return model, Tokenizer.from_file(str(path))


def heldout_tokens(tokenizer: Any, out: Path, heldout_percent: float = 2.0) -> TokenCache:
    root = stdlib_root()
    _, heldout = split_corpus(root, heldout_percent)
    return TokenCache.build(root, heldout, tokenizer, out)


@torch.no_grad()
def perplexity(model: Model, data: TokenCache, seq_len: int, windows: int,
               seed: int = 0, short_context: int | None = None) -> dict[str, Any]:
    """Held-out perplexity with the configured caches and with bf16 caches, and the KL
    divergence and top-1 agreement between their next-token distributions.

    With `short_context` (< seq_len), the same tokens are also scored through windows of
    `short_context` tokens sliding by half of it, each token but the first half-window's
    seeing between half and all of `short_context` tokens before it
    (`ppl_by_position_short_context`): by position, what the long context itself does to
    the perplexity, apart from which text lies at which position."""
    if short_context is not None and not 2 <= short_context < seq_len:
        raise ValueError(f"short_context must lie in 2..{seq_len - 1} (below --seq-len), "
                         f"got {short_context}")
    bf16 = Model(model.config.replace(**BF16)).eval()
    bf16.load_state_dict(model.state_dict())
    nll = {"configured": 0.0, "bf16": 0.0}
    position_nll = torch.zeros(seq_len)  # configured caches, summed over windows
    short_nll = torch.zeros(seq_len)  # the same tokens seen through short windows
    kl = agree = 0.0
    for i in range(windows):
        batch = data.batch(1, seq_len, seed, i)
        ids, targets = batch[:, :-1], batch[:, 1:].flatten()
        logits = model(ids).logits.flatten(0, 1)
        reference = bf16(ids).logits.flatten(0, 1)
        token_nll = F.cross_entropy(logits, targets, reduction="none")
        position_nll += token_nll.cpu()
        if short_context is not None:
            short_nll += _sliding_nll(model, ids[0], targets, short_context)
        nll["configured"] += token_nll.mean().item()
        nll["bf16"] += F.cross_entropy(reference, targets).item()
        p = reference.log_softmax(-1)
        kl += (p.exp() * (p - logits.log_softmax(-1))).sum(-1).mean().item()
        agree += (reference.argmax(-1) == logits.argmax(-1)).float().mean().item()
    ppl = {k: math.exp(v / windows) for k, v in nll.items()}
    return {
        "formats": {k: getattr(model.config, k) for k in BF16},
        "seq_len": seq_len, "windows": windows,
        "ppl": ppl["configured"], "ppl_bf16": ppl["bf16"],
        "ppl_increase": ppl["configured"] / ppl["bf16"] - 1,
        "kl_vs_bf16": kl / windows, "top1_agreement": agree / windows,
        "ppl_by_position": _by_position(position_nll / windows),
    } | ({} if short_context is None else {
        "short_context": short_context,
        "ppl_short_context": math.exp(short_nll.mean().item() / windows),
        "ppl_by_position_short_context": _by_position(short_nll / windows),
    })


def _by_position(mean_nll: torch.Tensor) -> dict[str, float]:
    return {f"{lo}-{hi}": math.exp(mean_nll[lo:hi].mean().item())
            for lo, hi in position_buckets(mean_nll.shape[0])}


def _sliding_nll(model: Model, ids: torch.Tensor, targets: torch.Tensor,
                 length: int) -> torch.Tensor:
    """Per-token NLL [T] of ids [T] through windows of `length` tokens starting every
    length // 2: a window scores the tokens past its first half (the first window all of
    its own), so each token is scored once, after at least length // 2 tokens of context
    where the text has that many. The last window ends at the text's end."""
    n, stride = ids.shape[0], length // 2
    out = torch.empty(n)
    starts = list(range(0, n - length + 1, stride))
    if starts[-1] + length < n:
        starts.append(n - length)
    scored = 0  # tokens [0, scored) are done
    for start in starts:
        logits = model(ids[None, start:start + length]).logits[0]
        token_nll = F.cross_entropy(logits, targets[start:start + length], reduction="none")
        out[scored:start + length] = token_nll[scored - start:].cpu()
        scored = start + length
    return out


def position_buckets(seq_len: int) -> list[tuple[int, int]]:
    """[0, 64), [64, 128), [128, 256), ... doubling, the last cut at seq_len: the same
    buckets for every model, so that a compressed model's perplexity beyond its window
    can be set beside its dense control's."""
    edges = [0, min(64, seq_len)]
    while edges[-1] < seq_len:
        edges.append(min(2 * edges[-1], seq_len))
    return list(itertools.pairwise(edges))


@torch.no_grad()
def attention_mass(model: Model, data: TokenCache, seq_len: int, windows: int,
                   from_position: int, seed: int = 0) -> dict[str, Any]:
    """Per layer, for queries at positions >= from_position of held-out windows, averaged
    over heads and queries: attention on the window, on compressed entries whose group ends
    inside the window (`near`) and beyond it (`far`), on the sink, and the share of a
    top-k selection that is near (None for layers without one)."""
    if model.config.arch == "dense":
        raise ValueError("the dense control attends to every token of every layer: there is "
                         "no window or compressed stream to probe")
    if not 0 <= from_position < seq_len:
        raise ValueError(f"from_position must lie in 0..{seq_len - 1}, got {from_position}")
    rows: dict[int, list[torch.Tensor]] = {}
    for i in range(windows):
        ids = data.batch(1, seq_len, seed, i)[:, :-1]
        probe = Instruments(probe=True)
        model(ids, instruments=probe)
        for layer, mass in probe.attention_mass.items():
            rows.setdefault(layer, []).append(mass[0, from_position:].double())
    layers = []
    for layer, parts in sorted(rows.items()):
        mean = torch.cat(parts).nanmean(0).tolist()  # an all-NaN column stays NaN
        spec = model.config.layers[layer]
        layers.append({
            "layer": layer, "mode": str(spec.mode), "ratio": spec.ratio,
            "window": mean[0], "near": mean[1], "far": mean[2], "sink": mean[3],
            "selected_near": None if math.isnan(mean[4]) else mean[4],
        })
    return {"seq_len": seq_len, "windows": windows, "from_position": from_position,
            "window_size": model.config.window_size, "layers": layers}


@torch.no_grad()
def retrieval(model: Model, tokenizer: Any, data: TokenCache, lengths: list[int],
              depths: list[float], samples: int, replay: str = "exact",
              seed: int = 0, forms: str = "key") -> dict[str, Any]:
    """Accuracy of greedy answers by length and depth: [len(lengths)][len(depths)], the
    keys written in the families `forms` names (kvstack.corpus.families: "key", the
    bundled model's one form; "held-out", those no training run samples; ...); and by
    length and family, {family: [answered, asked]} per length, since the questions of
    a cell are drawn from every family; by length the answers' mean negative
    log-likelihood per token (nats, `answer_nll`); and by length each wrong answer's
    first wrong token (`misses`: the answer, which of its tokens, what was expected and
    what greedy decoding chose): an answer right at its first token has found the value
    and lost it copying, one wrong from the start may never have found it. `seed` draws
    another set of questions."""
    chosen = families(forms)
    for depth in depths:  # before any sample is scored
        check_depth(depth)
    accuracy, by_family, answer_nll, misses = [], [], [], []
    for length in lengths:
        row = []
        tally = {f.name: [0, 0] for f in chosen}
        nats, answer_tokens = 0.0, 0
        missed = []
        for depth in depths:
            g = _question_generator(length, depth, seed)
            hits = 0
            for _ in range(samples):
                sample = retrieval_sample(data, tokenizer, length, depth, g, families=chosen)
                answered = _answers(model, sample.ids, sample.answer_start, replay)
                nats += answered.nll
                answer_tokens += answered.tokens
                hits += answered.exact
                tally[sample.family][0] += answered.exact
                tally[sample.family][1] += 1
                if not answered.exact:
                    answer = sample.ids[sample.answer_start :]
                    at = answered.first_wrong
                    missed.append({"depth": depth, "family": sample.family,
                                   "answer": tokenizer.decode(answer), "at": at,
                                   "expected": tokenizer.decode([answer[at]]),
                                   "chose": tokenizer.decode([answered.chose])})
            row.append(hits / samples)
        accuracy.append(row)
        by_family.append(tally)
        answer_nll.append(nats / answer_tokens)
        misses.append(missed)
    return {"lengths": lengths, "depths": depths, "samples": samples, "seed": seed,
            "replay": replay, "families": [f.name for f in chosen], "accuracy": accuracy,
            "by_family": by_family, "answer_nll": answer_nll, "misses": misses}


# Requests a user types into `kvstack chat`: a reply to prose, where a model that learnt
# its retrieval samples' definitions too well opens with one.
CHAT_REQUESTS = (
    "write a function that parses a csv file", "now a class for config",
    "how do I read a json file?", "a helper that retries a request three times",
    "sort a list of dicts by a key", "write a unit test for it", "explain this code",
    "a command line tool that counts words", "open a sqlite database", "hello",
    "make it faster", "add type hints", "a dataclass for a user", "parse a date string",
    "log to a file", "a context manager that times a block", "read a file line by line",
    "merge two dictionaries", "download a page", "what does this error mean?",
)


@torch.no_grad()
def planted_starts(model: Model, tokenizer: Any, data: TokenCache, samples: int,
                   context: int = 256, new_tokens: int = 24, seed: int = 0) -> dict[str, Any]:
    """How often free generation opens with a key definition as retrieval samples write
    them (`starts_with_planted_key`): greedy continuations of `samples` held-out code
    windows of `context` tokens, and greedy replies to the `CHAT_REQUESTS` in the chat
    template's form; each share with a few of the lines to read."""
    from kvstack.engine.chat_template import DEFAULT_TEMPLATE

    g = torch.Generator().manual_seed(seed)
    code = []
    for _ in range(samples):
        at = int(torch.randint(0, data.tokens.size - context, (1,), generator=g))
        code.append(data.tokens[at : at + context].tolist())
    chat = [tokenizer.encode(DEFAULT_TEMPLATE.render([{"role": "user", "content": r}])).ids
            for r in CHAT_REQUESTS]
    result = {"samples": samples, "context": context, "new_tokens": new_tokens}
    for name, prompts in (("code", code), ("chat", chat)):
        texts = [_greedy_text(model, tokenizer, ids, new_tokens) for ids in prompts]
        planted = [t for t in texts if starts_with_planted_key(t)]
        result[name] = {"prompts": len(prompts), "planted_share": len(planted) / len(prompts),
                        "examples": [t.strip().splitlines()[0] for t in planted[:3]]}
    return result


def _greedy_text(model: Model, tokenizer: Any, ids: list[int], new_tokens: int) -> str:
    cache = ContiguousCache(model.config, max_tokens=len(ids) + new_tokens + 1)
    logits = model.prefill(torch.tensor([ids]), cache)
    out = []
    for _ in range(new_tokens):
        out.append(int(logits.argmax(-1)))
        logits = model.decode(torch.tensor([out[-1]]), cache)
    return tokenizer.decode(out)


@torch.no_grad()
def knockout(model: Model, tokenizer: Any, data: TokenCache, length: int,
             depths: list[float], samples: int, seed: int = 0) -> dict[str, Any]:
    """Retrieval with each compressed layer's compressed entries left out of its attention
    in turn (`window_only`; its stream, indexer and top-k still serve later layers), on the
    questions `retrieval` asks at this length. Answers are scored teacher-forced in the
    reference forward: the mean NLL of the answer tokens, and exact when every answer
    token is the argmax, which is when greedy decoding reproduces the answer."""
    if model.config.arch == "dense":
        raise ValueError("the dense control has no compressed entries to leave out")
    for depth in depths:
        check_depth(depth)
    questions = []
    for depth in depths:
        g = _question_generator(length, depth, seed)
        questions += [retrieval_sample(data, tokenizer, length, depth, g) for _ in range(samples)]

    def score(window_only: frozenset[int]) -> dict[str, float]:
        nll, exact = 0.0, 0
        for q in questions:
            logits = model(torch.tensor([q.ids]),
                           instruments=Instruments(window_only=window_only)).logits
            logp = F.log_softmax(logits[0, q.answer_start - 1 : -1].double(), dim=-1)
            answer = torch.tensor(q.ids[q.answer_start :])
            nll += -logp.gather(-1, answer[:, None]).mean().item()
            exact += bool((logp.argmax(-1) == answer).all())
        return {"answer_nll": nll / len(questions), "accuracy": exact / len(questions)}

    layers = [{"layer": None, **score(frozenset())}]
    for spec in model.config.layers:
        if spec.ratio:
            layers.append({"layer": spec.index, "mode": str(spec.mode), "ratio": spec.ratio,
                           **score(frozenset({spec.index}))})
    return {"length": length, "depths": depths, "samples": samples, "layers": layers}


@torch.no_grad()
def selection(model: Model, tokenizer: Any, data: TokenCache, lengths: list[int],
              depths: list[float], samples: int, seed: int = 0,
              forms: str = "held-out", trunk_picks: bool = False,
              logit_scale: dict[int, float] | None = None) -> dict[str, Any]:
    """Whether a wrong answer is the indexer's choice or the read, on the questions
    `retrieval` asks: for each layer that picks its own top-k, at the query that predicts
    the answer's first token, the share of the definition's compressed entries its top-k
    holds (`selected`) and the share of its compressed attention, summed over heads, that
    lands on them (`mass`), and the same for the entries of the value's own tokens
    (`value_selected`, `value_mass`); with whether the answer is exact, teacher-forced in
    the reference forward as `knockout` scores it. By length: the means, and per layer the
    exact answers among questions where its top-k held some entry of the value (`found`,
    [exact, questions]) and where it held none (`missed`); and every question's figures
    (`questions`). `trunk_picks`: each picking layer ranks entries by its own attention
    logits instead of its indexer's scores (what a perfect indexer would buy);
    `logit_scale`: layer -> a factor on its attention logits (what a sharper read would)."""
    if model.config.arch == "dense":
        raise ValueError("the dense control has no top-k selection to probe")
    chosen = families(forms)
    for depth in depths:
        check_depth(depth)
    pickers = [s for s in model.config.layers if s.ratio and s.index_source == s.index]
    rows = []
    for length in lengths:
        questions = []
        for depth in depths:
            g = _question_generator(length, depth, seed)
            for _ in range(samples):
                sample = retrieval_sample(data, tokenizer, length, depth, g, families=chosen)
                questions.append(_selection_of(model, sample, pickers, trunk_picks,
                                               logit_scale))
        layers = []
        for spec in pickers:
            key = str(spec.index)
            found = [q["exact"] for q in questions if q["value_selected"][key] > 0]
            missed = [q["exact"] for q in questions if q["value_selected"][key] == 0]
            layers.append({"layer": spec.index, "mode": str(spec.mode), "ratio": spec.ratio,
                           **{name: fmean(q[name][key] for q in questions)
                              for name in ("selected", "mass", "value_selected",
                                           "value_mass")},
                           "found": [sum(found), len(found)],
                           "missed": [sum(missed), len(missed)]})
        rows.append({"length": length,
                     "exact": fmean(q["exact"] for q in questions),
                     "layers": layers, "questions": questions})
    return {"depths": depths, "samples": samples, "families": [f.name for f in chosen],
            "index_topk": model.config.index_topk, "trunk_picks": trunk_picks,
            "logit_scale": {str(k): v for k, v in (logit_scale or {}).items()}, "lengths": rows}


def _selection_of(model: Model, sample: Any, pickers: list[Any], trunk_picks: bool = False,
                  logit_scale: dict[int, float] | None = None) -> dict[str, Any]:
    """One question's figures for `selection`."""
    out = model(torch.tensor([sample.ids]), collect=True,
                instruments=Instruments(trunk_picks=trunk_picks,
                                        logit_scale=dict(logit_scale or {})))
    at = sample.answer_start - 1  # the query that predicts the answer's first token
    answer = torch.tensor(sample.ids[sample.answer_start :])
    exact = bool((out.logits[0, at:-1].argmax(-1) == answer).all())
    figures: dict[str, dict[str, float]] = {name: {} for name in (
        "selected", "mass", "value_selected", "value_mass")}
    for spec in pickers:
        entries = out.index_entries[spec.index][0, at]  # [k], -1 for none
        target = out.attention_targets[spec.index][0, at]  # [k], over the entries picked
        for prefix, (first, end) in (("", sample.definition), ("value_", sample.value)):
            # the entries holding tokens first..end-1, whose groups are r tokens each
            lo, hi = first // spec.ratio, (end - 1) // spec.ratio
            on = (entries >= lo) & (entries <= hi)
            figures[prefix + "selected"][str(spec.index)] = int(on.sum()) / (hi - lo + 1)
            figures[prefix + "mass"][str(spec.index)] = float(target[on].sum())
    return {"depth": sample.depth, "family": sample.family, "exact": exact, **figures}


def _question_generator(length: int, depth: float, seed: int) -> torch.Generator:
    """The generator of the retrieval questions at one length and depth: `retrieval` and
    `knockout` ask the same ones."""
    return torch.Generator().manual_seed(seed * 1_000_003 + length * 101 + round(depth * 100))


class Answered(NamedTuple):
    exact: bool  # greedy decoding reproduces every answer token
    nll: float  # nats, summed over the answer's tokens
    tokens: int  # the answer's tokens
    first_wrong: int | None  # the first answer token greedy decoding gets wrong
    chose: int | None  # the token it chose there


def _answers(model: Model, ids: list[int], answer_start: int, replay: str) -> Answered:
    """Whether greedy decoding after the question reproduces the answer's tokens, and the
    answer's negative log-likelihood with each answer token fed back whatever the model
    chose: a measure that moves before the greedy answer is exact."""
    answer = ids[answer_start:]
    cache = ContiguousCache(model.config, max_tokens=len(ids) + 1)
    logits = model.prefill(torch.tensor([ids[:answer_start]]), cache, replay=replay)
    first_wrong, chose, nll = None, None, 0.0
    for i, expected in enumerate(answer):
        top = int(logits.argmax(-1))
        if top != expected and first_wrong is None:
            first_wrong, chose = i, top
        nll -= float(torch.log_softmax(logits.float().reshape(-1), -1)[expected])
        if i + 1 < len(answer):
            logits = model.decode(torch.tensor([expected]), cache)
    return Answered(first_wrong is None, nll, len(answer), first_wrong, chose)


def heat_map(result: dict[str, Any], path: str | Path) -> None:
    """Accuracy by context length (rows) and depth (columns) as a PNG."""
    try:
        import matplotlib
    except ImportError as e:
        raise ValueError("the heat map needs matplotlib: pip install -e '.[bench]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.2 + 0.8 * len(result["depths"]),
                                    1.2 + 0.5 * len(result["lengths"])))
    image = ax.imshow(result["accuracy"], vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(result["depths"])), [f"{d:.0%}" for d in result["depths"]])
    ax.set_yticks(range(len(result["lengths"])), [str(n) for n in result["lengths"]])
    ax.set_xlabel("depth of the key")
    ax.set_ylabel("context length (tokens)")
    for i, row in enumerate(result["accuracy"]):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.0%}", ha="center", va="center",
                    color="white" if value < 0.6 else "black", fontsize=8)
    fig.colorbar(image, ax=ax, label="accuracy")
    ax.set_title("retrieval accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
