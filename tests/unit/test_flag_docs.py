"""docs/guide/flags.md is what `python -m tools.flag_docs` makes of the services'
configuration dataclasses, every flag of every service is on it, and a row says
what the parser takes (aliases, the negation of a boolean, choices, env var)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from svc_common.cli import build_parser, env_name, flag_name
from tools import flag_docs


def test_the_committed_page_is_what_the_code_generates():
    assert flag_docs.OUTPUT.read_text() == flag_docs.render(), (
        "docs/guide/flags.md is out of date: run `python -m tools.flag_docs`"
    )


def test_every_flag_and_env_var_of_every_service_is_on_the_page():
    page = flag_docs.render()
    for service in flag_docs.SERVICES:
        parser = build_parser(service.config, service.env_prefix, "")
        options = {o for action in parser._actions for o in action.option_strings} - {"-h", "--help"}
        assert len(options) >= len(dataclasses.fields(service.config)) > 10
        for option in options:
            assert f"`{option}`" in page, (service.title, option)
        for f in dataclasses.fields(service.config):
            assert f"`{env_name(service.env_prefix, f.name)}`" in page


@dataclass
class _Toy:
    kv_dtype: str = field(
        default="auto", metadata={"help": "cpu | cuda", "choices": ("auto", "fp8"), "aliases": ("--kv-cache-dtype",)}
    )
    enforce_eager: bool = field(default=False, metadata={"help": "no graphs"})
    tokenizer: str = field(default="", metadata={"help": "a directory"})


def test_a_row_carries_aliases_negations_choices_defaults_and_escapes_pipes():
    page = flag_docs.render((flag_docs.Service("Toy", "python -m toy", _Toy, "TOY"),))
    rows = [line for line in page.splitlines() if line.startswith("| `--")]
    assert rows == [
        "| `--kv-dtype`<br>`--kv-cache-dtype` | `TOY_KV_DTYPE` | `auto` | cpu \\| cuda (one of: auto, fp8) |",
        "| `--enforce-eager`<br>`--no-enforce-eager` | `TOY_ENFORCE_EAGER` | `False` | no graphs |",
        "| `--tokenizer` | `TOY_TOKENIZER` | (empty) | a directory |",
    ]
    assert "## Toy: `python -m toy`" in page
    # The negation printed is the one argparse takes.
    parsed = build_parser(_Toy, "TOY", "").parse_args(["--no-enforce-eager", "--kv-cache-dtype", "fp8"])
    assert (parsed.enforce_eager, parsed.kv_dtype) == (False, "fp8")
    assert flag_name("enforce_eager") == "--enforce-eager"


def test_check_mode_fails_on_a_stale_page_and_writing_fixes_it(tmp_path, capsys):
    page = tmp_path / "flags.md"
    page.write_text(flag_docs.render().replace("--num-blocks", "--blocks"))
    assert flag_docs.main(["--check", "--out", str(page)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert flag_docs.main(["--out", str(page)]) == 0
    assert flag_docs.main(["--check", "--out", str(page)]) == 0
