"""A model directory whose chat template renders tools in the Hermes/Qwen format
and a Qwen3-style reasoning switch, for the gateway's --tool-call-parser hermes
and --reasoning-parser qwen3: a template only (the fake scheduler's tests), or
a tiny checkpoint's files beside it (real processes)."""

from __future__ import annotations

from pathlib import Path

# Qwen2.5 / Qwen3's shape, cut down: the tools as JSON in the system turn, calls in
# <tool_call> tags (arguments as an object), tool results as their own turn, and
# `enable_thinking: false` closing an empty reasoning in the prompt.
TOOL_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call functions. Signatures:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Answer a call as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{% endfor %}{% endif %}{{ m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""


# A weather function's parameters (the APIs' tool round trips): a short city, nothing else.
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}


def tool_model_dir(directory: Path, checkpoint: Path | None = None) -> Path:
    """`directory` holding TOOL_TEMPLATE as its chat_template.jinja, and links to the files of
    `checkpoint` (its own template is shadowed: chat_template.jinja is read first)."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in sorted(checkpoint.iterdir()) if checkpoint is not None else []:
        if path.name != "chat_template.jinja":
            (directory / path.name).symlink_to(path.resolve())
    (directory / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    return directory
