"""Long-context tasks in the manner of RULER, built from real text, each answer checked exactly.

A task is a haystack of real prose (`h3d.bench.text`, as token ids) with facts inserted at stated
depths, a question, and the strings its answer must hold:

- `single_needle`: "The special magic number for <key> is <7 digits>." once; asked for it.
- `multi_key`: the same fact for the asked key and for 3 distractor keys of the same form, at
  other depths; the answer must hold the asked key's number.
- `multi_value`: 4 facts "One of the special magic numbers for <key> is <n>." spread from the
  depth on; the answer must hold all 4 (a long answer: it crosses window resizes).
- `variable_tracking`: a chain "VAR A = <5 digits>." "VAR B = A." ... of 4 variables spread from
  the depth on, beside a distractor chain of the same form holding another value; the answer
  must name all 4 variables of the asked value's chain.

Keys are two words, values random digits the model cannot guess, variable names random capitals;
every value and name occurs in the prompt exactly where it is inserted (the generator draws again
on a clash with the haystack). Deterministic from (task, depth, seed): the facts and the question
are the same at every length. Rendering with a
chat template and fitting the context is the caller's (`body` tokens of haystack and facts).
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass

TASKS = ("single_needle", "multi_key", "multi_value", "variable_tracking")
ADJECTIVES = ("amber", "brisk", "cobalt", "dusty", "eager", "frozen", "gilded", "hollow", "ivory", "jagged",
              "keen", "lunar", "mossy", "nimble", "opal", "placid", "quiet", "rustic", "silver", "tidal")  # fmt: skip
NOUNS = ("harbor", "lantern", "meadow", "orchard", "quarry", "rampart", "saddle", "thicket", "vault", "willow",
         "beacon", "canyon", "delta", "ember", "falcon", "glacier", "heron", "island", "juniper", "kiln")  # fmt: skip

Encode = Callable[[str], list[int]]


@dataclass(frozen=True, slots=True)
class Task:
    name: str
    depth: float
    ids: list[int]  # haystack and facts, `body` tokens (give or take a fact's split)
    question: str
    answers: tuple[str, ...]  # every one must appear in the answer
    inserted_at: tuple[int, ...]  # token index of each fact in `ids`, in order of insertion
    facts: tuple[str, ...]  # the facts' texts, in the same order


def _key(rng: random.Random, taken: set[str]) -> str:
    while True:
        key = f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"
        if key not in taken:
            taken.add(key)
            return key


def _digits(rng: random.Random, n: int, taken: set[str], hay: str) -> str:
    while True:
        value = str(rng.randrange(10 ** (n - 1), 10**n))
        if value not in taken and value not in hay:
            taken.add(value)
            return value


def _name(rng: random.Random, taken: set[str], hay: str) -> str:
    while True:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in taken and name not in hay:
            taken.add(name)
            return name


def make(name: str, encode: Encode, hay_ids: list[int], hay_text: str, body: int, depth: float, seed: int) -> Task:
    """Task `name` over `body` tokens: a slice of the haystack (`hay_ids`, the tokens of
    `hay_text`) with its facts inserted, the first at `depth` (0..1) of the slice, the others as
    the task says."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r} (one of {', '.join(TASKS)})")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    rng = random.Random(f"{name}/{depth}/{seed}")  # not the body: the question is the same at every length
    taken: set[str] = set()
    facts: list[tuple[float, str]] = []  # (depth, text)
    answers: tuple[str, ...]
    spread = [depth + (1 - depth) * i / 4 for i in range(4)]  # from the depth toward the end
    if name in ("single_needle", "multi_key"):
        key, value = _key(rng, taken), _digits(rng, 7, taken, hay_text)
        facts.append((depth, f" The special magic number for {key} is {value}. "))
        question, answers = f"What is the special magic number for {key}?", (value,)
        if name == "multi_key":
            others = [d for d in (0.05, 0.25, 0.45, 0.65, 0.85, 0.95) if abs(d - depth) >= 0.1]
            for d in rng.sample(others, 3):
                facts.append(
                    (d, f" The special magic number for {_key(rng, taken)} is {_digits(rng, 7, taken, hay_text)}. ")
                )
    elif name == "multi_value":
        key = _key(rng, taken)
        values = [_digits(rng, 7, taken, hay_text) for _ in range(4)]
        facts += [
            (d, f" One of the special magic numbers for {key} is {v}. ") for d, v in zip(spread, values, strict=True)
        ]
        question, answers = f"What are all the special magic numbers for {key}?", tuple(values)
    else:
        value, other = _digits(rng, 5, taken, hay_text), _digits(rng, 5, taken, hay_text)
        chain = [_name(rng, taken, hay_text) for _ in range(4)]
        noise = [_name(rng, taken, hay_text) for _ in range(4)]
        for names, first, depths in ((chain, value, spread), (noise, other, [d * 0.9 for d in spread])):
            facts.append((depths[0], f" VAR {names[0]} = {first}. "))
            facts += [(d, f" VAR {b} = {a}. ") for d, a, b in zip(depths[1:], names, names[1:], strict=False)]
        question, answers = f"Which variables are assigned the value {value}? Name all of them.", tuple(chain)
    return _insert(name, encode, hay_ids, body, depth, rng, facts, question, answers)


def _insert(
    name: str,
    encode: Encode,
    hay_ids: list[int],
    body: int,
    depth: float,
    rng: random.Random,
    facts: list[tuple[float, str]],
    question: str,
    answers: tuple[str, ...],
) -> Task:
    encoded = [encode(text) for _, text in facts]
    room = body - sum(len(e) for e in encoded)
    if room <= 0 or room > len(hay_ids):
        raise ValueError(f"{body} tokens cannot hold the facts and a haystack of {len(hay_ids)} tokens")
    start = rng.randrange(0, len(hay_ids) - room + 1)
    hay = hay_ids[start : start + room]
    # Insert from the deepest fact first so that the shallower positions stay as computed.
    order = sorted(range(len(facts)), key=lambda i: -facts[i][0])
    cut = {i: min(room, int(facts[i][0] * room)) for i in order}
    ids = list(hay)
    for i in order:
        ids[cut[i] : cut[i]] = encoded[i]
    at = []
    for i in range(len(facts)):  # where each fact landed: its cut plus the facts inserted before it
        at.append(
            cut[i] + sum(len(encoded[j]) for j in range(len(facts)) if cut[j] < cut[i] or (cut[j] == cut[i] and j > i))
        )
    return Task(name, depth, ids, question, answers, tuple(at), tuple(t for _, t in facts))


def correct(task: Task, answer: str) -> bool:
    """Every expected string in `answer`, each as a whole word (a number inside a longer number,
    or a name inside a longer word, does not count)."""
    return all(re.search(rf"(?<![0-9A-Za-z]){re.escape(a)}(?![0-9A-Za-z])", answer) for a in task.answers)
