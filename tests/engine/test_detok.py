"""Incremental detokenization over byte-level BPE, and the tokenizer's agreement with transformers.

Multi-byte characters (accents, CJK, emoji with modifiers, flags, 4-byte code points) are split
across tokens by the byte-level BPE of the test tokenizer. Fed one token at a time, the
IncrementalDetokenizer must never release a U+FFFD, and its deltas (plus the final flush) must add
up to `tokenizer.decode(all ids)`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import BOS, BOS_ID, EOS, EOS_ID, PAD_ID
from hypothesis import given, settings
from hypothesis import strategies as st

from h3d.engine.detok import IncrementalDetokenizer
from h3d.model.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
PIECES = [
    "a", "b", "z", " ", "the", " cache", ".", "\n", "42",
    "é", "ß", "Ω", "€", "ñ",
    "你", "好", "世界", "日本語", "テ",
    "🙂", "🚀", "🎉", "👍🏽", "❤️", "🇫🇷", "👩‍💻", "𝔘", "𐍈",
]  # fmt: skip

texts = st.one_of(
    st.lists(st.sampled_from(PIECES), max_size=30).map("".join),
    st.text(alphabet=st.characters(exclude_categories=("Cs",), exclude_characters=REPLACEMENT), max_size=30),
    st.lists(
        st.one_of(st.sampled_from(PIECES), st.characters(exclude_categories=("Cs",), exclude_characters=REPLACEMENT)),
        max_size=30,
    ).map("".join),
)


@pytest.fixture(scope="module")
def tok(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer(tokenizer_dir)


def stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas, detok.text


def test_test_text_really_splits_characters(tok: Tokenizer) -> None:
    """The property tests below mean something: single tokens cut multi-byte characters."""
    ids = tok.encode("你好 🙂👍🏽 🇫🇷 𝔘 日本語", add_special_tokens=False)
    partial = [i for i in ids if REPLACEMENT in tok.decode([i])]
    assert len(partial) >= 5


@settings(max_examples=300, deadline=None)
@given(text=texts)
def test_deltas_never_hold_a_broken_character(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text  # byte-level BPE round-trips any text
    deltas, joined = stream(tok, ids)
    for d in deltas:
        assert REPLACEMENT not in d, f"delta {d!r} of {text!r} holds a replacement character"
    assert joined == tok.decode(ids) == text


@settings(max_examples=150, deadline=None)
@given(text=texts, data=st.data())
def test_special_tokens_are_skipped_or_kept(tok: Tokenizer, text: str, data: st.DataObject) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    # Special tokens at random places (between tokens, possibly inside a split character).
    for _ in range(data.draw(st.integers(0, 3))):
        ids.insert(data.draw(st.integers(0, len(ids))), data.draw(st.sampled_from([BOS_ID, EOS_ID, PAD_ID])))
    deltas, joined = stream(tok, ids, skip_special_tokens=True)
    assert joined == tok.decode(ids, skip_special_tokens=True)
    assert all(BOS not in d and EOS not in d for d in deltas)
    _, kept = stream(tok, ids, skip_special_tokens=False)
    assert kept == tok.decode(ids, skip_special_tokens=False)


def test_partial_character_is_held_then_flushed(tok: Tokenizer) -> None:
    ids = tok.encode("ok🚀", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    pushed = [detok.push(i) for i in ids[:-1]]
    assert "".join(pushed) == "ok"  # the rocket's first bytes are held back
    assert detok.push(ids[-1]) == "🚀"
    assert detok.flush() == ""
    # A generation that ends inside a character releases what it has at the end.
    cut = IncrementalDetokenizer(tok)
    assert "".join(cut.push(i) for i in ids[:-1]) == "ok"
    assert cut.flush() == tok.decode(ids[:-1])[2:]


# ---- the tokenizer agrees with transformers' on the same folder ------------------------------------

SAMPLES = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and trailing  ",
    "Café naïve 你好，世界 🙂🚀",
    "",
    "line one\nline two\n\n\ttabbed",
]


@pytest.fixture(scope="module")
def hf_tok(tokenizer_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.mark.parametrize("text", SAMPLES)
def test_encode_decode_match_transformers(tok: Tokenizer, hf_tok, text: str) -> None:
    ids = tok.encode(text)
    assert ids == hf_tok(text).input_ids
    assert ids[0] == BOS_ID  # the post-processor adds BOS
    assert tok.encode(text, add_special_tokens=False) == hf_tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False)


def test_vocab_specials_and_chat_template(tok: Tokenizer, hf_tok, checkpoint: Callable[[str], Path]) -> None:
    assert tok.vocab_size == len(hf_tok) == 512
    assert tok.special_ids == {BOS_ID, EOS_ID, PAD_ID}
    messages = [{"role": "user", "content": "Hi 🙂"}, {"role": "assistant", "content": "Hello."}]
    for add in (True, False):
        got = tok.apply_chat_template(messages, add_generation_prompt=add)
        want = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
        assert got == want
    # Every checkpoint carries the same tokenizer files.
    assert Tokenizer(checkpoint("qwen2_mha_tied")).encode("same ids") == tok.encode("same ids")
