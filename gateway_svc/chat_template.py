"""The model's chat template, rendered with jinja2 the way transformers does.

Sources, first found wins: `chat_template.jinja` (current HF layout),
`chat_template.json`, then `tokenizer_config.json`'s `chat_template` (a string,
or a list of named templates of which we take "default"). Templates run in
jinja2's immutable sandbox (they come with downloaded checkpoints) with HF's
options (trim_blocks, lstrip_blocks) and helpers (raise_exception, tojson,
strftime_now), and see every `*_token` of the tokenizer config (bos_token,
eos_token, ...). `--chat-template FILE|TEXT` replaces the model's template
(vLLM's flag); `--chat-template-content-format` says whether the template reads
a message's content as a string or as OpenAI's list of parts (auto: the
template's own code says: one that loops over a message's content takes parts).
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

CONTENT_FORMATS = ("auto", "string", "openai")
# `{% for part in message['content'] %}` / `message.content`: a template that walks the parts.
_LOOPS_OVER_CONTENT = re.compile(r"for\s+\w+\s+in\s+\w+(\.content\b|\[\s*['\"]content['\"]\s*\])")


class ChatTemplateError(ValueError):
    """The template rejected the conversation (e.g. via raise_exception)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, content_format: str = "auto"):
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._template = _environment().from_string(source)  # syntax errors surface at start-up
        if content_format == "auto":
            content_format = "openai" if _LOOPS_OVER_CONTENT.search(source) else "string"
        self.content_format = content_format

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        variables: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text. `continue_final_message`: the last message stays open, the
        text ends where its content ends (transformers' rule); `variables`: more
        names for the template (chat_template_kwargs)."""
        if self.content_format == "openai":  # the text as one part: the template walks parts
            messages = [{**m, "content": [{"type": "text", "text": m.get("content") or ""}]} for m in messages]
        try:
            text = self._template.render(
                **{**self.special_tokens, **(variables or {})},
                messages=messages,
                add_generation_prompt=add_generation_prompt,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template: {exc}") from exc
        if not continue_final_message:
            return text
        final = _text(messages[-1].get("content")).strip()
        end = text.rfind(final) if final else -1
        if end < 0:
            raise ChatTemplateError("chat template: the final message's content is not in the rendered prompt")
        return text[: end + len(final)]

    @classmethod
    def load(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The template of a model directory, or None when it has none."""
        model_dir = Path(model_dir)
        tok_config = _read_json(model_dir / "tokenizer_config.json")
        source = _template_source(model_dir, tok_config)
        return cls(source, _special_tokens(tok_config)) if source else None

    @classmethod
    def from_flags(cls, model_dir: str, chat_template: str = "", content_format: str = "auto") -> ChatTemplate | None:
        """The template the gateway's flags give: --chat-template (a file, or the template
        itself) over the model's; ValueError naming the flag when it is neither."""
        if content_format not in CONTENT_FORMATS:
            raise ValueError(f"--chat-template-content-format: must be one of {', '.join(CONTENT_FORMATS)}")
        tok_config = _read_json(Path(model_dir) / "tokenizer_config.json") if model_dir else {}
        source: str | None
        if chat_template:
            path = Path(chat_template)
            if path.is_file():
                source = path.read_text()
            elif "{{" in chat_template or "{%" in chat_template:
                source = chat_template
            else:
                raise ValueError(f"--chat-template: {chat_template!r} is neither a file nor a Jinja template")
        else:
            source = _template_source(Path(model_dir), tok_config) if model_dir else None
        if not source:
            return None
        try:
            return cls(source, _special_tokens(tok_config), content_format)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ValueError(f"--chat-template: not a valid Jinja template: {exc}") from None


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content)
    return str(content or "")


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _template_source(model_dir: Path, tok_config: dict[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    source = _read_json(model_dir / "chat_template.json").get("chat_template") or tok_config.get("chat_template")
    if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    return source if isinstance(source, str) and source else None


def _special_tokens(tok_config: dict[str, Any]) -> dict[str, str]:
    # Tokens are strings or AddedToken dicts ({"content": ...}).
    tokens = {}
    for key, value in tok_config.items():
        if key.endswith("_token") and value:
            tokens[key] = value["content"] if isinstance(value, dict) else str(value)
    return tokens
