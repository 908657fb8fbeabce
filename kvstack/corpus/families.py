"""Key/value retrieval in many written forms: the families a retrieval sample plants a
value in and asks it back from.

A family is one way code states a value (an assignment, a dict entry, a function that
returns it, a class attribute, a comment line, a registry call, ...) and the ways it is
asked again later. Identifiers and values are drawn at random, so no form can be learnt
by heart. `TRAINED`, `CROSSED` and `INDIRECT` are the forms the trainer may sample;
`HELD_OUT` are forms it never samples, listed here so that a retrieval score on them
measures whether the model learnt to retrieve or only to complete the forms it saw. No
trained form states a value the way a held-out one does (a keyword argument, an
assignment to a subscript, an annotation), so a held-out score is not a near-copy of a
trained one. `KEY` is the single form of the bundled model's first stage (`KEY_0042 =
"value"`) and `SIX` the six forms of its first long-context stages, kept so that those
recipes reproduce, as is `TRAINED` alone (the set of its later stages).
"""

import re
from dataclasses import dataclass

import torch

SYLLABLES = ("ka", "lo", "mer", "tin", "vo", "pra", "sel", "du", "rix", "no", "ga", "fen",
             "lu", "ob", "tra", "zen", "pi", "mok", "sa", "wel", "cor", "bi", "nu", "dex")
VALUE_LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class Family:
    """`define` plants the value; each of `asks` asks it back, the value's text
    following it, then `closing`. Templates take {name} (snake case), {upper} (upper
    case), {camel} (CamelCase), {owner} (a second snake-case name) and {value}."""

    name: str
    define: str
    asks: tuple[str, ...]
    closing: str = '"'


KEY = Family("key", '\n{key} = "{value}"\n', ('\nassert {key} == "',))

SIX = (
    Family("assignment", '\n{upper} = "{value}"\n',
           ('\nassert {upper} == "', '\nprint({upper})  # "', '\nif {upper} != "')),
    Family("dict_entry", '\n{owner} = {{"{name}": "{value}"}}\n',
           ('\nassert {owner}["{name}"] == "', '\nvalue = {owner}.get("{name}")  # "')),
    Family("function_return", '\ndef {name}():\n    return "{value}"\n',
           ('\nassert {name}() == "', '\nresult = {name}()  # "')),
    Family("class_attribute", '\nclass {camel}:\n    {name} = "{value}"\n',
           ('\nassert {camel}.{name} == "', '\nlabel = {camel}().{name}  # "')),
    Family("comment_line", "\n# {name}: {value}\n", ("\n# {name}: ", "\n# again, {name}: "),
           closing="\n"),
    Family("registry_call", '\nregister("{name}", "{value}")\n',
           ('\nassert registry["{name}"] == "', '\nlookup("{name}")  # "')),
)

# More ways of stating a value, so that what is learnt is to find the value a name was given
# rather than to complete six templates.
TRAINED = (
    *SIX,
    Family("single_quoted", "\n{name} = '{value}'\n",
           ("\nassert {name} == '", "\nprint({name})  # '"), closing="'"),
    Family("attribute_set", '\nself.{name} = "{value}"\n',
           ('\nassert self.{name} == "', '\nreturn self.{name}  # "')),
    Family("setattr_call", '\nsetattr({owner}, "{name}", "{value}")\n',
           ('\nassert getattr({owner}, "{name}") == "',)),
    Family("enum_member", '\nclass {camel}(Enum):\n    {upper} = "{value}"\n',
           ('\nassert {camel}.{upper}.value == "',)),
    Family("lambda_return", '\n{name} = lambda: "{value}"\n',
           ('\nassert {name}() == "', '\nresult = {name}()  # "')),
    Family("tuple_unpack", '\n{name}, {owner} = "{value}", None\n',
           ('\nassert {name} == "',)),
    Family("pair_list", '\n{owner} = [("{name}", "{value}")]\n',
           ('\nassert dict({owner})["{name}"] == "',)),
    Family("return_dict", '\ndef {owner}():\n    return {{"{name}": "{value}"}}\n',
           ('\nassert {owner}()["{name}"] == "',)),
    Family("method_return", '\nclass {camel}:\n    def {name}(self):\n        return "{value}"\n',
           ('\nassert {camel}().{name}() == "',)),
    Family("log_field", '\nlogger.info("{name}={value}")\n', ("\n# logged {name}=",),
           closing="\n"),
    Family("ini_comment", "\n# [{owner}]\n# {name} = {value}\n", ("\n# {owner}.{name} = ",),
           closing="\n"),
    Family("docstring", '\n    """The {name} is {value}."""\n', ("\n# the {name} is ",),
           closing="."),
)


def _asked_otherwise(name: str, trained: str, asks: tuple[str, ...]) -> Family:
    """A trained family's definition, asked back in other ways."""
    define = next(f.define for f in TRAINED if f.name == trained)
    return Family(name, define, asks)


# The same definitions read back through another spelling of the name: a name stated bare
# asked as a quoted string (`getattr`, `vars`, `__dict__`) or the reverse, and a name held
# inside a string. The trained forms above always ask a name as they stated it, so a model
# can pass them by matching the same tokens; these need the name matched across spellings.
# Their definitions are trained ones (or a plain string assignment), never a held-out way.
CROSSED = (
    _asked_otherwise("setattr_read", "setattr_call",
                     ('\nassert {owner}.{name} == "', '\nreturn {owner}.{name}  # "')),
    _asked_otherwise("attribute_getattr", "attribute_set",
                     ('\nassert getattr(self, "{name}") == "',
                      '\nassert vars(self)["{name}"] == "')),
    _asked_otherwise("class_getattr", "class_attribute",
                     ('\nassert getattr({camel}, "{name}") == "',
                      '\nassert {camel}.__dict__["{name}"] == "')),
    _asked_otherwise("registry_attribute", "registry_call", ('\nassert registry.{name} == "',)),
    _asked_otherwise("method_getattr", "method_return",
                     ('\nassert getattr({camel}(), "{name}")() == "',)),
    Family("query_string", '\n{owner} = "{name}={value}"\n',
           ('\nassert parse({owner})["{name}"] == "', '\nassert parse({owner}).{name} == "')),
)

# Values stated through a call or a second name, and bare names asked as subscripted
# strings: the definition and the question share less text still, so the model must find
# the name wherever it stands and carry the value through whatever states it. None states
# a value as a held-out form does: no keyword argument, no subscript assignment, no
# annotation.
INDIRECT = (
    _asked_otherwise("assignment_globals", "assignment", ('\nassert globals()["{upper}"] == "',)),
    _asked_otherwise("class_vars", "class_attribute", ('\nassert vars({camel})["{name}"] == "',)),
    _asked_otherwise("dict_namespace", "dict_entry",
                     ('\nassert SimpleNamespace(**{owner}).{name} == "',)),
    Family("json_text", "\n{owner} = json.loads('{{\"{name}\": \"{value}\"}}')\n",
           ('\nassert {owner}["{name}"] == "', '\nvalue = {owner}.get("{name}")  # "')),
    Family("update_call", '\n{owner}.update({{"{name}": "{value}"}})\n',
           ('\nassert {owner}["{name}"] == "', '\nassert {owner}.get("{name}") == "')),
    Family("setdefault_call", '\n{owner}.setdefault("{name}", "{value}")\n',
           ('\nassert {owner}["{name}"] == "',)),
    Family("wrapped_value", '\n{name} = str("{value}").strip()\n',
           ('\nassert {name} == "', '\nprint({name})  # "')),
    Family("chained_assignment", '\n{owner} = {name} = "{value}"\n',
           ('\nassert {name} == "', '\nassert {owner} == "')),
    Family("alias", '\n{name} = "{value}"\n{owner} = {name}\n', ('\nassert {owner} == "',)),
)

HELD_OUT = (
    Family("keyword_argument", '\nsettings = dict({name}="{value}")\n',
           ('\nassert settings["{name}"] == "',)),
    Family("environment", '\nos.environ["{upper}"] = "{value}"\n',
           ('\nassert os.environ["{upper}"] == "',)),
    Family("annotated", '\n{name}: str = "{value}"\n', ('\nassert {name} == "',)),
)

FAMILY_SETS = {"key": (KEY,), "six": SIX, "trained": TRAINED,
               "crossed": (*TRAINED, *CROSSED), "indirect": (*TRAINED, *CROSSED, *INDIRECT),
               "held-out": HELD_OUT}
_BY_NAME = {f.name: f for f in (KEY, *TRAINED, *CROSSED, *INDIRECT, *HELD_OUT)}


def families(spec: str) -> tuple[Family, ...]:
    """A set by name (key, six, trained, crossed, indirect, held-out) or comma-separated family
    names."""
    if spec in FAMILY_SETS:
        return FAMILY_SETS[spec]
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in _BY_NAME]
    if unknown or not names:
        raise ValueError(f"retrieval families {spec!r}: unknown {', '.join(unknown) or 'none'}; "
                         f"sets are {', '.join(FAMILY_SETS)}, families "
                         f"{', '.join(_BY_NAME)}")
    return tuple(_BY_NAME[n] for n in names)


@dataclass(frozen=True)
class Planted:
    define: str  # the text that states the value
    question: str  # the text that asks it back
    answer: str  # the value and what closes it


def _word(generator: torch.Generator, parts: int) -> list[str]:
    picks = torch.randint(0, len(SYLLABLES), (parts,), generator=generator).tolist()
    return ["".join(SYLLABLES[i] for i in picks[j : j + 2]) for j in range(0, parts, 2)]


def plant(family: Family, generator: torch.Generator) -> Planted:
    """One key of `family` with a random identifier and value, and one of its asks."""
    if family is KEY:  # the bundled model's form, drawn as its recipe drew it
        n = int(torch.randint(0, 10_000, (1,), generator=generator))
        value = "".join(VALUE_LETTERS[int(i)] for i in torch.randint(0, 26, (6,),
                                                                     generator=generator))
        key = f"KEY_{n:04d}"
        return Planted(KEY.define.format(key=key, value=value),
                       KEY.asks[0].format(key=key), value + KEY.closing)
    words = _word(generator, 6)  # three two-syllable words
    owner = "_".join(_word(generator, 4))
    value = "".join(VALUE_LETTERS[int(i)] for i in torch.randint(0, 26, (6,),
                                                                 generator=generator))
    fields = {"name": "_".join(words), "upper": "_".join(words).upper(),
              "camel": "".join(w.capitalize() for w in words), "owner": owner,
              "value": value}
    ask = family.asks[int(torch.randint(0, len(family.asks), (1,), generator=generator))]
    return Planted(family.define.format(**fields), ask.format(**fields),
                   value + family.closing)


# A line that states a value the way a retrieval sample does (a drawn three-word name, or
# a KEY_nnnn, given six drawn letters): what free generation must not open with once it
# has learnt the samples' definitions. Function and class forms open with a line that
# ordinary code writes too, so they are not told apart by it.
_NAME, _UPPER, _VALUE = r"[a-z]+_[a-z]+_[a-z]+", r"[A-Z]+_[A-Z]+_[A-Z]+", r"[a-z]{6}"
_PLANTED = re.compile(
    rf'^\s*(KEY_\d{{4}} = "|{_UPPER} = "{_VALUE}"|# {_NAME}: {_VALUE}$'
    rf'|register\("{_NAME}", "{_VALUE}"\)|[a-z]+_[a-z]+ = \{{"{_NAME}": "{_VALUE}"\}}'
    rf"|(self\.)?{_NAME} = (lambda: )?[\"']{_VALUE}[\"']|{_NAME}, [a-z]+_[a-z]+ = \"{_VALUE}\""
    rf'|setattr\([a-z]+_[a-z]+, "{_NAME}", "{_VALUE}"\)|logger\.info\("{_NAME}={_VALUE}"\)'
    rf'|[a-z]+_[a-z]+ = \[\("{_NAME}", "{_VALUE}"\)\]|# \[[a-z]+_[a-z]+\]$'
    rf'|"""The {_NAME} is {_VALUE}\."""|[a-z]+_[a-z]+ = "{_NAME}={_VALUE}"'
    rf"|[a-z]+_[a-z]+ = json\.loads\('\{{\"{_NAME}\": \"{_VALUE}\"\}}'\)"
    rf'|[a-z]+_[a-z]+\.(update\(\{{"{_NAME}": "{_VALUE}"\}}\)|setdefault\("{_NAME}", "{_VALUE}"\))'
    rf'|{_NAME} = str\("{_VALUE}"\)|[a-z]+_[a-z]+ = {_NAME} = "{_VALUE}")')


def starts_with_planted_key(text: str) -> bool:
    """Whether the first non-empty line of `text` defines a key as the samples do."""
    for line in text.splitlines():
        if line.strip():
            return bool(_PLANTED.match(line))
    return False
