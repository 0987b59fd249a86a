"""Tokenizer: `tokenizer.json` through the `tokenizers` library, plus the chat template.

`encode(text)` returns what `transformers`' `tokenizer(text).input_ids` returns for the same folder
(special tokens only where the tokenizer's post-processor adds them). The chat template comes from
`chat_template.jinja` or `tokenizer_config.json` and is rendered with jinja2, imported only when a
prompt asks for the template.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
        self.special_ids = frozenset(int(i) for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def _token_text(self, key: str) -> str | None:
        value = self._config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        return value if isinstance(value, str) else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render `messages` ([{role, content}]) with the model's chat template, as text."""
        if self.chat_template is None:
            raise InvalidRequest("this model has no chat template")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.TemplateError(message)

        # As transformers renders them: undefined names are falsy (Qwen's templates test `tools`),
        # `tools` and `documents` are None, `raise_exception` fails the render, loops may break.
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._token_text("bos_token") or "",
                eos_token=self._token_text("eos_token") or "",
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequest(f"chat template failed: {exc}") from exc
