"""Structured output: replies held to a JSON schema by xgrammar's token masks.

A request with `SamplingParams.json_schema` gets a matcher of the compiled schema. Before
each of its tokens is sampled, the tokens the grammar does not allow next are masked out
of its logits; the sampled token then advances the matcher; the reply ends when the
grammar is complete (or at the end-of-sequence token it then allows). xgrammar (vLLM's
default structured-output backend) compiles from the tokenizer's vocabulary alone, on the
CPU; it is imported on first use, so engines that never constrain a reply do not need it.
Compiled schemas are cached by their text.
"""

import functools
import json
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvstack.engine.tokenizer import Tokenizer

ANY_OBJECT = '{"type": "object"}'  # OpenAI's json_object: any JSON object


class Grammars:
    """The compiler for one tokenizer and model vocabulary, and the schemas compiled."""

    def __init__(self, tokenizer: "Tokenizer", vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size

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
    def _compiled(self, schema: str) -> Any:
        try:
            json.loads(schema)
            return self._compiler.compile_json_schema(schema, any_whitespace=False)
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"json_schema: not a schema xgrammar compiles ({e})") from None

    def matcher(self, schema: str) -> "Matcher":
        import xgrammar

        return Matcher(xgrammar.GrammarMatcher(self._compiled(schema)), self.vocab_size)


class Matcher:
    """One reply's place in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        import xgrammar

        self._matcher, self._xgr = matcher, xgrammar
        self._bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [vocab] with the tokens the grammar does not allow next at -inf."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        masked = logits.float().clone()[None]
        self._xgr.apply_token_bitmask_inplace(masked, self._bitmask.to(masked.device))
        return masked[0]

    def accept(self, token: int) -> None:
        if not self._matcher.accept_token(token):
            raise RuntimeError(f"token {token} does not follow the reply's grammar")

    @property
    def done(self) -> bool:
        return self._matcher.is_terminated()
