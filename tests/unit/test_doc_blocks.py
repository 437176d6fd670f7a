"""The docs test's reading of pages and banners, and its output check
(tests/helpers/doc_blocks.py): the check rejects what differs in structure."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.doc_blocks import Block, banner_blocks, markdown_blocks, mismatch
from tools.local_cluster import examples

PAGE = """# Title

```text
a diagram, no command before it
```

```bash
curl -s http://127.0.0.1:8000/v1/models
```

```text
{"object": "list"}
```

Prose between.

```python
print("hi")
```

Prose, then an output block that is not right after a command:

```text
not an output
```

```yaml
key: value
```
"""


def test_runnable_blocks_with_the_output_shown_right_after_them():
    assert markdown_blocks(PAGE, "P.md") == [
        Block("P.md:7", "bash", "curl -s http://127.0.0.1:8000/v1/models\n", '{"object": "list"}\n'),
        Block("P.md:17", "python", 'print("hi")\n', None),
    ]


def test_banner_examples_are_the_commented_paragraphs_between_the_markers():
    banner = "serving\nExamples (paste):\n\n# one\nls\n\n# two\n# more\ncat - <<'EOF'\nx\nEOF\n\nCtrl-C drains\n"
    blocks = banner_blocks(banner, "Examples (", "Ctrl-C drains")
    assert [b.code for b in blocks] == ["# one\nls\n", "# two\n# more\ncat - <<'EOF'\nx\nEOF\n"]


def test_json_is_compared_by_keys_and_types_not_values():
    shown = '{"count": 2, "tokens": [19556, 905], "token_strs": null, "model": "x"}'
    assert mismatch(shown, '{"count": 7, "tokens": [1], "token_strs": null, "model": "y"}') is None
    assert "keys" in mismatch(shown, '{"count": 7, "tokens": [1], "model": "y"}')
    assert "$.count" in mismatch(shown, '{"count": "7", "tokens": [1], "token_strs": null, "model": "y"}')
    assert "$.tokens[1]" in mismatch(shown, '{"count": 7, "tokens": [1, "a"], "token_strs": null, "model": "y"}')
    assert "empty" in mismatch(shown, '{"count": 7, "tokens": [], "token_strs": null, "model": "y"}')
    assert "$.token_strs" in mismatch(shown, '{"count": 7, "tokens": [1], "token_strs": [], "model": "y"}')
    assert "JSON shown" in mismatch(shown, "Traceback (most recent call last)")


def test_text_lines_match_literally_but_for_ellipses():
    shown = "…\n[length: 5 prompt tokens (0 cached), 16 generated]\n"
    assert mismatch(shown, " Paris.\n\nMore text\n[length: 5 prompt tokens (0 cached), 16 generated]") is None
    assert mismatch(shown, "[length: 5 prompt tokens (0 cached), 16 generated]") is None
    assert mismatch(shown, " Paris.\n[stop: 5 prompt tokens (0 cached), 9 generated]") is not None
    assert mismatch(shown, "[length: 5 prompt tokens (0 cached), 16 generated]\nextra") is not None
    assert mismatch("stop 38 …", "stop 38 12") is None
    assert mismatch("stop 38 …", "length 38 32") is not None


def test_the_serving_guide_shows_the_banner_examples_the_launcher_prints():
    guide = (Path(__file__).resolve().parents[2] / "docs" / "guide" / "serving.md").read_text()
    admin = ("127.0.0.1:50052", Path("/tmp/pagedserve-secrets-hfl6gi3e/admin.key"))
    shown = examples(".venv/bin/python", "SmolLM2-135M-Instruct", "127.0.0.1:50051", "http://127.0.0.1:8000", admin)
    assert len(shown) == 6
    for example in shown:
        assert f"# {example.what}\n{example.command}\n" in guide, example.what
