"""Chat sessions: a conversation of messages rendered through the model's chat template.

A chat session's context is the template's rendering of its conversation, appended piece by
piece: each message adds the text by which the rendering of the conversation with it extends the
rendering without it, and a generation adds the assistant turn's header (the template's generation
prompt), then the model's tokens until the end-of-turn token. Templates render a conversation's
prefix as a prefix of the whole (ChatML, Llama 3, the tiny test template): that is what makes the
context of a chat session equal to the template applied to the whole conversation at once.

`Conversation` is owned by its `Session` (engine thread). It keeps the closed messages and, while
an assistant turn is open, where the turn's tokens start; the turn's text is decoded from those
tokens when the next message closes it, so a turn cut short (cancelled, crashed) closes as well.
`chat_piece` is what a request adds to a chat session (`h3d.engine.journal` logs it, and replays
a conversation from its log).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from h3d.errors import InvalidRequest, clip
from h3d.model.tokenizer import Tokenizer

ROLES = ("user", "assistant", "system")
_MARK = "\x00h3d-turn\x00"


@dataclass(slots=True)
class Conversation:
    messages: list[dict[str, str]] = field(default_factory=list)
    open_at: int | None = None  # an assistant turn is open: its tokens start at this context index
    tail: str = ""  # text that closes the last generated turn, still to be appended (e.g. "\n")

    def copy(self) -> Conversation:
        return Conversation(list(self.messages), self.open_at, self.tail)

    def add(self, tok: Tokenizer, role: str, content: str, tokens: list[int]) -> str:
        """The text to append to the context for a new message (`tokens`: the context so far)."""
        if role not in ROLES:
            raise InvalidRequest(f"role: {clip(role)!r} is not one of {', '.join(ROLES)}")
        self.close_turn(tok, tokens)
        before = render(tok, self.messages, generation=False)
        after = render(tok, [*self.messages, {"role": role, "content": content}], generation=False)
        delta = _extension(before, after)
        self.messages.append({"role": role, "content": content})
        text, self.tail = self.tail + delta, ""
        return text

    def open_turn(self, tok: Tokenizer, tokens: list[int]) -> str:
        """The assistant turn's header, to append before generating."""
        self.close_turn(tok, tokens)
        before = render(tok, self.messages, generation=False)
        header = _extension(before, render(tok, self.messages, generation=True))
        text, self.tail = self.tail + header, ""
        return text

    def begin(self, at: int) -> None:
        """The turn's header is in the context; generated tokens start at `at`."""
        self.open_at = at

    def close_turn(self, tok: Tokenizer, tokens: list[int]) -> None:
        """Record the open turn (if any) as an assistant message, and what still closes it."""
        if self.open_at is None:
            return
        generated = tokens[self.open_at :]
        self.open_at = None
        content = tok.decode(generated)
        before = render(tok, self.messages, generation=True)
        after = render(tok, [*self.messages, {"role": "assistant", "content": content}], generation=False)
        self.messages.append({"role": "assistant", "content": content})
        closing = after[len(before) + len(content) :] if after.startswith(before + content) else ""
        said = tok.decode(generated, skip_special_tokens=False)
        ending = said[len(content) :] if said.startswith(content) else ""
        # The end-of-turn token the model produced is in the context already; the rest is not.
        self.tail = closing[len(ending) :] if ending and closing.startswith(ending) else closing


def chat_piece(
    chat: Conversation | None,
    tok: Tokenizer,
    tokens: list[int],
    text: str | None,
    ids: list[int],
    role: str | None,
    generate: bool,
) -> tuple[tuple[Conversation, str], dict[str, object] | None] | tuple[None, None]:
    """For a chat session (`chat`, its context `tokens`): its conversation as it will be once this
    request's piece is added, the piece's text and its log record (nothing changes until the
    request is accepted)."""
    if chat is None:
        if role:
            raise InvalidRequest("role: only a chat session's appends have roles")
        return None, None
    if ids:
        raise InvalidRequest("a chat session takes messages as text, not token ids")
    if generate and text:
        raise InvalidRequest("a chat generation's prompt is a message: append it first (as Engine.generate does)")
    chat = chat.copy()
    if generate:
        turn: dict[str, object] = {"turn": "assistant"}
        return (chat, chat.open_turn(tok, tokens)), turn
    if not text:
        raise InvalidRequest("a chat message needs text")
    piece = chat.add(tok, role or "user", text, tokens)
    message: dict[str, object] = dict(chat.messages[-1])
    return (chat, piece), message


def render(tok: Tokenizer, messages: list[dict[str, str]], generation: bool) -> str:
    return tok.apply_chat_template(messages, add_generation_prompt=generation) if messages or generation else ""


def end_of_turn(tok: Tokenizer) -> int | None:
    """The token that ends an assistant turn in this template (ChatML's `<|im_end|>`), if the
    template closes a turn with a special token."""
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARK}]
    text = tok.apply_chat_template(probe, add_generation_prompt=False)
    after = text.split(_MARK, 1)[-1] if _MARK in text else ""
    ids = tok.encode(after, add_special_tokens=False) if after else []
    return ids[0] if ids and ids[0] in tok.special_ids else None


def _extension(before: str, after: str) -> str:
    if not after.startswith(before):
        raise InvalidRequest(
            "this model's chat template does not render a conversation incrementally (a longer "
            "conversation does not extend a shorter one): use a plain session and apply the template yourself"
        )
    return after[len(before) :]
