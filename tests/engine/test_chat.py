"""Chat sessions (h3d.engine.chat) against the template applied to the whole conversation at once.

The oracle is what `h3d generate --chat` does: render the conversation with the model's chat
template, tokenize it as one prompt, generate greedily. A chat session appends the same
conversation message by message; its context, its greedy tokens and its restored state must be
those of the oracle.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from h3d.config import EngineConfig
from h3d.engine.chat import end_of_turn
from h3d.engine.engine import Engine
from h3d.engine.session import GenerationDone
from h3d.errors import InvalidRequest, NoChatTemplate

MODEL = "llama_gqa4_tied"


@pytest.fixture(scope="module")
def engine(checkpoint: Callable[[str], Path]) -> Engine:
    return Engine(EngineConfig.build(model=str(checkpoint(MODEL)), policy="exact"))


def greedy(engine: Engine, n: int = 8) -> object:
    return engine.with_sampling(max_tokens=n, temperature=0.0)


def oracle(engine: Engine, messages: list[dict[str, str]], n: int = 8) -> tuple[list[int], GenerationDone]:
    """`h3d generate --chat`: the whole conversation rendered and tokenized as one prompt."""
    text = engine.tokenizer.apply_chat_template(messages)
    sid = engine.create_session()
    done = engine.complete(sid, text, greedy(engine, n))  # type: ignore[arg-type]
    tokens = list(engine.session(sid).tokens)
    engine.close_session(sid, purge=True)
    return tokens, done


def test_first_turn_equals_the_template_applied_at_once(engine: Engine) -> None:
    sid = engine.create_session(system_prompt="Answer briefly.", chat=True)
    done = engine.complete(sid, "Once upon a time", greedy(engine))  # type: ignore[arg-type]
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Once upon a time"}]
    want_tokens, want = oracle(engine, messages)
    assert done.token_ids == want.token_ids and len(done.token_ids) > 0
    assert engine.session(sid).tokens == want_tokens
    chat = engine.session(sid).chat
    assert chat is not None and chat.open_at is not None


def test_later_turns_render_the_whole_conversation(engine: Engine) -> None:
    """After a generated turn (cut by max_tokens: its end-of-turn is still to be appended), the
    next message's piece closes the turn first: the context reads as the whole conversation."""
    tok = engine.tokenizer
    sid = engine.create_session(chat=True)
    first = engine.complete(sid, "The end of a story", greedy(engine, 6))  # type: ignore[arg-type]
    engine.append(sid, text="And then?")
    engine.append(sid, text="It was late.", role="assistant")
    engine.append(sid, text="Go on.")
    second = engine.complete(sid, "", greedy(engine, 6))  # type: ignore[arg-type]
    messages = [
        {"role": "user", "content": "The end of a story"},
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And then?"},
        {"role": "assistant", "content": "It was late."},
        {"role": "user", "content": "Go on."},
    ]
    session = engine.session(sid)
    bos = tok.decode(tok.encode(""), skip_special_tokens=False)  # the tokenizer's own BOS, if any
    rendered = tok.apply_chat_template(messages)
    context = tok.decode(session.tokens[: len(session.tokens) - len(second.token_ids)], skip_special_tokens=False)
    assert context == bos + rendered
    assert session.chat is not None and [m["role"] for m in session.chat.messages] == [m["role"] for m in messages]
    # Token for token: the first turn's prompt as the oracle tokenizes it, the generated tokens,
    # then the rest of the rendering (from the turn's end on) as one more piece.
    head = tok.apply_chat_template(messages[:1])
    rest = rendered[len(head) + len(first.text) :]
    want = tok.encode(head) + list(first.token_ids) + tok.encode(rest, add_special_tokens=False)
    assert session.tokens[: len(want)] == want


def test_chat_requests_are_checked(engine: Engine, checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    sid = engine.create_session(chat=True)
    with pytest.raises(InvalidRequest, match="role"):
        engine.submit(sid, text="hi", role="narrator", generate=False)
    with pytest.raises(InvalidRequest, match="token ids"):
        engine.submit(sid, token_ids=[5, 6], generate=False)
    assert engine.session(sid).tokens == [] and not engine.session(sid).busy
    plain = engine.create_session()
    with pytest.raises(InvalidRequest, match="role"):
        engine.submit(plain, text="hi", role="user", generate=False)
    bare = tmp_path / "no-template"
    bare.mkdir()
    for f in checkpoint(MODEL).iterdir():
        (bare / f.name).symlink_to(f)
    (bare / "tokenizer_config.json").unlink()
    with pytest.raises(NoChatTemplate):
        Engine(EngineConfig.build(model=str(bare))).create_session(chat=True)


def test_a_restarted_chat_session_continues_its_conversation(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """Messages live in the token log with their tokens: after a restart (a turn left open by
    a crash included) the conversation and its next piece are those of an uninterrupted session."""
    cfg = EngineConfig.build(model=str(checkpoint(MODEL)), policy="exact", session_log_path=str(tmp_path / "logs"))
    plain = Engine(EngineConfig.build(model=str(checkpoint(MODEL)), policy="exact"))
    first = Engine(cfg)
    sid = first.create_session(system_prompt="Be kind.", chat=True)
    ref = plain.create_session(system_prompt="Be kind.", chat=True)
    for e, s in ((first, sid), (plain, ref)):
        e.complete(s, "Tell a story", greedy(e, 5))  # type: ignore[arg-type]
    first.close()  # as after kill -9 with the logs written: the turn is open, nothing closed it
    again = Engine(cfg)
    for e, s in ((again, sid), (plain, ref)):
        e.append(s, text="Shorter, please.")
    assert again.session(sid).tokens == plain.session(ref).tokens
    a, b = again.session(sid).chat, plain.session(ref).chat
    assert a is not None and b is not None and a.messages == b.messages and len(a.messages) == 4
    done = again.complete(sid, "", greedy(again, 5))  # type: ignore[arg-type]
    assert done.token_ids == plain.complete(ref, "", greedy(plain, 5)).token_ids  # type: ignore[arg-type]


@pytest.mark.slow
def test_the_embedded_instruct_model_chats_as_its_template_says(smol_dir: Path) -> None:
    """SmolLM2-Instruct (ChatML, a default system prompt, `<|im_end|>` ends a turn): a chat
    session's first answer is `h3d generate --chat`'s, and the next message follows a closed turn."""
    engine = Engine(EngineConfig.build(model=str(smol_dir), policy="exact"))
    assert engine.end_of_turn == engine.tokenizer.encode("<|im_end|>", add_special_tokens=False)[0]
    sid = engine.create_session(chat=True)
    done = engine.complete(sid, "Name three rivers.", greedy(engine, 24))  # type: ignore[arg-type]
    _, want = oracle(engine, [{"role": "user", "content": "Name three rivers."}], 24)
    assert done.token_ids == want.token_ids
    # Cut by max_tokens or ended at <|im_end|>: either way the next message closes the turn first.
    engine.append(sid, text="And three mountains?")
    text = engine.tokenizer.decode(engine.session(sid).tokens, skip_special_tokens=False)
    assert text.endswith("<|im_end|>\n<|im_start|>user\nAnd three mountains?<|im_end|>\n")


QWEN_LIKE = (
    "{%- if tools %}{{- 'TOOLS' }}{%- else %}{{- 'NO TOOLS\\n' }}{%- endif %}"
    "{%- for m in messages %}{%- if m.role not in ['user', 'assistant'] %}"
    "{{- raise_exception('bad role ' + m.role) }}{%- endif %}"
    "{%- if loop.index > 2 %}{%- break %}{%- endif %}"
    "{{- '<' + m.role + '>' + m.content + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<assistant>' }}{%- endif %}"
)


def test_templates_render_as_transformers_renders_them(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A template in the manner of Qwen's: `tools` is None (not an error), `raise_exception` fails
    the render with its message (InvalidRequest), loops may `break`."""
    tok = engine.tokenizer
    monkeypatch.setattr(tok, "chat_template", QWEN_LIKE)
    messages = [{"role": r, "content": c} for r, c in (("user", "a"), ("assistant", "b"), ("user", "c"))]
    assert tok.apply_chat_template(messages) == "NO TOOLS\n<user>a\n<assistant>b\n<assistant>"
    with pytest.raises(InvalidRequest, match="bad role robot"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_the_template_is_compiled_once_and_again_when_it_changes(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = engine.tokenizer
    messages = [{"role": "user", "content": "a"}]
    first = tok.apply_chat_template(messages)
    compiled = tok.compiled_template()
    assert tok.apply_chat_template(messages) == first and tok.compiled_template() is compiled  # reused
    monkeypatch.setattr(tok, "chat_template", QWEN_LIKE)
    assert tok.apply_chat_template(messages) == "NO TOOLS\n<user>a\n<assistant>"  # compiled again
    assert tok.compiled_template() is not compiled
    monkeypatch.setattr(tok, "chat_template", "{% if %}")
    with pytest.raises(InvalidRequest, match="chat template failed"):
        tok.apply_chat_template(messages)


def test_the_warm_up_finds_the_end_of_turn_before_a_request_does(checkpoint: Callable[[str], Path]) -> None:
    """A first chat request found the end-of-turn token (jinja2 imported, the template compiled)
    on the daemon's event loop; the warm-up does it before ready."""
    cold = Engine(EngineConfig.build(model=str(checkpoint(MODEL)), policy="exact"))
    assert cold.tokenizer.chat_template is not None and "end_of_turn" not in vars(cold)
    cold.warm()
    assert "end_of_turn" in vars(cold) and cold.tokenizer._compiled is not None
    assert vars(cold)["end_of_turn"] == end_of_turn(cold.tokenizer) is not None  # (the template's eos)
    cold.close()
