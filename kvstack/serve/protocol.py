"""The OpenAI API's request bodies as kvstack takes them, and its error shape.

Unknown fields are refused by name (400), and so are fields of the API that kvstack does
not implement when a request sets them to anything but their "off" value: a request is
never served with a parameter silently ignored. kvstack's own fields: `top_k`,
`ignore_eos`, `return_token_ids`, `prompt_logprobs`, `cache_salt` (vLLM's names), and
`session` (a conversation kept in the cache and on disk between requests; also the
`X-Kvstack-Session` header).
"""

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvstack.engine.grammar import ANY_OBJECT
from kvstack.engine.sampling import SamplingParams
from kvstack.serve.tool_calls import ToolCall, ToolParser

# API fields kvstack does not implement, with the value that means "off".
UNSUPPORTED = {
    "best_of": (None, 1), "suffix": (None,),
    "functions": (None,), "function_call": (None,), "modalities": (None, ["text"]),
    "audio": (None,), "prediction": (None,), "service_tier": (None, "auto", "default"),
    "reasoning_effort": (None,), "store": (None, False), "metadata": (None, {}),
}


class APIError(Exception):
    """An error answered as the OpenAI API does: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind, self.code, self.headers = kind, code, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # extras are refused by name in `check`

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    return_token_ids: bool = False
    min_tokens: int = Field(0, ge=0)  # vLLM's
    stop_token_ids: list[int] | None = None  # vLLM's
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (as a string) -> bias
    # OpenAI's: {"type": "text" | "json_object"} or {"type": "json_schema", "json_schema":
    # {"name", "schema", "strict"}}: the reply held to the schema token by token.
    response_format: dict[str, Any] | None = None
    session: str | None = Field(None, min_length=1, max_length=200)
    user: str | None = None  # an end-user id for the operator's logs; it changes nothing
    # vLLM's: requests hit only prefix-cache blocks written under the same salt.
    cache_salt: str | None = Field(None, min_length=1, max_length=256)

    def check(self) -> None:
        """Refuse unknown fields and unsupported ones that are set, by name."""
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED:
                if value not in UNSUPPORTED[name]:
                    raise APIError(400, f"{name} is not supported by kvstack", name,
                                   code="unsupported_parameter")
            else:
                raise APIError(400, f"unknown parameter {name!r}", name,
                               code="unknown_parameter")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options needs stream: true", "stream_options")
        if self.session is not None and self.n > 1:
            raise APIError(400, "a session continues one conversation: n must be 1", "n")

    def top_logprobs_wanted(self) -> int | None:
        """Log-probabilities asked for: None, or how many of the likeliest tokens."""
        raise NotImplementedError

    def tool_grammar(self, parser: ToolParser) -> dict[str, str] | None:
        """The grammar a tool call must follow (chat requests with tools); None here."""
        return None

    def _grammar(self, parser: ToolParser) -> dict[str, str]:
        """The SamplingParams fields of the reply's grammar: of a tool call that is due,
        or of response_format; none for free text."""
        tools = self.tool_grammar(parser)
        if tools is not None:
            if (self.response_format or {"type": "text"}).get("type") != "text":
                raise APIError(400, "a reply cannot be held to both a tool call and "
                               "response_format", "response_format")
            return tools
        fmt = self.response_format or {"type": "text"}
        kind = fmt.get("type")
        if kind == "text":
            return {}
        if kind == "json_object":
            return {"json_schema": ANY_OBJECT}
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise APIError(400, "response_format.json_schema.schema: a JSON schema "
                               "object is needed", "response_format")
            return {"json_schema": json.dumps(schema)}
        raise APIError(400, f"response_format.type {kind!r}: kvstack takes text, "
                       "json_object and json_schema", "response_format")

    def _logit_bias(self) -> tuple[tuple[int, float], ...]:
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not key.isdigit():
                raise APIError(400, f"logit_bias: {key!r} is not a token id", "logit_bias")
            pairs.append((int(key), bias))
        return tuple(pairs)

    def sampling(self, max_tokens: int, extra_stop: tuple[str, ...],
                 parser: ToolParser) -> SamplingParams:
        """The request's sampling parameters; a tool call that is due is held to
        `parser`'s syntax."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=self.temperature,
                                  top_p=self.top_p, top_k=max(self.top_k, 0), seed=self.seed,
                                  stop=stop + extra_stop, ignore_eos=self.ignore_eos,
                                  presence_penalty=self.presence_penalty,
                                  frequency_penalty=self.frequency_penalty,
                                  repetition_penalty=self.repetition_penalty,
                                  logprobs=self.top_logprobs_wanted(),
                                  min_tokens=self.min_tokens,
                                  stop_token_ids=tuple(self.stop_token_ids or ()),
                                  logit_bias=self._logit_bias(),
                                  **self._grammar(parser))
        except ValueError as e:  # "SamplingParams: <field> must ..."
            message = str(e).removeprefix("SamplingParams: ")
            raise APIError(400, message, message.split(" ", 1)[0]) from None


class CompletionRequest(_Request):
    # One prompt (text or token ids) or several, each its own choices (n of them).
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # the OpenAI API's default; 0: score only
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False  # the prompt before the completion, and its logprobs with `logprobs`
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's: per prompt token

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, one or several."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return list(p)
        return [p]


# What a chat's image part renders as in the template's text (a private-use character
# pair no tokenizer merges with its neighbours), where its image token goes.
IMAGE_MARK = "\ue000image\ue001"


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool's answer to that call

    def text(self, parser: ToolParser, image_mark: str | None = None) -> str:
        """The message as the template renders it: its text, or an assistant's tool calls
        as the model writes them (in `parser`'s syntax). Its image parts become
        `image_mark` where the caller takes images (refused elsewhere)."""
        if self.tool_calls:
            calls = []
            for call in self.tool_calls:
                function = call.get("function") or {}
                try:
                    arguments = json.loads(function.get("arguments") or "{}")
                except (TypeError, ValueError):
                    arguments = None
                if not isinstance(arguments, dict) or not isinstance(function.get("name"),
                                                                      str):
                    raise APIError(400, "messages: a tool call is {\"function\": {\"name\", "
                                   "\"arguments\"}} with its arguments a JSON object",
                                   "messages")
                calls.append(ToolCall(function["name"], arguments))
            return parser.render(calls)
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") == "image_url" and image_mark is not None:
                parts.append(image_mark)
            elif part.get("type") == "text" and isinstance(part.get("text"), str):
                if image_mark is not None and image_mark in part["text"]:
                    raise APIError(400, "messages: a text part holds the server's image "
                                   "placeholder", "messages")
                parts.append(part["text"])
            else:
                raise APIError(400, "content parts are {\"type\": \"text\", \"text\": ...} "
                               "and, in chat completions, {\"type\": \"image_url\", "
                               "\"image_url\": {\"url\": \"data:...\"}}", "messages")
        return "".join(parts)

    def image_urls(self) -> list[str]:
        """The URLs of its image parts, in order."""
        if not isinstance(self.content, list):
            return []
        urls = []
        for part in self.content:
            if part.get("type") != "image_url":
                continue
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str):
                raise APIError(400, "messages: an image part is {\"type\": \"image_url\", "
                               "\"image_url\": {\"url\": \"data:image/...;base64,...\"}}",
                               "messages")
            urls.append(url)
        return urls


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages through the model's template."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = False  # kvstack's tokenizers add none either way


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None  # OpenAI's: {"type": "function", "function"}
    tool_choice: str | dict[str, Any] | None = None  # none | auto | required | a function
    # A call that is due is one call; a reply the model writes freely (auto) may hold
    # several, as its syntax allows.
    parallel_tool_calls: bool | None = None

    def functions(self) -> dict[str, dict[str, Any]]:
        """The tools' functions by name, checked; empty when tools are off."""
        if not self.tools or self.tool_choice == "none":
            return {}
        functions = {}
        for tool in self.tools:
            function = tool.get("function") if tool.get("type") == "function" else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise APIError(400, "tools: each is {\"type\": \"function\", \"function\": "
                               "{\"name\", \"parameters\"}}", "tools")
            parameters = function.get("parameters", {"type": "object"})
            if not isinstance(parameters, dict):
                raise APIError(400, f"tools: {function['name']}'s parameters are not a "
                               "JSON schema", "tools")
            functions[function["name"]] = {**function, "parameters": parameters}
        return functions

    def tool_grammar(self, parser: ToolParser) -> dict[str, str] | None:
        """The grammar a reply must follow when it must call a tool (tool_choice required
        or a named function): one call of one of them in `parser`'s syntax. None when the
        model may answer in text (auto: the calls it writes are found by the parser)."""
        functions, choice = self.functions(), self.tool_choice or "auto"
        if not functions or choice == "auto":
            return None
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name")
            if name not in functions:
                raise APIError(400, f"tool_choice names {name!r}, which is not among the "
                               "tools", "tool_choice")
            functions = {name: functions[name]}
        elif choice != "required":
            raise APIError(400, f"tool_choice {choice!r}: none, auto, required or "
                           "{\"type\": \"function\", \"function\": {\"name\"}}",
                           "tool_choice")
        key = parser.arguments_key
        options = [{"type": "object", "additionalProperties": False,
                    "required": ["name", key],
                    "properties": {"name": {"const": name}, key: function["parameters"]}}
                   for name, function in functions.items()]
        return parser.constraint(options[0] if len(options) == 1 else {"anyOf": options})

    def top_logprobs_wanted(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None
