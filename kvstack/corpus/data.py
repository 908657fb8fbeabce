"""Training and evaluation data with no download: the running interpreter's standard library.

- The corpus: every `.py` file under the standard library (site-packages excluded), in
  sorted order of relative path; files that are not UTF-8 are skipped.
- The held-out split: a file is held out when the SHA-256 of its relative path falls in the
  first `heldout_percent` percent, so a file is never in both halves and the split does not
  depend on the file order or count.
- The tokenizer: byte-level BPE trained with `tokenizers` on the training half, with
  <|bos|>, <|eos|> and <|pad|>.
- The token cache: each half encoded once (files joined by <|eos|>) into an int32 array on
  disk next to a manifest; later runs read it back.
- Batches: windows of seq_len + 1 tokens at positions drawn from a generator seeded by
  (seed, step), so a resumed run sees exactly the data it would have seen.
- Retrieval samples, mixed in at `retrieval_rate`: a key assigned a random value early in
  a window of real code and asked for at its end (`assert KEY_... == "`, or the forms of
  other families: `kvstack.corpus.families`), with the depth, the length and where the
  definitions lie recorded, so retrieval can be scored and the definitions left out of the
  loss; training samples can hold several keys.
"""

import hashlib
import json
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvstack.corpus.families import KEY, Family, plant

SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")
MIN_VOCAB = 256 + len(SPECIALS)  # the byte-level alphabet and the special tokens


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | None = None) -> list[Path]:
    """Relative paths of the corpus's Python files, in a deterministic order."""
    root = root or stdlib_root()
    return sorted(p.relative_to(root) for p in root.rglob("*.py")
                  if "site-packages" not in p.parts)


def is_heldout(relative_path: Path, heldout_percent: float) -> bool:
    digest = hashlib.sha256(relative_path.as_posix().encode()).digest()
    return int.from_bytes(digest[:8], "big") % 10_000 < heldout_percent * 100


def read_source(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def split_corpus(root: Path | None = None,
                 heldout_percent: float = 2.0) -> tuple[list[Path], list[Path]]:
    """(train, heldout) relative paths."""
    if not 0 < heldout_percent < 100:
        raise ValueError(f"heldout_percent {heldout_percent} must lie strictly between 0 and "
                         "100 (both halves need files)")
    files = corpus_files(root)
    heldout = [f for f in files if is_heldout(f, heldout_percent)]
    train = [f for f in files if not is_heldout(f, heldout_percent)]
    return train, heldout


def train_tokenizer(root: Path, files: list[Path], vocab_size: int, out: Path):
    """Byte-level BPE over the training files; saved as tokenizer.json at `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    texts = (t for t in (read_source(root / f) for f in files) if t is not None)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out))
    return tokenizer


@dataclass
class TokenCache:
    """One half of the corpus as a flat token stream."""

    tokens: np.ndarray  # int32 [n_tokens]
    files: list[str]

    @classmethod
    def build(cls, root: Path, files: list[Path], tokenizer, path: Path) -> "TokenCache":
        """Encode once and write `path` (.npy) and its manifest; read them back after."""
        manifest_path = path.with_suffix(".json")
        key = hashlib.sha256("\n".join(f.as_posix() for f in files).encode()
                             + tokenizer.to_str().encode()).hexdigest()
        if path.exists() and manifest_path.exists():
            manifest = json.loads(manifest_path.read_text())
            if manifest.get("key") == key:
                return cls(np.load(path), manifest["files"])
        eos = tokenizer.token_to_id("<|eos|>")
        ids: list[int] = []
        kept = []
        for f in files:
            text = read_source(root / f)
            if text is None:
                continue
            ids += [*tokenizer.encode(text).ids, eos]
            kept.append(f.as_posix())
        tokens = np.asarray(ids, dtype=np.int32)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, tokens)
        manifest_path.write_text(json.dumps({"key": key, "files": kept,
                                             "n_tokens": int(tokens.size)}))
        return cls(tokens, kept)

    def batch(self, batch_size: int, seq_len: int, seed: int, step: int) -> torch.Tensor:
        """[batch_size, seq_len + 1] windows, the same for the same (seed, step)."""
        if self.tokens.size <= seq_len + 1:
            raise ValueError(f"the token stream ({self.tokens.size} tokens) is shorter than "
                             f"one window of {seq_len + 1}")
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, self.tokens.size - seq_len - 1, (batch_size,), generator=g)
        rows = [self.tokens[s : s + seq_len + 1] for s in starts.tolist()]
        return torch.from_numpy(np.stack(rows).astype(np.int64))


@dataclass(frozen=True)
class RetrievalSample:
    ids: list[int]  # the whole sample, the answer last
    answer_start: int  # index in ids where the value's tokens begin
    depth: float  # where the key was defined, as a fraction of the sample
    length: int
    defines: list[tuple[int, int]] = field(default_factory=list)  # [start, end) in ids
    family: str = ""  # the written form of the scored key (kvstack.corpus.families)
    # The scored key's definition, and the tokens in it that carry its value: [start, end)
    # in ids.
    definition: tuple[int, int] = (0, 0)
    value: tuple[int, int] = (0, 0)
    # Every key's answer tokens, asked in turn at the end, the scored one last: [start,
    # end) in ids.
    answers: list[tuple[int, int]] = field(default_factory=list)


def check_depth(depth: float) -> None:
    """A retrieval key's depth is a fraction of the sample."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth {depth} must lie in [0, 1] (a fraction of the sample)")


def retrieval_sample(cache: TokenCache, tokenizer, length: int, depth: float,
                     generator: torch.Generator, extra_keys: int = 0,
                     families: tuple[Family, ...] = (KEY,)) -> RetrievalSample:
    """Real code of `length` tokens with a key's value planted at `depth` and asked for at
    the end (`KEY_<n> = "<value>"` ... `assert KEY_<n> == "<value>"` by default; each key
    of another family's form, drawn from `families`); the model is scored on the value.

    Training samples may carry `extra_keys` more keys, defined at random depths and asked
    (answers included) just before the scored one: more answer tokens per sample, since one
    key's answer is a handful of tokens among hundreds."""
    check_depth(depth)
    forms = []
    keys = []
    for _ in range(extra_keys + 1):
        forms.append(_pick(families, generator))
        keys.append(plant(forms[-1], generator))
    depths = [float(torch.rand((), generator=generator)) for _ in range(extra_keys)] + [depth]
    encoded = [tokenizer.encode(k.define) for k in keys]
    defines = [e.ids for e in encoded]
    questions = [tokenizer.encode(k.question).ids for k in keys]
    answers = [tokenizer.encode(k.answer).ids for k in keys]
    filler = length - sum(len(t) for t in (*defines, *questions, *answers))
    if filler < 2:
        raise ValueError(f"a retrieval sample of {length} tokens has no room for its code")
    start = int(torch.randint(0, cache.tokens.size - filler, (1,), generator=generator))
    code = cache.tokens[start : start + filler].tolist()
    ids: list[int] = []
    spans = []
    done = 0
    scored = len(keys) - 1
    for at, i in sorted(zip((round(d * filler) for d in depths), range(len(keys)),
                            strict=True), key=lambda pair: pair[0]):
        ids += code[done:at]
        spans.append((len(ids), len(ids) + len(defines[i])))
        if i == scored:
            definition = spans[-1]
        ids += defines[i]
        done = at
    ids += code[done:]
    asked = []
    for question, answer in zip(questions, answers, strict=True):
        ids += question
        asked.append((len(ids), len(ids) + len(answer)))
        ids += answer
    value = _value_tokens(keys[-1].define, keys[-1].answer[: len(keys[-1].answer)
                                                             - len(forms[-1].closing)],
                          encoded[-1].offsets)
    return RetrievalSample(ids, len(ids) - len(answers[-1]), depth, length, spans,
                           forms[-1].name, definition,
                           (definition[0] + value[0], definition[0] + value[1]), asked)


def _value_tokens(define: str, value: str,
                  offsets: list[tuple[int, int]]) -> tuple[int, int]:
    """[first, end) of the definition's tokens whose text overlaps the value's."""
    lo = define.rindex(value)
    hi = lo + len(value)
    touching = [i for i, (a, b) in enumerate(offsets) if a < hi and b > lo]
    return touching[0], touching[-1] + 1


def _pick(families: tuple[Family, ...], generator: torch.Generator) -> Family:
    # One family draws nothing: the single-form recipe's samples stay what they were.
    if len(families) == 1:
        return families[0]
    return families[int(torch.randint(0, len(families), (1,), generator=generator))]
