"""Build an argparse CLI from a config dataclass; every flag also reads an env var.

A field `num_blocks` becomes `--num-blocks` and `<PREFIX>_NUM_BLOCKS`; the flag
wins over the env var, which wins over the default. `metadata={"aliases": (...)}`
adds other spellings of the flag (the names vLLM users type). Help text comes from
`field(metadata={"help": ...})`. After parsing, `config.validate()` runs and a
ValueError there becomes a clean argparse error naming the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_name(prefix: str, field_name: str) -> str:
    return f"{prefix}_{field_name.upper()}"


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def _converter(tp: Any) -> Callable[[str], Any]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _converter(inner[0])
    if tp is bool:
        return _parse_bool
    return tp if tp in (int, float, str) else str


def module_prog(module: str) -> str:
    """The command that runs `module`, for a usage line: `python -m worker_svc` for
    worker_svc.__main__ (argparse would name the file, `__main__.py`)."""
    return f"python -m {module.removesuffix('.__main__')}"


def build_parser(cls: type[Any], prefix: str, description: str) -> argparse.ArgumentParser:
    # The service is its config's package: worker_svc.config.WorkerConfig -> python -m worker_svc.
    parser = argparse.ArgumentParser(prog=module_prog(cls.__module__.split(".")[0]), description=description)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        env = env_name(prefix, f.name)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[operator]
        help_text = f"{f.metadata.get('help', '')} (env {env})"
        choices = f.metadata.get("choices")
        flags = [flag_name(f.name), *f.metadata.get("aliases", ())]
        if hints[f.name] is bool:
            parser.add_argument(
                *flags, dest=f.name, default=None, action=argparse.BooleanOptionalAction, help=help_text
            )
        else:
            parser.add_argument(
                *flags,
                dest=f.name,
                default=None,
                type=_converter(hints[f.name]),
                choices=choices,
                help=help_text + f" [default: {default}]",
                # A list flag (vLLM's --lora-modules A=x B=y) is one space-separated string field.
                nargs=f.metadata.get("nargs"),
            )
    return parser


def parse_config(cls: type[T], prefix: str, description: str, argv: list[str] | None = None) -> T:
    parser = build_parser(cls, prefix, description)
    args = parser.parse_args(argv)
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]  # T is a dataclass: every caller passes one
        value = getattr(args, f.name)
        if isinstance(value, list):
            value = " ".join(value)
        env = os.environ.get(env_name(prefix, f.name))
        if value is None and env is not None:
            try:
                value = _converter(hints[f.name])(env)
            except (ValueError, argparse.ArgumentTypeError) as exc:
                parser.error(f"{env_name(prefix, f.name)}={env!r}: {exc}")
        if value is not None:
            values[f.name] = value
    config = cls(**values)
    try:
        config.validate()  # type: ignore[attr-defined]
    except ValueError as exc:
        parser.error(str(exc))
    return config
