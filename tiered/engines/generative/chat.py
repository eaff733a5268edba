"""Chat messages to a prompt: the model's own chat template, as Hugging Face
checkpoints carry it (`chat_template` in tokenizer_config.json, or a
chat_template.jinja file beside it), rendered by a sandboxed Jinja; a model
without one gets `PLAIN`, a role-per-line form ending in "assistant:".
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tiered.errors import ConfigError, InvalidArgument

PLAIN = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
         "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_MESSAGES = 1024


class ChatTemplate:
    def __init__(self, source: str = PLAIN, special: Mapping[str, str] | None = None,
                 where: str = "the plain template") -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise InvalidArgument(f"messages: {message}")

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = raise_exception
        try:
            self._template = environment.from_string(source)
        except TemplateError as error:
            raise ConfigError(f"{where}: the chat template does not parse: {error}") from error
        self._special = dict(special or {})
        self.where = where

    @classmethod
    def of(cls, directory: Path) -> ChatTemplate:
        """The template a model directory (or the version whose file it is)
        carries, else `PLAIN`."""
        directory = Path(directory) if Path(directory).is_dir() else Path(directory).parent
        config_path = directory / "tokenizer_config.json"
        try:
            config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        except (OSError, ValueError) as error:
            raise ConfigError(f"{config_path}: {error}") from error
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            source = next((t.get("template") for t in source
                           if isinstance(t, dict) and t.get("name") == "default"), None)
        where = str(config_path)
        jinja = directory / "chat_template.jinja"
        if not source and jinja.is_file():
            source, where = jinja.read_text(), str(jinja)
        special = {name: _token_text(config.get(name))
                   for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        if not isinstance(source, str) or not source:
            return cls(PLAIN, special)
        return cls(source, special, where)

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt for `messages`, ready for the assistant's turn."""
        from jinja2 import TemplateError

        try:
            return self._template.render(messages=messages, add_generation_prompt=True,
                                         **self._special)
        except TemplateError as error:
            raise InvalidArgument(f"messages: the model's chat template ({self.where}) "
                                  f"failed: {error}") from error


def read_messages(value: Any) -> list[dict[str, str]]:
    """Chat messages as OpenAI's API sends them (a JSON text or the list):
    each an object with a `role` and a `content`, a string or a list of text
    parts; checked, as plain role/content pairs."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise InvalidArgument(f"messages: not JSON: {error}") from error
    if not isinstance(value, list) or not value or len(value) > MAX_MESSAGES:
        raise InvalidArgument(f"messages: expected a list of 1..{MAX_MESSAGES} messages")
    out = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise InvalidArgument(f"{where}: expected an object with role and content")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise InvalidArgument(f"{where}.role: expected one of {', '.join(ROLES)}, "
                                  f"got {role!r}")
        if isinstance(content, list):  # text parts
            parts = [p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None
                     for p in content]
            if None in parts:
                raise InvalidArgument(f"{where}.content: only text parts are understood")
            content = "".join(parts)
        if not isinstance(content, str):
            raise InvalidArgument(f"{where}.content: expected text")
        out.append({"role": role, "content": content})
    return out


def _token_text(token: Any) -> str:
    """A special token as tokenizer_config.json gives it: text, or an object
    whose `content` is the text."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else ""
