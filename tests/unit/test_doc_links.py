"""The README's and the user guide's relative links lead somewhere: the file
exists and, for `file.md#anchor`, a heading of that file makes that anchor
(GitHub's rule: lower case, punctuation dropped, spaces to hyphens)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs" / "guide").glob("*.md"))]
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_resolves():
    assert len(PAGES) >= 7
    checked, broken = 0, []
    for page in PAGES:
        for target in _LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            checked += 1
            if not resolved.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and anchor not in anchors(resolved):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert checked > 20 and not broken, broken


def test_the_anchor_rule_on_headings_with_code_and_slashes():
    page = REPO / "docs" / "guide" / "serving.md"
    assert "make-cluster--make-down-a-local-cluster-in-the-background" in anchors(page)


def test_the_readme_stays_a_front_page():
    """What a newcomer reads first (issue 36): reference material goes to docs/guide/."""
    assert len((REPO / "README.md").read_text().splitlines()) <= 250
