"""Retrieval in many written forms: the families, the held-out ones kept out of training,
the definitions left out of the loss, and the measure of definitions leaking into free
generation."""

import re

import pytest
import torch

from kvstack.config import preset
from kvstack.corpus.data import (
    retrieval_sample,
    stdlib_root,
)
from kvstack.corpus.families import (
    CROSSED,
    HELD_OUT,
    INDIRECT,
    KEY,
    SIX,
    TRAINED,
    Family,
    families,
    plant,
    starts_with_planted_key,
)
from kvstack.eval.quality import planted_starts, retrieval
from kvstack.model import Model
from kvstack.train.trainer import IGNORE, TrainConfig, Trainer

CORPUS = str(stdlib_root() / "json")
# Words of the questions' own code, not names a definition made.
COMMON = {"assert", "print", "if", "value", "result", "label", "get", "lookup", "registry",
          "again", "settings", "os", "environ", "self", "return", "getattr", "dict", "logged",
          "the", "is", "vars", "__dict__", "parse", "globals", "SimpleNamespace"}


def run_config(**changes) -> TrainConfig:
    settings = dict(preset="tiny", steps=1, seq_len=256, batch_size=4, vocab_size=512,
                    heldout_percent=40.0, corpus=CORPUS, retrieval_rate=1.0)
    return TrainConfig(**(settings | changes))



@pytest.mark.parametrize("family", [KEY, *TRAINED, *CROSSED, *INDIRECT, *HELD_OUT],
                         ids=lambda f: f.name)
def test_every_family_asks_back_the_value_it_plants(family):
    g = torch.Generator().manual_seed(3)
    seen = set()
    for _ in range(20):
        p = plant(family, g)
        value = p.answer[: -len(family.closing)]
        assert p.answer.endswith(family.closing) and len(value) == 6
        assert value in p.define and value not in p.question
        # The question names what the definition named.
        names = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", p.question)) - COMMON
        assert names and all(n in p.define for n in names)
        seen.add(p.question.split(value)[0])
    assert len(seen) > 10  # identifiers are drawn, not fixed


def test_no_trained_form_states_a_value_as_a_held_out_one_does():
    """Held out by construction: a trained definition is never a keyword argument, an
    assignment to a subscript or an annotation, the three ways the held-out forms state a
    value; and the six forms of the first long-context stages are the start of TRAINED."""
    g = torch.Generator().manual_seed(4)
    ways = (re.compile(r"\w+\([^)]*\b\w+=\""), re.compile(r"\]\s*=\s*\""),
            re.compile(r"^\s*\w+: \w+ ="))
    for family in HELD_OUT:
        define = plant(family, g).define
        assert any(w.search(line) for w in ways for line in define.splitlines())
    for family in (*TRAINED, *CROSSED, *INDIRECT):
        for _ in range(5):
            lines = plant(family, g).define.splitlines()
            assert not any(w.search(line) for w in ways for line in lines), family.name
    assert TRAINED[: len(SIX)] == SIX and len(TRAINED) >= 3 * len(SIX)
    assert {f.name for f in (*TRAINED, *CROSSED, *INDIRECT)}.isdisjoint(
        f.name for f in HELD_OUT)
    assert families("six") == SIX and families("trained") == TRAINED
    assert families("crossed") == (*TRAINED, *CROSSED)
    assert families("indirect") == (*TRAINED, *CROSSED, *INDIRECT)


def test_a_crossed_form_asks_a_name_in_another_spelling_than_it_stated_it():
    """Quoted where the definition has it bare, bare where it is quoted, or out of a
    string: the asks that a token-for-token match of the definition cannot answer."""
    g = torch.Generator().manual_seed(8)
    for family in CROSSED:
        for ask in family.asks:
            p = plant(Family(family.name, family.define, (ask,), family.closing), g)
            name = re.search(r"[a-z]+_[a-z]+_[a-z]+", p.question)[0]
            spelling = rf'(["=.]?){name}(["=(]?)'  # the name with what bounds it
            asked, stated = (set(re.findall(spelling, t)) for t in (p.question, p.define))
            assert asked and stated and asked.isdisjoint(stated), (family.name, ask)


def test_an_indirect_form_asks_what_no_trained_form_asks_of_its_definition():
    """A trained definition reread in an ask no earlier form pairs with it, or a definition
    of its own; and the alias is asked through the second name alone, so the value has to
    be carried from one name to the other."""
    earlier = {(f.define, ask) for f in (*TRAINED, *CROSSED) for ask in f.asks}
    stated = {f.define for f in (*TRAINED, *CROSSED)}
    for family in INDIRECT:
        assert not {(family.define, ask) for ask in family.asks} & earlier, family.name
    assert sum(f.define in stated for f in INDIRECT) == 3
    g = torch.Generator().manual_seed(9)
    alias = next(f for f in INDIRECT if f.name == "alias")
    for _ in range(5):
        p = plant(alias, g)
        value_line, alias_line = p.define.strip().splitlines()
        asked = re.search(r"assert (\w+) ==", p.question)[1]
        assert asked not in value_line and alias_line.startswith(f"{asked} = ")


@pytest.mark.parametrize("forms", ["trained", "crossed", "indirect"])
def test_held_out_families_never_reach_training(tmp_path, forms):
    trainer = Trainer(run_config(retrieval_families=forms), tmp_path)
    text = "".join(trainer.tokenizer.decode(row.tolist())
                   for i in range(6) for row in trainer.batch(i)[0])
    for marker in ('settings = dict(', 'os.environ["', ': str = "'):
        assert marker not in text
    assert "register(" in text or "def " in text  # the trained families are there
    for bad in ("held-out", "environment", "assignment,annotated"):
        with pytest.raises(ValueError, match="held out from training"):
            run_config(retrieval_families=bad).check()
    with pytest.raises(ValueError, match="unknown nope"):
        run_config(retrieval_families="nope").check()


def test_without_the_definitions_loss_only_the_answers_and_code_teach(tmp_path):
    with_loss = Trainer(run_config(retrieval_families="trained"), tmp_path / "a")
    without = Trainer(run_config(retrieval_families="trained", retrieval_define_loss=False),
                      tmp_path / "b")
    rows, full, _ = with_loss.batch(0)
    same_rows, targets, _ = without.batch(0)
    assert torch.equal(rows, same_rows) and torch.equal(full, rows[:, 1:])
    decode = without.tokenizer.decode
    for r in range(rows.shape[0]):  # every row is a retrieval sample here
        left_out = targets[r] == IGNORE
        assert 0 < left_out.sum() < 0.3 * left_out.numel()
        # The scored key's value closes the row, and its definition is what is left out.
        value = re.findall(r"([a-z]{6})[\"\n]*$", decode(rows[r].tolist()))[0]
        assert value in decode(rows[r, 1:][left_out].tolist())
        assert not left_out[-8:].any()  # the answer still teaches


def test_the_key_form_draws_the_samples_the_bundled_recipe_drew(data):
    tokenizer, cache = data

    def original(length: int, depth: float, g: torch.Generator, extra: int) -> list[int]:
        """The single-form sample as the bundled model's recipe wrote it."""
        keys = []
        for _ in range(extra + 1):
            n = int(torch.randint(0, 10_000, (1,), generator=g))
            value = "".join(chr(ord("a") + int(i)) for i in torch.randint(0, 26, (6,),
                                                                          generator=g))
            keys.append((f"KEY_{n:04d}", value))
        depths = [float(torch.rand((), generator=g)) for _ in range(extra)] + [depth]
        defines = [tokenizer.encode(f'\n{k} = "{v}"\n').ids for k, v in keys]
        questions = [tokenizer.encode(f'\nassert {k} == "').ids for k, _ in keys]
        answers = [tokenizer.encode(f'{v}"').ids for _, v in keys]
        filler = length - sum(len(t) for t in (*defines, *questions, *answers))
        start = int(torch.randint(0, cache.tokens.size - filler, (1,), generator=g))
        code = cache.tokens[start : start + filler].tolist()
        ids, done = [], 0
        for at, define in sorted(zip((round(d * filler) for d in depths), defines, strict=True),
                                 key=lambda pair: pair[0]):
            ids += code[done:at] + define
            done = at
        ids += code[done:]
        for q, a in zip(questions, answers, strict=True):
            ids += q + a
        return ids

    for extra in (0, 2):
        a, b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
        assert retrieval_sample(cache, tokenizer, 200, 0.4, a, extra).ids == original(
            200, 0.4, b, extra)


def test_a_planted_definition_is_told_from_code():
    g = torch.Generator().manual_seed(1)
    for family in (KEY, *[f for f in TRAINED if f.name in
                          ("assignment", "dict_entry", "comment_line", "registry_call",
                           "single_quoted", "attribute_set", "setattr_call", "lambda_return",
                           "tuple_unpack", "pair_list", "log_field", "ini_comment",
                           "docstring")], *[f for f in CROSSED if f.name == "query_string"],
                   *INDIRECT[3:]):
        for _ in range(5):
            assert starts_with_planted_key(plant(family, g).define)
    for code in ("\n\nx = compute(y)\n", "MAX_SIZE = 10\n", "# returns: string\n",
                 'NAME = "json"\n', "def get_file_name():\n", 'key = {"a": 1}\n', ""):
        assert not starts_with_planted_key(code)


def test_retrieval_and_planted_starts_on_held_out_families(data):
    tokenizer, cache = data
    torch.manual_seed(0)
    model = Model(preset("tiny").replace(vocab_size=512)).eval()
    result = retrieval(model, tokenizer, cache, [128], [0.5], 2, forms="held-out")
    assert result["families"] == [f.name for f in HELD_OUT]
    assert 0 <= result["accuracy"][0][0] <= 1
    tally = result["by_family"][0]  # every question counted once, under its own family
    assert list(tally) == result["families"]
    assert sum(asked for _, asked in tally.values()) == 2
    assert sum(hit for hit, _ in tally.values()) == round(result["accuracy"][0][0] * 2)
    planted = planted_starts(model, tokenizer, cache, samples=3, context=32, new_tokens=6)
    assert planted["code"]["prompts"] == 3 and 0 <= planted["code"]["planted_share"] <= 1
    assert planted["chat"]["prompts"] == 20
    assert families("assignment,registry_call") == tuple(
        f for f in TRAINED if f.name in ("assignment", "registry_call"))


def test_a_sample_names_the_family_of_the_key_it_scores(data):
    tokenizer, cache = data
    g = torch.Generator().manual_seed(7)
    seen = set()
    for _ in range(12):
        sample = retrieval_sample(cache, tokenizer, 300, 0.5, g, extra_keys=2, families=HELD_OUT)
        question = tokenizer.decode(sample.ids[: sample.answer_start]).rsplit("\n", 1)[-1]
        marker = {"keyword_argument": 'settings["', "environment": 'os.environ["'}
        if sample.family in marker:
            assert marker[sample.family] in question
        else:
            assert sample.family == "annotated"
            assert not any(m in question for m in marker.values())
        seen.add(sample.family)
    assert seen == {f.name for f in HELD_OUT}


@pytest.mark.parametrize("forms", ["held-out", "indirect", "key"])
def test_a_sample_locates_the_scored_definition_and_its_value(data, forms):
    """Whichever of its keys comes first, a sample says which definition its question asks
    for and which of its tokens carry the value: the answer's text."""
    tokenizer, cache = data
    g = torch.Generator().manual_seed(11)
    for _ in range(8):
        sample = retrieval_sample(cache, tokenizer, 400, float(torch.rand((), generator=g)),
                                  g, extra_keys=3, families=families(forms))
        assert sample.definition in sample.defines
        first, end = sample.value
        assert sample.definition[0] <= first < end <= sample.definition[1]
        value = tokenizer.decode(sample.ids[first:end]).strip().strip("\"'")
        answer = tokenizer.decode(sample.ids[sample.answer_start :])
        assert len(value) >= 6 and value[-6:] == answer[:6] and value in tokenizer.decode(
            sample.ids[slice(*sample.definition)])
