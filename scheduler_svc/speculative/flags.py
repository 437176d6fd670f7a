"""The speculative-decoding flags as vLLM spells them: `--speculative-method` and its
options, or one `--speculative-config` JSON; either way an NgramConfig, or None (off).
A ValueError names the flag or key at fault (the values' ranges: NgramConfig.problems)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from scheduler_svc.speculative.ngram import NgramConfig
from svc_common.cli import flag_name

# --speculative-method's values (vLLM's names of the methods built here).
SPECULATIVE_METHODS = ("ngram",)
# vLLM's --speculative-config keys -> the fields of the flags they stand for.
SPECULATIVE_CONFIG_KEYS = {
    "method": "speculative_method",
    "num_speculative_tokens": "num_speculative_tokens",
    "prompt_lookup_min": "ngram_min",
    "prompt_lookup_max": "ngram_max",
    "disable_by_batch_size": "speculative_disable_by_batch_size",
}
_NGRAM = NgramConfig()  # the flags' defaults


@dataclass
class SpeculativeFlags:
    """The flags themselves; SchedulerConfig inherits them."""

    speculative_method: str = field(
        default="",
        metadata={
            "help": "speculative decoding (vLLM's method names): ngram = decodes carry up to "
            "--num-speculative-tokens drafts found by prompt lookup (n-grams of --ngram-min..--ngram-max tokens), "
            "verified by the worker in the same forward; '' = off"
        },
    )
    speculative_config: str = field(
        default="",
        metadata={
            "help": "vLLM's JSON form of the speculative flags, instead of them: "
            '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}\' '
            "(also disable_by_batch_size); a key left out takes its flag's default; an unknown method or key is "
            "refused"
        },
    )
    num_speculative_tokens: int = field(
        default=_NGRAM.num_speculative_tokens, metadata={"help": "drafts per decode (vLLM's meaning)"}
    )
    ngram_min: int = field(default=_NGRAM.ngram_min, metadata={"help": "shortest n-gram matched (prompt_lookup_min)"})
    ngram_max: int = field(default=_NGRAM.ngram_max, metadata={"help": "longest n-gram matched (prompt_lookup_max)"})
    speculative_disable_by_batch_size: int = field(
        default=_NGRAM.disable_by_batch_size,
        metadata={"help": "no drafts while more requests than this run (vLLM's meaning): past it, overlap pays more"},
    )

    def speculative(self) -> NgramConfig | None:
        """The drafts' options, from the flags or --speculative-config; None: off."""
        defaults = {f.name: f.default for f in fields(SpeculativeFlags)}
        return speculative_options(
            {name: getattr(self, name) for name in SPECULATIVE_CONFIG_KEYS.values()},
            {name: defaults[name] for name in SPECULATIVE_CONFIG_KEYS.values()},
            self.speculative_config,
        )


def speculative_options(flags: dict[str, Any], defaults: dict[str, Any], config_json: str) -> NgramConfig | None:
    """`flags` / `defaults`: the flags' fields (SPECULATIVE_CONFIG_KEYS' values) as given and
    by default; `config_json`: --speculative-config ('' when not given)."""
    options = _config_options(config_json, flags, defaults) if config_json else dict(flags)
    method = options.pop("speculative_method")
    if not method:
        return None
    if method not in SPECULATIVE_METHODS:
        flag = "--speculative-config: method" if config_json else "--speculative-method"
        raise ValueError(f"{flag}: unknown method {method!r} (this scheduler has: {', '.join(SPECULATIVE_METHODS)})")
    config = NgramConfig(
        options["num_speculative_tokens"],
        options["ngram_min"],
        options["ngram_max"],
        options["speculative_disable_by_batch_size"],
    )
    if config_json and (problems := config.problems()):
        for key, name in SPECULATIVE_CONFIG_KEYS.items():  # name the JSON's keys, not the flags
            problems = [p.replace(flag_name(name), key) for p in problems]
        raise ValueError(f"--speculative-config: {'; '.join(problems)}")
    return config


def _config_options(config_json: str, flags: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """--speculative-config's JSON as the flags' fields; keys left out take the flags' defaults."""
    try:
        given = json.loads(config_json)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config: not JSON ({exc})") from None
    if not isinstance(given, dict):
        raise ValueError('--speculative-config: must be a JSON object, e.g. {"method": "ngram"}')
    if unknown := sorted(given.keys() - SPECULATIVE_CONFIG_KEYS.keys()):
        raise ValueError(
            f"--speculative-config: unknown key(s) {', '.join(unknown)} (known: {', '.join(SPECULATIVE_CONFIG_KEYS)})"
        )
    if not isinstance(given.get("method"), str) or not given["method"]:
        raise ValueError('--speculative-config: method must be given, a string (e.g. "ngram")')
    for key, value in given.items():
        if key != "method" and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"--speculative-config: {key} must be an integer, got {value!r}")
    beside = [flag_name(name) for name, value in flags.items() if value != defaults[name]]
    if beside:
        raise ValueError(f"--speculative-config: not with {', '.join(beside)} (give those options in the JSON)")
    options = dict(defaults)
    options.update({SPECULATIVE_CONFIG_KEYS[key]: value for key, value in given.items()})
    return options
