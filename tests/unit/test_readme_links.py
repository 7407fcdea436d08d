"""README.md's links: every relative link points to a file or folder that exists, and every anchor
to a heading of its page. The README lies outside docs/, so `mkdocs build --strict` (which checks
the links between the pages of the site) never reads it; this keeps its links from rotting when a
page or a heading moves."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")


def prose(text: str) -> list[str]:
    """The lines outside fenced and indented code blocks, inline code spans blanked."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            continue
        lines.append(re.sub(r"`[^`]*`", "``", line))
    return lines


def slug(heading: str) -> str:
    """The anchor id a heading gets, as Python-Markdown's toc extension (MkDocs) makes it: inline
    markup dropped, then its `slugify`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    """The anchor ids of a Markdown page's headings (a repeated one gets _1, _2, ... as in toc)."""
    seen: dict[str, int] = {}
    out = set()
    text = page.read_text()
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or match is None:
            continue
        base = slug(match[1])
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}_{count}")
    return out


def broken_links(page: Path) -> list[str]:
    """What is wrong with a page's relative links, one line each (empty: nothing)."""
    problems = []
    for line in prose(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                continue
            path, _, anchor = target.partition("#")
            if path.startswith("/"):
                problems.append(f"{target}: an absolute path")
                continue
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                problems.append(f"{target}: no such file")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                problems.append(f"{target}: {resolved.name} has no heading with anchor #{anchor}")
    return problems


def test_every_relative_link_of_the_readme_resolves() -> None:
    assert LINK.search(README.read_text()) is not None
    assert broken_links(README) == []


def test_a_missing_page_a_missing_anchor_and_an_absolute_path_are_caught(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    heading = "## Router (`kvdepot route`)\n\n"
    (tmp_path / "docs" / "page.md").write_text("# Page\n\n" + heading + heading)
    readme = tmp_path / "README.md"
    readme.write_text(
        "## Two commands\n\n"
        "[ok](docs/page.md#router-kvdepot-route) [ok](docs/page.md#router-kvdepot-route_1)\n"
        "[ok](#two-commands)\n"
        "[ok](docs) [web](https://example.org/x.md) `[code](nowhere.md)`\n\n"
        "    [indented code](nowhere.md)\n\n"
        "[gone](docs/gone.md) [anchor](docs/page.md#routre) [self](#three-commands) [abs](/etc/passwd)\n"
    )
    assert broken_links(readme) == [
        "docs/gone.md: no such file",
        "docs/page.md#routre: page.md has no heading with anchor #routre",
        "#three-commands: README.md has no heading with anchor #three-commands",
        "/etc/passwd: an absolute path",
    ]
