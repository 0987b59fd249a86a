"""A long text sent again, longer, is encoded only past what it shares with one encoded before, up
to a special token (`h3d.model.tokenizer.EncodeMemo`): always the ids of encoding it whole."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

import h3d.model.tokenizer as tokenizer_module
from h3d.model.tokenizer import MEMO_MIN_CHARS, Tokenizer

WORDS = ["the", "of", "and", "to", "in", "is", "é", "中文", "🙂", "  ", "\n", "\n\n", "x1", "<|im", "<s", "end|>"]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def test_a_chat_conversation_encodes_turn_after_turn_as_it_does_whole(smol_dir: Path) -> None:
    """Eight turns of a conversation (odd characters, whitespace at the seams, text that looks like
    a special token), each rendered whole: the memo's ids equal a plain encoding; every turn after
    the first reuses the one before; an edited earlier message reuses only what is before it."""
    tok = Tokenizer(smol_dir)
    assert tok.memo.enabled
    rng = random.Random(5)
    messages: list[dict[str, str]] = [{"role": "system", "content": "You answer.  "}]
    for turn in range(8):
        messages.append({"role": "user", "content": words(rng, 1500 if turn == 0 else 40)})
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        assert len(text) >= MEMO_MIN_CHARS
        for add in (False, True):
            assert tok.encode(text, add, scope="a") == tok.encode(text, add), (turn, add)
        assert tok.memo.hits == 2 * turn
        messages.append({"role": "assistant", "content": words(rng, 30) + rng.choice([" ", "\n", ""])})
    messages[3] = {"role": "user", "content": "edited " + messages[3]["content"]}
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    reused = tok.memo.reused_chars
    assert tok.encode(text, False, scope="a") == tok.encode(text, False)
    assert tok.memo.hits == 15 and tok.memo.reused_chars - reused < text.index("edited ")


def test_texts_joined_at_special_tokens_encode_as_whole(tokenizer_dir: Path) -> None:
    """The test tokenizer (a BOS its post-processor adds): random texts that grow at random, cut at
    its special tokens, and shrink back to a shared part; always the plain ids."""
    tok = Tokenizer(tokenizer_dir)
    assert tok.memo.enabled
    rng = random.Random(9)
    specials = ["<|bos|>", "<|eos|>", "<|pad|>"]
    text = words(rng, 1500)
    for _ in range(40):
        if rng.random() < 0.2 and "<|eos|>" in text[MEMO_MIN_CHARS:]:
            text = text[: text.rindex("<|eos|>") + 7]  # back to an earlier cut, then on
        text += rng.choice(specials) + rng.choice(["", " ", "\n"]) + words(rng, rng.randint(0, 60))
        add = rng.random() < 0.5
        assert tok.encode(text, add, scope="o") == tok.encode(text, add)
    assert tok.memo.hits > 20


def test_one_owner_texts_never_shorten_another_owners_encoding(smol_dir: Path) -> None:
    tok = Tokenizer(smol_dir)
    text = tok.apply_chat_template([{"role": "user", "content": words(random.Random(1), 1500)}], True)
    tok.encode(text, False, scope="a")
    longer = text + "an answer<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n"
    assert tok.encode(longer, False, scope="b") == tok.encode(longer, False)
    assert tok.memo.hits == 0
    tok.encode(longer, False, scope="a")
    assert tok.memo.hits == 1


def test_the_memo_keeps_a_bounded_number_of_texts(smol_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizer_module, "MEMO_TEXTS", 4)
    tok = Tokenizer(smol_dir)
    rng = random.Random(2)
    for i in range(10):
        text = tok.apply_chat_template([{"role": "user", "content": words(rng, 1500)}], True)
        tok.encode(text, False, scope=str(i))
    memo = tok.memo
    assert len(memo._texts) == 4
    assert {ident for ident, _ in memo._cuts.values()} == set(memo._texts)  # no cut of a dropped text


def test_a_tokenizer_whose_special_tokens_strip_whitespace_is_encoded_whole(tmp_path: Path, smol_dir: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol_dir / name, tmp_path / name)
    raw = json.loads((tmp_path / "tokenizer.json").read_text())
    for t in raw["added_tokens"]:
        t["lstrip"] = True
    (tmp_path / "tokenizer.json").write_text(json.dumps(raw))
    tok = Tokenizer(tmp_path)
    assert not tok.memo.enabled
    text = "a" * MEMO_MIN_CHARS + "<|im_start|>user\n hi"
    assert tok.encode(text, False, scope="a") == tok.encode(text, False) and tok.memo.hits == 0


def test_the_engine_encodes_an_owner_s_longer_text_past_what_it_sent_before(checkpoint: Callable[[str], Path]) -> None:
    """Through `Engine.append`: a session's text that begins with one its owner sent before reuses
    its ids (the tokenizer's memo, scoped by owner) and holds the ids of a whole encoding; another
    owner's does not reuse them."""
    from helpers import make_engine

    engine = make_engine(checkpoint("llama_mha_untied"), max_context_tokens=8192)
    tok = engine.tokenizer
    rng = random.Random(4)
    first = words(rng, 1500) + "<|eos|>"
    second = first + " " + words(rng, 20)
    a1 = engine.create_session(owner="a")
    engine.append(a1, text=first)
    a2 = engine.create_session(owner="a")
    engine.append(a2, text=second)
    assert tok.memo.hits == 1
    assert engine.session(a2).tokens == tok.encode(second)
    b = engine.create_session(owner="b")
    engine.append(b, text=second)
    assert tok.memo.hits == 1 and engine.session(b).tokens == tok.encode(second)
    engine.close()
