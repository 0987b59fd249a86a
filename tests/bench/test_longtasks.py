"""The long-context tasks (`h3d.bench.longtasks`) over a word-level stand-in tokenizer: each
answer present exactly once where it is inserted, the first fact at its depth, distractors of the
same form, deterministic; the scorer on hand-made answers."""

from __future__ import annotations

import re

import pytest

from h3d.bench.longtasks import TASKS, Task, correct, make
from h3d.bench.text import corpus

VOCAB: dict[str, int] = {}
WORDS: list[str] = []


def encode(text: str) -> list[int]:
    out = []
    for w in text.split():
        if w not in VOCAB:
            VOCAB[w] = len(WORDS)
            WORDS.append(w)
        out.append(VOCAB[w])
    return out


def decode(ids: list[int]) -> str:
    return " ".join(WORDS[i] for i in ids)


HAY = corpus()[:60_000]
HAY_IDS = encode(HAY)


@pytest.mark.parametrize("name", TASKS)
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.9, 1.0])
def test_facts_land_at_their_depths_and_answers_occur_once(name: str, depth: float) -> None:
    task = make(name, encode, HAY_IDS, HAY, 3000, depth, seed=1)
    assert abs(len(task.ids) - 3000) <= 1 and task.name == name
    room = 3000 - sum(len(encode(f)) for f in task.facts)
    for fact, at in zip(task.facts, task.inserted_at, strict=True):
        assert task.ids[at : at + len(encode(fact))] == encode(fact)  # where it says
    assert abs(task.inserted_at[0] - depth * room) <= sum(len(encode(f)) for f in task.facts)
    text = decode(task.ids)
    for answer in task.answers:
        assert len(re.findall(rf"(?<![0-9A-Za-z]){answer}(?![0-9A-Za-z])", text)) == (
            1 if name != "variable_tracking" else 1 + (answer != task.answers[-1])
        )  # a chain's name is assigned, and read by the next one (the last is read by none)
    assert make(name, encode, HAY_IDS, HAY, 3000, depth, seed=1) == task  # deterministic
    assert make(name, encode, HAY_IDS, HAY, 3000, depth, seed=2).answers != task.answers


def test_the_forms_of_each_task() -> None:
    fact = re.compile(r"The special magic number for (\w+ \w+) is (\d{7})\.")
    single = make("single_needle", encode, HAY_IDS, HAY, 2000, 0.5, seed=3)
    assert len(single.facts) == 1 and fact.search(single.facts[0])
    multi = make("multi_key", encode, HAY_IDS, HAY, 2000, 0.5, seed=3)
    found = [fact.search(f) for f in multi.facts]
    assert len(found) == 4 and all(found)  # the asked key and 3 distractors of the same form
    keys = [m.group(1) for m in found if m]
    assert len(set(keys)) == 4 and keys[0] in multi.question and multi.answers == (found[0].group(2),)  # type: ignore[union-attr]
    assert all(abs(at - multi.inserted_at[0]) > 100 for at in multi.inserted_at[1:])  # apart from the asked one
    values = make("multi_value", encode, HAY_IDS, HAY, 2000, 0.2, seed=3)
    assert len(values.answers) == 4 and list(values.inserted_at) == sorted(values.inserted_at)
    chain = make("variable_tracking", encode, HAY_IDS, HAY, 2000, 0.2, seed=3)
    a, b, c, d = chain.answers
    value = re.search(r"value (\d{5})", chain.question)
    assert value and f" VAR {a} = {value.group(1)}. " in chain.facts
    assert {f" VAR {b} = {a}. ", f" VAR {c} = {b}. ", f" VAR {d} = {c}. "} <= set(chain.facts)
    noise = [f for f in chain.facts if not any(n in f for n in chain.answers)]
    assert len(noise) == 4 and re.fullmatch(r" VAR [A-Z]{5} = \d{5}\. ", noise[0])  # same form, another value
    with pytest.raises(ValueError, match="unknown task"):
        make("haystack", encode, HAY_IDS, HAY, 2000, 0.5, seed=1)
    with pytest.raises(ValueError, match="cannot hold"):
        make("single_needle", encode, HAY_IDS[:100], HAY, 2000, 0.5, seed=1)


def test_the_scorer_on_hand_made_answers() -> None:
    task = Task("multi_value", 0.5, [], "q", ("1234567", "7654321"), (), ())
    assert correct(task, "They are 1234567 and 7654321.")
    assert not correct(task, "1234567 only")  # all of them
    assert not correct(task, "91234567 and 7654321")  # inside a longer number
    names = Task("variable_tracking", 0.5, [], "q", ("ABCDE", "FGHIJ"), (), ())
    assert correct(names, "ABCDE, FGHIJ") and not correct(names, "ABCDEF, FGHIJ")
