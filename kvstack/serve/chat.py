"""Chat templates: how a list of messages becomes one prompt.

A model directory may hold `chat_template.json`:
`{"message": "{role}: {content}\\n", "generation": "assistant:", "stop": ["\\nuser:"]}` --
each message rendered by `message` (Python format fields `role` and `content`), then the
`generation` prefix the reply follows, and stop strings that end a reply where the next
turn would begin. A model without one gets `DEFAULT_TEMPLATE`, that same plain form (the
bundled model, trained on source code, has no chat tuning; the form only keeps turns
apart). Format strings, not Jinja: no template engine is a dependency.

An assistant message is rendered as it was generated: the `generation` prefix, then the
content exactly as the model wrote it (its leading space included), then what `message`
puts after {content}. So a conversation an OpenAI client sends back renders to a text
that starts with what the model saw and wrote, and a session continues it instead of
starting over.
"""

import json
from dataclasses import dataclass
from pathlib import Path

TEMPLATE_FILE = "chat_template.json"
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatTemplate:
    message: str = "{role}: {content}\n"
    generation: str = "assistant:"
    stop: tuple[str, ...] = ("\nuser:", "\nsystem:")

    @classmethod
    def for_model(cls, model_dir: Path | None) -> "ChatTemplate":
        path = model_dir / TEMPLATE_FILE if model_dir is not None else None
        if path is None or not path.is_file():
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

    def render(self, messages: list[dict[str, str]]) -> str:
        after_content = self.message.partition("{content}")[2]
        return "".join(
            self.generation + m["content"] + after_content.format(role=m["role"])
            if m["role"] == "assistant" and self.generation
            else self.message.format(role=m["role"], content=m["content"])
            for m in messages) + self.generation


DEFAULT_TEMPLATE = ChatTemplate()
