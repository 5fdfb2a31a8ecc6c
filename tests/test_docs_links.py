"""Every relative link in the README and ``docs/`` reaches a file that exists, and its ``#section`` a heading there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def links(text: str) -> list[str]:
    """The targets of Markdown links and images outside fenced code."""
    return LINK.findall(FENCE.sub("", text))


def anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {anchor(match) for match in re.findall(r"^#+ (.+)$", text, re.M)}


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    found = []
    for target in links(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):  # https:, mailto: ...
            continue
        file_part, _, section = target.partition("#")
        path = (page.parent / file_part).resolve() if file_part else page
        if not path.exists():
            found.append(f"{target}: no such file")
        elif section and path.suffix == ".md" and section not in anchors(path):
            found.append(f"{target}: no heading #{section} in {path.relative_to(root)}")
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_an_existing_file_and_heading(page: Path) -> None:
    assert broken_links(page) == []


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {Path(target.partition("#")[0]).name for target in links((ROOT / "README.md").read_text())}

    assert sorted(p.name for p in PAGES[1:] if p.name not in linked) == []


def test_the_checker_finds_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# B\n\n## The `grpo_env_aware` estimator's part\n")
    page = tmp_path / "a.md"
    page.write_text(
        "[ok](b.md#the-grpo_env_aware-estimators-part) [gone](c.md) [bad](b.md#nope) [web](https://x.org/y)\n"
        "```\n[in code](nowhere.md)\n```\n"
    )

    assert broken_links(page, tmp_path) == ["c.md: no such file", "b.md#nope: no heading #nope in b.md"]
