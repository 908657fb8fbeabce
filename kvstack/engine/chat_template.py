"""Chat templates: how a list of messages becomes one prompt.

A model directory may hold `chat_template.json`:
`{"message": "{role}: {content}\\n", "generation": "assistant:", "stop": ["\\nuser:"]}` --
each message rendered by `message` (Python format fields `role` and `content`), then the
`generation` prefix the reply follows, and stop strings that end a reply where the next
turn would begin. Without one, the Jinja template a Hugging Face model ships in
`tokenizer_config.json` (`chat_template`) is used, rendered as transformers does
(`messages`, `add_generation_prompt`, `tools`, `bos_token`, `eos_token`, in jinja2's
sandbox); its replies end at the end-of-sequence token. A model with neither gets
`DEFAULT_TEMPLATE`, the plain form above (the bundled model, trained on source code, has
no chat tuning; the form only keeps turns apart).

In the plain form an assistant message is rendered as it was generated: the `generation`
prefix, then the content exactly as the model wrote it (its leading space included), then
what `message` puts after {content}. So a conversation an OpenAI client sends back renders
to a text that starts with what the model saw and wrote, and a session continues it
instead of starting over. Tools are listed to the model in a system message first
(`tools: [...]`); a Jinja template gets them as `tools`.
"""

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

TEMPLATE_FILE = "chat_template.json"
HF_CONFIG = "tokenizer_config.json"  # where a Hugging Face model keeps its Jinja template


@dataclass(frozen=True)
class ChatTemplate:
    message: str = "{role}: {content}\n"
    generation: str = "assistant:"
    stop: tuple[str, ...] = ("\nuser:", "\nsystem:")
    source: ClassVar[str | None] = None  # no Jinja text to tell a tool-call syntax by

    @classmethod
    def for_model(cls, model_dir: Path | None) -> "ChatTemplate | JinjaTemplate":
        path = model_dir / TEMPLATE_FILE if model_dir is not None else None
        if path is None or not path.is_file():
            if model_dir is not None and (model_dir / HF_CONFIG).is_file():
                jinja = JinjaTemplate.from_config(model_dir / HF_CONFIG)
                if jinja is not None:
                    return jinja
            return DEFAULT_TEMPLATE
        try:
            data = json.loads(path.read_text())
            template = cls(str(data["message"]), str(data.get("generation", "")),
                           tuple(data.get("stop", ())))
            template.render([{"role": "user", "content": "check"}])
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise ValueError(f"{path}: not a chat template ({type(e).__name__}: {e}); it "
                             "holds \"message\" with {role} and {content}, \"generation\" "
                             "and \"stop\"") from None
        return template

    def render(self, messages: list[dict[str, str]],
               tools: list[dict[str, Any]] | None = None) -> str:
        if tools:
            messages = [{"role": "system", "content": "tools: " + json.dumps(tools)},
                        *messages]
        after_content = self.message.partition("{content}")[2]
        return "".join(
            self.generation + m["content"] + after_content.format(role=m["role"])
            if m["role"] == "assistant" and self.generation
            else self.message.format(role=m["role"], content=m["content"])
            for m in messages) + self.generation


DEFAULT_TEMPLATE = ChatTemplate()


class JinjaTemplate:
    """A Hugging Face chat template (Jinja), rendered in jinja2's sandbox."""

    stop: tuple[str, ...] = ()  # the end-of-sequence token ends a reply

    def __init__(self, source: str, bos_token: str, eos_token: str,
                 tool_source: str | None = None) -> None:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(source)
        self._tool_template = env.from_string(tool_source) if tool_source else None
        # The Jinja text (with the tool_use template's): what it writes tells the syntax
        # of the model's tool calls (`kvstack.serve.tool_calls.detect`).
        self.source = "\n".join(t for t in (source, tool_source) if t)
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_config(cls, path: Path) -> "JinjaTemplate | None":
        """The template of a tokenizer_config.json, or None if it has none."""
        try:
            config = json.loads(path.read_text())
            source = config.get("chat_template")
            if source is None:
                return None
            tool_source = None
            if isinstance(source, list):  # named templates: "default", "tool_use"
                named = {t["name"]: t["template"] for t in source}
                source, tool_source = named.get("default"), named.get("tool_use")
                source = source or tool_source
            return cls(source, _token(config.get("bos_token")),
                       _token(config.get("eos_token")), tool_source)
        except Exception as e:  # json, jinja2's syntax errors, a malformed entry
            raise ValueError(f"{path}: its chat_template cannot be used ({type(e).__name__}: "
                             f"{e})") from None

    def render(self, messages: list[dict[str, str]],
               tools: list[dict[str, Any]] | None = None) -> str:
        from jinja2.exceptions import TemplateError

        template = self._tool_template if tools and self._tool_template else self._template
        try:
            return template.render(
                messages=messages, add_generation_prompt=True, bos_token=self.bos_token,
                eos_token=self.eos_token,
                tools=[{"type": "function", "function": t} for t in tools] if tools else None)
        except TemplateError as e:
            raise ValueError(f"the model's chat template refused the messages: {e}") from None


def _token(value: Any) -> str:
    """A special token of tokenizer_config.json: a string, or {"content": ...}."""
    return value.get("content", "") if isinstance(value, dict) else (value or "")
