"""Structured output: replies held to a JSON schema by xgrammar's token masks.

A request with `SamplingParams.json_schema` gets a matcher of the compiled schema (with
`structural_tag`, of xgrammar's structural tag: text and JSON in a set shape). Before
each of its tokens is sampled, the tokens the grammar does not allow next are masked out
of its logits; the sampled token then advances the matcher; the reply ends when the
grammar is complete (or at the end-of-sequence token it then allows). xgrammar (vLLM's
default structured-output backend) compiles from the tokenizer's vocabulary alone, on the
CPU; it is imported on first use, so engines that never constrain a reply do not need it.
Compiled grammars are cached by their text.
"""

import functools
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvstack.engine.sampling import SamplingParams
    from kvstack.engine.tokenizer import Tokenizer

ANY_OBJECT = '{"type": "object"}'  # OpenAI's json_object: any JSON object


class Grammars:
    """The compiler for one tokenizer and model vocabulary, the grammars compiled, and the
    bitmask buffers of the sampler."""

    def __init__(self, tokenizer: "Tokenizer", vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._bitmasks: dict[int, torch.Tensor] = {}  # by the number of rows masked at once

    def bitmask(self, rows: int) -> torch.Tensor:
        """The bitmask buffer for `rows` constrained rows of a step: allocated on the first
        step with that many, then refilled."""
        if rows not in self._bitmasks:
            import xgrammar

            self._bitmasks[rows] = xgrammar.allocate_token_bitmask(rows, self.vocab_size)
        return self._bitmasks[rows]

    @functools.cached_property
    def _compiler(self) -> Any:
        try:
            import xgrammar
        except ImportError:
            raise ValueError("structured output needs xgrammar: pip install -e '.[serve]'") \
                from None
        vocab, kind = self.tokenizer.grammar_vocab()
        vocab_type = {"raw": xgrammar.VocabType.RAW,
                      "byte_level": xgrammar.VocabType.BYTE_LEVEL}[kind]
        eos = self.tokenizer.eos_id
        info = xgrammar.TokenizerInfo(vocab, vocab_type, vocab_size=self.vocab_size,
                                      stop_token_ids=[eos] if eos is not None else [])
        return xgrammar.GrammarCompiler(info)

    @functools.lru_cache(maxsize=64)  # noqa: B019 (one Grammars per engine, kept for its life)
    def _compiled(self, kind: str, text: str) -> Any:
        try:
            data = json.loads(text)
            if kind == "structural_tag":
                return self._compiler.compile_structural_tag(json.dumps(_compact(data)))
            return self._compiler.compile_json_schema(text, any_whitespace=False)
        except (ValueError, RuntimeError) as e:  # xgrammar's errors are among these
            what = "a schema" if kind == "json_schema" else "a structural tag"
            raise ValueError(f"{kind}: not {what} xgrammar compiles ({e})") from None

    def matcher(self, params: "SamplingParams") -> "Matcher":
        """A matcher of the params' grammar (json_schema or structural_tag)."""
        import xgrammar

        if params.structural_tag is not None:
            compiled = self._compiled("structural_tag", params.structural_tag)
        else:
            compiled = self._compiled("json_schema", params.json_schema)
        return Matcher(xgrammar.GrammarMatcher(compiled), self)


class Matcher:
    """One reply's place in its grammar."""

    def __init__(self, matcher: Any, grammars: Grammars) -> None:
        self._matcher, self.grammars = matcher, grammars

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask`: the tokens the grammar allows next."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> None:
        if not self._matcher.accept_token(token):
            raise RuntimeError(f"token {token} does not follow the reply's grammar")

    @property
    def done(self) -> bool:
        return self._matcher.is_terminated()


def _compact(node: Any) -> Any:
    """A structural tag with its JSON parts as compact as json_schema's: each JSON schema
    in it becomes the grammar xgrammar makes of it without free whitespace (xgrammar lets
    a structural tag's JSON have any whitespace, and a model that is unsure of the next
    key can fill its reply with it)."""
    import xgrammar

    if isinstance(node, list):
        return [_compact(n) for n in node]
    if not isinstance(node, dict):
        return node
    if (node.get("type") == "json_schema" and "json_schema" in node
            and node.get("style", "json") == "json"):
        grammar = xgrammar.Grammar.from_json_schema(json.dumps(node["json_schema"]),
                                                    any_whitespace=False)
        return {"type": "grammar", "grammar": str(grammar)}
    return {key: _compact(value) for key, value in node.items()}


def mask_rows(logits: torch.Tensor, rows: list[int],
              matchers: Sequence[Matcher]) -> torch.Tensor:
    """A float copy of logits[rows] ([len(rows), vocab], row j held by matchers[j]) with
    the tokens each grammar does not allow next at -inf. The matchers fill one bitmask and
    one application masks every row; only these rows are copied, so the raw logits stay
    as they are for the other rows and for log-probabilities."""
    import xgrammar

    bitmask = matchers[0].grammars.bitmask(len(rows))
    for j, matcher in enumerate(matchers):
        matcher.fill(bitmask, j)
    masked = logits[rows].float()  # indexing by a list copies
    xgrammar.apply_token_bitmask_inplace(masked, bitmask.to(masked.device))
    return masked
