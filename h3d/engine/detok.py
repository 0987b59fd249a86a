"""Incremental detokenization that never emits a broken UTF-8 character.

Byte-level BPE splits multi-byte characters across tokens; decoding a prefix can end in U+FFFD.
As in vLLM, the text is decoded over a short window of previous tokens and new text is released
only once it no longer ends in a replacement character.
"""

from __future__ import annotations

from h3d.model.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens whose text has been released
        self.text = ""

    def push(self, token_id: int) -> str:
        """Add one token; return the newly complete text (possibly empty)."""
        self._ids.append(token_id)
        window = self._ids[self._prefix :]
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        full = self._tok.decode(window, self._skip)
        if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
            delta = full[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(self._ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Release whatever is pending at the end of a generation (even a lone replacement char)."""
        full = self._tok.decode(self._ids[self._prefix :], self._skip)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        delta = full[len(prefix_text) :]
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta
