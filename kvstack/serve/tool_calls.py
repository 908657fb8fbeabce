"""Tool calls in a model's own syntax: found in its replies, held to it when a call is due.

A model tuned for tools writes its calls in the syntax its chat template taught it; the
server reads them out of the reply by the parser of that syntax (`--tool-call-parser`,
vLLM's names), or by the one the template's text names unambiguously:

- `json` (kvstack's own, the plain template's): the whole reply is `{"name", "arguments"}`
  (or a list of them);
- `hermes` (Hermes, Qwen): `<tool_call>{"name", "arguments"}</tool_call>`, any number,
  text around them;
- `llama3_json` (Llama 3.1+): the reply is `{"name", "parameters"}`, after an optional
  `<|python_tag|>`, several separated by `;`;
- `mistral`: `[TOOL_CALLS][{"name", "arguments"}, ...]` after any text.

A parser answers four questions: which calls a finished reply holds and the text around
them (a malformed call, or one of a function not offered, leaves the whole reply as text);
how much of a reply still being written is text for sure (what a stream may send before a
call's start marker shows up); how calls sent back in a conversation's history are
written (as the model would have written them, so the history reads as it was); and
what a reply must look like when a call is due (tool_choice required or a named
function): the grammar of one call in the syntax.
"""

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        """The call as the OpenAI API returns it (the arguments as JSON text)."""
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}


@dataclass(frozen=True)
class Parsed:
    """A finished reply that called tools: the text around the calls (None if only
    whitespace), and the calls in order."""

    content: str | None
    calls: list[ToolCall]


class ToolParser:
    """One model family's tool-call syntax."""

    name: ClassVar[str]
    arguments_key: ClassVar[str] = "arguments"  # where a call's arguments are

    def parse(self, text: str, functions: Mapping[str, Any]) -> Parsed | None:
        """The calls of a finished reply, or None if it holds none or a malformed one."""
        raise NotImplementedError

    def text_end(self, text: str) -> int:
        """How much of a reply being written is text whatever comes next: up to the
        start of a call, less a tail that may be the start of a marker."""
        raise NotImplementedError

    def render(self, calls: list[ToolCall]) -> str:
        """Calls as this syntax writes them (an assistant turn sent back in the history)."""
        raise NotImplementedError

    def constraint(self, call_schema: dict[str, Any]) -> dict[str, str]:
        """The SamplingParams fields that hold a reply to one call whose JSON follows
        `call_schema`."""
        return {"json_schema": json.dumps(call_schema)}

    def _call(self, value: Any, functions: Mapping[str, Any]) -> ToolCall | None:
        """A call of one of the functions, from its decoded JSON, or None."""
        if not isinstance(value, dict) or value.get("name") not in functions:
            return None
        arguments = value.get(self.arguments_key)
        return ToolCall(value["name"], arguments) if isinstance(arguments, dict) else None

    def _calls(self, values: list[Any], functions: Mapping[str, Any]) -> list[ToolCall] | None:
        calls = [self._call(v, functions) for v in values]
        return calls if calls and None not in calls else None

    def _json(self, call: ToolCall) -> str:
        return json.dumps({"name": call.name, self.arguments_key: call.arguments})


def _decode_all(text: str, separator: str = "") -> list[Any] | None:
    """The JSON values `text` holds one after another (whitespace and, between them, the
    separator allowed), or None if anything else is in it."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        at = len(text) - len(text[at:].lstrip())
        if at == len(text):
            return values or None
        if values and separator:
            if not text.startswith(separator, at):
                return None
            at = len(text) - len(text[at + len(separator):].lstrip())
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)


class JsonParser(ToolParser):
    """kvstack's own form: the whole reply is a call (or a list of calls) as JSON."""

    name = "json"

    def parse(self, text: str, functions: Mapping[str, Any]) -> Parsed | None:
        values = _decode_all(text)
        if values is None or len(values) != 1:
            return None
        value = values[0]
        calls = self._calls(value if isinstance(value, list) else [value], functions)
        return Parsed(None, calls) if calls else None

    def text_end(self, text: str) -> int:
        stripped = text.lstrip()
        return 0 if not stripped or stripped[0] in "{[" else len(text)

    def render(self, calls: list[ToolCall]) -> str:
        values = [{"name": c.name, "arguments": c.arguments} for c in calls]
        return json.dumps(values[0] if len(values) == 1 else values)


class _MarkedParser(ToolParser):
    """A syntax whose calls start at a marker, after any text."""

    start: ClassVar[str]

    def text_end(self, text: str) -> int:
        at = text.find(self.start)
        if at >= 0:
            return at
        for n in range(min(len(text), len(self.start) - 1), 0, -1):
            if self.start.startswith(text[-n:]):  # the marker may be starting
                return len(text) - n
        return len(text)


class HermesParser(_MarkedParser):
    """Hermes and Qwen: `<tool_call>\\n{"name", "arguments"}\\n</tool_call>` blocks."""

    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def parse(self, text: str, functions: Mapping[str, Any]) -> Parsed | None:
        blocks = list(self._block.finditer(text))
        if not blocks:
            return None
        values = []
        for block in blocks:
            decoded = _decode_all(block.group(1))
            if decoded is None or len(decoded) != 1:
                return None
            values.append(decoded[0])
        calls = self._calls(values, functions)
        if calls is None:
            return None
        return Parsed(self._block.sub("", text).strip() or None, calls)

    def render(self, calls: list[ToolCall]) -> str:
        return "\n".join(f"{self.start}\n{self._json(c)}\n{self.end}" for c in calls)

    def constraint(self, call_schema: dict[str, Any]) -> dict[str, str]:
        return {"structural_tag": json.dumps({"type": "structural_tag", "format": {
            "type": "tag", "begin": f"{self.start}\n",
            "content": {"type": "json_schema", "json_schema": call_schema},
            "end": f"\n{self.end}"}})}


class Llama3JsonParser(ToolParser):
    """Llama 3.1+: the reply is `{"name", "parameters"}` (`;` between several), after an
    optional `<|python_tag|>`."""

    name = "llama3_json"
    arguments_key = "parameters"
    start = "<|python_tag|>"

    def parse(self, text: str, functions: Mapping[str, Any]) -> Parsed | None:
        body = text.lstrip().removeprefix(self.start)
        values = _decode_all(body, ";")
        calls = self._calls(values, functions) if values else None
        return Parsed(None, calls) if calls else None

    def text_end(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or stripped[0] == "{" or stripped.startswith(self.start) or (
                self.start.startswith(stripped)):
            return 0
        return len(text)

    def render(self, calls: list[ToolCall]) -> str:
        return "; ".join(self._json(c) for c in calls)

    def _call(self, value: Any, functions: Mapping[str, Any]) -> ToolCall | None:
        # Llama's own template writes "parameters"; some fine-tunes write "arguments".
        if isinstance(value, dict) and "parameters" not in value and "arguments" in value:
            value = {**value, "parameters": value["arguments"]}
        return super()._call(value, functions)


class MistralParser(_MarkedParser):
    """Mistral: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}`."""

    name = "mistral"
    start = "[TOOL_CALLS]"

    def parse(self, text: str, functions: Mapping[str, Any]) -> Parsed | None:
        before, marker, after = text.partition(self.start)
        if not marker:
            return None
        values = _decode_all(after.replace(self.start, " "))
        if values is None:
            return None
        flat = [v for value in values for v in (value if isinstance(value, list) else [value])]
        calls = self._calls(flat, functions)
        return Parsed(before.strip() or None, calls) if calls else None

    def render(self, calls: list[ToolCall]) -> str:
        return self.start + json.dumps([{"name": c.name, "arguments": c.arguments}
                                        for c in calls])

    def constraint(self, call_schema: dict[str, Any]) -> dict[str, str]:
        one = {"type": "array", "items": call_schema, "minItems": 1, "maxItems": 1}
        return {"structural_tag": json.dumps({"type": "structural_tag", "format": {
            "type": "sequence", "elements": [
                {"type": "const_string", "value": self.start},
                {"type": "json_schema", "json_schema": one}]}})}


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    JsonParser, HermesParser, Llama3JsonParser, MistralParser)}

# What in a chat template's text names its syntax.
_SIGNS = {"hermes": "<tool_call>", "llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}


def detect(template_source: str | None) -> str | None:
    """The parser a chat template's text names, or None when it names none or several."""
    if template_source is None:
        return None
    named = [name for name, sign in _SIGNS.items() if sign in template_source]
    return named[0] if len(named) == 1 else None


def tool_parser(name: str | None, template_source: str | None) -> tuple[ToolParser, str]:
    """The parser by name, or (None) the one the template names, else `json`; and where
    the choice came from, for the start-up log."""
    if name is not None:
        return PARSERS[name](), "--tool-call-parser"
    found = detect(template_source)
    if found is not None:
        return PARSERS[found](), "the chat template"
    return JsonParser(), "the default"
