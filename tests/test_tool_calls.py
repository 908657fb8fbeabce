"""The tool-call parsers: finished replies, streams cut anywhere, and the grammars that
hold a due call to each syntax."""

import json

import pytest

from kvstack.serve.tool_calls import (
    PARSERS,
    HermesParser,
    JsonParser,
    Llama3JsonParser,
    MistralParser,
    ToolCall,
    detect,
    tool_parser,
)

FUNCTIONS = {"add": {"parameters": {}}, "get_weather": {"parameters": {}}}
ADD, WEATHER = ToolCall("add", {"a": 2, "b": 3}), ToolCall("get_weather", {"city": "Oslo"})

# Per parser: replies with their (content, calls), and replies that hold no call.
REPLIES = {
    "json": [
        ('{"name": "add", "arguments": {"a": 2, "b": 3}}', None, [ADD]),
        (' [{"name": "add", "arguments": {"a": 2, "b": 3}}, {"name": "get_weather", '
         '"arguments": {"city": "Oslo"}}]\n', None, [ADD, WEATHER]),
    ],
    "hermes": [
        ('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>', None,
         [ADD]),
        ('Let me look.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
         '</tool_call>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
         '</tool_call>', "Let me look.", [ADD, WEATHER]),
        # The end of the reply may come before the closing tag.
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}', None,
         [WEATHER]),
    ],
    "llama3_json": [
        ('{"name": "add", "parameters": {"a": 2, "b": 3}}', None, [ADD]),
        ('<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}; '
         '{"name": "get_weather", "arguments": {"city": "Oslo"}}', None, [ADD, WEATHER]),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}}]', None, [ADD]),
        ('Checking. [TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}}, '
         '{"name": "get_weather", "arguments": {"city": "Oslo"}}]', "Checking.",
         [ADD, WEATHER]),
    ],
}
NOT_CALLS = {
    "json": ['the answer is 5', '{"name": "add", "arguments": {"a": 2}', '{"name": "mul", '
             '"arguments": {}}', '{"name": "add", "arguments": "a=2"}',
             '{"name": "add", "arguments": {}} and more'],
    "hermes": ['no call here', '<tool_call>\n{"name": "add", "arguments": {"a": }\n'
               '</tool_call>', '<tool_call>{"name": "mul", "arguments": {}}</tool_call>',
               '<tool_call>{"name": "add", "arguments": {}}</tool_call><tool_call>oops'
               '</tool_call>', '<tool_call>{"name": "add"} {"x": 1}</tool_call>'],
    "llama3_json": ['Sure: {"name": "add", "parameters": {}}', '{"name": "add", '
                    '"parameters": [1]}', '{"name": "mul", "parameters": {}}',
                    '{"name": "add", "parameters": {}} then text'],
    "mistral": ['plain text', '[TOOL_CALLS][{"name": "add", "arguments": {"a": 2}',
                '[TOOL_CALLS][{"name": "mul", "arguments": {}}]',
                '[TOOL_CALLS][{"name": "add", "arguments": {}}] trailing'],
}


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_each_parser_finds_the_calls_and_the_text_around_them(name):
    parser = PARSERS[name]()
    for reply, content, calls in REPLIES[name]:
        parsed = parser.parse(reply, FUNCTIONS)
        assert parsed is not None, reply
        assert parsed.content == content and parsed.calls == calls, reply
        openai = [c.openai() for c in parsed.calls]
        assert [json.loads(c["function"]["arguments"]) for c in openai] == [
            c.arguments for c in calls]
        assert all(c["type"] == "function" and c["id"].startswith("call_") for c in openai)
        # What it writes back into a history reads as the same calls.
        assert parser.parse(parser.render(calls), FUNCTIONS).calls == calls
    for reply in NOT_CALLS[name]:  # malformed, unknown functions, not calls at all
        assert parser.parse(reply, FUNCTIONS) is None, reply


def stream(parser, reply: str, cuts: list[int]) -> str:
    """What a stream sends as text of `reply` arriving in pieces ending at `cuts`, as the
    server does: up to the parser's text_end of each piece, never taking any back."""
    sent = ""
    for cut in cuts:
        upto = parser.text_end(reply[:cut])
        assert upto <= cut
        sent += reply[len(sent):upto]
    return sent


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_a_stream_cut_anywhere_sends_the_text_before_a_call_and_never_its_marker(name):
    parser = PARSERS[name]()
    for reply, _, _ in REPLIES[name]:
        start = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}.get(name)
        before = reply[:reply.index(start)] if start else ""
        for cut in range(len(reply) + 1):
            # One token per character up to `cut`, then the rest at once; and two pieces.
            for cuts in ([*range(1, cut + 1), len(reply)], [cut, len(reply)]):
                sent = stream(parser, reply, cuts)
                assert sent == before, (reply, cuts, sent)
    # A tail that may begin a marker is held back until it no longer can.
    assert stream(HermesParser(), "a <tool_cal", range(1, 12)) == "a "
    assert stream(HermesParser(), "a <tool_cal x", range(1, 14)) == "a <tool_cal x"
    assert stream(MistralParser(), "ok [TOOL_CAL", range(1, 13)) == "ok "
    assert stream(MistralParser(), "[TOOL_ maybe", range(1, 13)) == "[TOOL_ maybe"
    assert stream(JsonParser(), "the answer", range(1, 11)) == "the answer"
    assert stream(Llama3JsonParser(), "  <|python", range(1, 11)) == ""
    assert stream(Llama3JsonParser(), "<|pyth no", range(1, 10)) == "<|pyth no"


def test_the_template_names_its_syntax_or_the_plain_form_is_kept():
    assert detect("{{ '<tool_call>' }}{{ message.content }}") == "hermes"
    assert detect("[TOOL_CALLS]") == "mistral" and detect("<|python_tag|>") == "llama3_json"
    assert detect("<tool_call> [TOOL_CALLS]") is None  # ambiguous
    assert detect(None) is None and detect("{{ messages }}") is None
    assert tool_parser(None, "<tool_call>")[0].name == "hermes"
    assert tool_parser(None, None)[0].name == "json"
    assert tool_parser("mistral", "<tool_call>")[0].name == "mistral"


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_a_due_call_is_held_to_the_parsers_syntax(name):
    """The grammar of a due call accepts what the parser writes, and only that shape."""
    from kvstack import SamplingParams
    from kvstack.engine.grammar import Grammars
    from kvstack.engine.tokenizer import ByteTokenizer

    parser = PARSERS[name]()
    key = parser.arguments_key
    schema = {"type": "object", "additionalProperties": False, "required": ["name", key],
              "properties": {"name": {"const": "add"}, key: {
                  "type": "object", "required": ["a", "b"], "additionalProperties": False,
                  "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
    grammars = Grammars(ByteTokenizer(), ByteTokenizer.vocab_size)

    def accepts(text: str) -> bool:
        matcher = grammars.matcher(SamplingParams(**parser.constraint(schema)))._matcher
        return matcher.accept_string(text) and matcher.accept_token(ByteTokenizer.eos_id)

    assert accepts(parser.render([ADD]))
    assert not accepts(parser.render([ADD]).replace(": ", ":  "))  # compact JSON only
    assert not accepts(parser.render([ToolCall("add", {"a": 2})]))
    assert not accepts("I will add them. " + parser.render([ADD]))


def test_a_structural_tag_that_does_not_compile_is_a_value_error():
    from kvstack import SamplingParams
    from kvstack.engine.grammar import Grammars
    from kvstack.engine.tokenizer import ByteTokenizer

    grammars = Grammars(ByteTokenizer(), ByteTokenizer.vocab_size)
    for tag in ('{"type": "structural_tag", "format": {"type": "nope"}}',
                '{"type": "structural_tag", "format": {"type": "json_schema"}}', "{not json"):
        with pytest.raises(ValueError, match="structural_tag: not a structural tag"):
            grammars.matcher(SamplingParams(structural_tag=tag))
    with pytest.raises(ValueError, match="not with json_schema"):
        SamplingParams(json_schema="{}", structural_tag="{}")
