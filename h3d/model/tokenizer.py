"""Tokenizer: `tokenizer.json` through the `tokenizers` library, plus the chat template.

`encode(text)` returns what `transformers`' `tokenizer(text).input_ids` returns for the same folder
(special tokens only where the tokenizer's post-processor adds them). The chat template comes from
`chat_template.jinja` or `tokenizer_config.json` and is rendered with jinja2, imported only when a
prompt asks for the template.
"""

from __future__ import annotations

import bisect
import collections
import json
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer as _HFTokenizer

from h3d.errors import InvalidRequest, ModelLoadError


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        path = Path(model_dir)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"{path} has no tokenizer.json")
        try:
            self._tok = _HFTokenizer.from_file(str(tok_file))
        except Exception as exc:
            raise ModelLoadError(f"cannot read {tok_file}: {exc}") from exc
        cfg_file = path / "tokenizer_config.json"
        self._config: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        template_file = path / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else self._config.get("chat_template")
        self.chat_template: str | None = template if isinstance(template, str) else None
        self._compiled: tuple[str, Any] | None = None  # (the template, compiled: `compiled_template`)
        self.special_ids = frozenset(int(i) for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        self.memo = EncodeMemo(self._tok)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def _token_text(self, key: str) -> str | None:
        value = self._config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        return value if isinstance(value, str) else None

    def encode(self, text: str, add_special_tokens: bool = True, scope: str | None = None) -> list[int]:
        """`text`'s ids. With `scope` (an owner), a long text that begins with one encoded before in
        the same scope, up to a special token, encodes only what follows it (`EncodeMemo`)."""
        if scope is not None and len(text) >= MEMO_MIN_CHARS and self.memo.enabled:
            return self.memo.encode(text, add_special_tokens, scope)
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render `messages` ([{role, content}]) with the model's chat template, as text."""
        import jinja2

        try:
            return str(
                self.compiled_template().render(
                    messages=messages,
                    tools=None,
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    bos_token=self._token_text("bos_token") or "",
                    eos_token=self._token_text("eos_token") or "",
                )
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequest(f"chat template failed: {exc}") from exc

    def compiled_template(self) -> Any:
        """`chat_template`, compiled once (a jinja2 `Template`: its renders are thread-safe), as
        transformers renders it: undefined names are falsy (Qwen's templates test `tools`), `tools`
        and `documents` are None, `raise_exception` fails the render, loops may break.
        InvalidRequest without a template, or where it does not compile."""
        template = self.chat_template
        if template is None:
            raise InvalidRequest("this model has no chat template")
        compiled = self._compiled
        if compiled is not None and compiled[0] == template:
            return compiled[1]
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = raise_exception
        try:
            self._compiled = (template, env.from_string(template))
        except jinja2.TemplateError as exc:
            raise InvalidRequest(f"chat template failed: {exc}") from exc
        return self._compiled[1]


MEMO_MIN_CHARS = 4096  # shorter texts are encoded whole (the memo's bookkeeping would cost more)
MEMO_TEXTS = 32  # texts the memo keeps, least recently used dropped first
MEMO_KEY_CHARS = 64  # a cut's key: the characters before it (the whole prefix is compared on a hit)


@dataclass(slots=True)
class _Encoded:
    text: str
    ids: np.ndarray  # int64
    cuts: dict[int, int]  # character offset just past a special token -> the ids before it
    scope: str
    add: bool  # add_special_tokens


class EncodeMemo:
    """A conversation sent again, longer (a stateless chat client's next turn), is encoded again
    only past what it shares with one encoded before.

    The tokenizer splits a text at its added tokens before anything else, so the ids of a text up
    to the end of a special token do not depend on what follows it: those are taken from the
    earlier text's ids, and only the rest is encoded. Kept for the last `MEMO_TEXTS` texts of at
    least `MEMO_MIN_CHARS`, each under its scope (the session's owner: one owner's texts never
    shorten another's encoding, whose time would tell what they sent), and `enabled` only for a
    tokenizer whose special tokens strip nothing around them and whose post-processor appends
    nothing at the end, checked at load by encoding probe texts both ways. Thread-safe."""

    def __init__(self, tok: _HFTokenizer) -> None:
        self._tok = tok
        added = tok.get_added_tokens_decoder()
        specials = [t.content for t in added.values() if t.special and t.content]
        self._special_ids = np.array(sorted(i for i, t in added.items() if t.special), dtype=np.int64)
        self._pattern = re.compile("|".join(re.escape(t) for t in sorted(set(specials), key=len, reverse=True)))
        self._texts: collections.OrderedDict[int, _Encoded] = collections.OrderedDict()
        self._cuts: dict[tuple[str, bool, int, str], tuple[int, int]] = {}  # key -> (text's id, ids before)
        self._ids = 0
        self._lock = threading.Lock()
        self.hits = 0  # encodings that reused an earlier text's ids
        self.reused_chars = 0
        self.enabled = bool(specials) and self._agrees(tok, specials)

    @staticmethod
    def _agrees(tok: _HFTokenizer, specials: list[str]) -> bool:
        for t in tok.get_added_tokens_decoder().values():
            if t.special and (t.lstrip or t.rstrip or t.single_word):
                return False
        for special in specials[:32]:
            for before, after in (("Hi", " there"), ("a\n", "\n\nHello"), ("x ", "  y"), ("", "z")):
                for add in (True, False):
                    whole = tok.encode(before + special + after, add_special_tokens=add).ids
                    head = tok.encode(before + special, add_special_tokens=add).ids
                    if whole != head + tok.encode(after, add_special_tokens=False).ids:
                        return False
        return True

    def encode(self, text: str, add_special_tokens: bool, scope: str) -> list[int]:
        cuts = [m.end() for m in self._pattern.finditer(text)]
        found = self._find(text, cuts, add_special_tokens, scope)
        if found is None:
            enc = self._tok.encode(text, add_special_tokens=add_special_tokens)
            ids, starts = np.asarray(enc.ids, dtype=np.int64), [a for a, _ in enc.offsets]
            # The ids before each cut: those starting before it (a special token ends exactly there).
            before = [bisect.bisect_left(starts, c) for c in cuts]
        else:
            at, head, known = found
            enc = self._tok.encode(text[at:], add_special_tokens=False)
            ids = np.concatenate([head, np.asarray(enc.ids, dtype=np.int64)])
            tail = [a + at for a, _ in enc.offsets]
            # The cuts up to `at` are the earlier text's (its prefix); the others counted here.
            before = [known.get(c, 0) if c <= at else bisect.bisect_left(tail, c) + len(head) for c in cuts]
            with self._lock:
                self.hits += 1
                self.reused_chars += at
        # A cut is kept only where the id before it is a special token's (the offsets agree).
        good = [(c, n) for c, n in zip(cuts, before, strict=True) if 0 < n <= len(ids)]
        ends = np.isin(ids[[n - 1 for _, n in good]], self._special_ids) if good else np.zeros(0, bool)
        self._keep(
            _Encoded(text, ids, {c: n for (c, n), ok in zip(good, ends, strict=True) if ok}, scope, add_special_tokens)
        )
        return ids.tolist()

    def _find(self, text: str, cuts: list[int], add: bool, scope: str) -> tuple[int, np.ndarray, dict[int, int]] | None:
        """The longest cut of `text` whose prefix an earlier text had: (the cut, the ids before it,
        the earlier text's cuts)."""
        with self._lock:
            for cut in reversed(cuts):
                if cut >= len(text):
                    continue  # at least a character after it (nothing to gain, and an end is its own case)
                hit = self._cuts.get((scope, add, cut, text[max(0, cut - MEMO_KEY_CHARS) : cut]))
                if hit is None:
                    continue
                earlier = self._texts.get(hit[0])
                if earlier is None or not text.startswith(earlier.text[:cut]):
                    continue
                self._texts.move_to_end(hit[0])
                return cut, earlier.ids[: hit[1]], earlier.cuts
        return None

    def _keep(self, e: _Encoded) -> None:
        with self._lock:
            self._ids += 1
            self._texts[self._ids] = e
            for cut, before in e.cuts.items():
                self._cuts[(e.scope, e.add, cut, e.text[max(0, cut - MEMO_KEY_CHARS) : cut])] = (self._ids, before)
            while len(self._texts) > MEMO_TEXTS:
                gone_id, gone = self._texts.popitem(last=False)
                for cut in gone.cuts:
                    key = (gone.scope, gone.add, cut, gone.text[max(0, cut - MEMO_KEY_CHARS) : cut])
                    if self._cuts.get(key, (0,))[0] == gone_id:
                        del self._cuts[key]
