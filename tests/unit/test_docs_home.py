"""The site's home page (docs/index.md) repeats the README's two commands; they must not drift."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def commands(page: Path) -> list[str]:
    """The indented command lines of a page's "Two commands" section."""
    section = page.read_text().split("\n## Two commands\n", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for line in section.splitlines() if line.startswith("    ")]


def test_the_site_home_gives_the_readme_two_commands() -> None:
    readme = commands(ROOT / "README.md")
    assert readme == [
        "python3 -m venv .venv && .venv/bin/pip install -e ./connector -e . && .venv/bin/kvdepot serve",
        "./tests/run.sh",
    ]
    assert commands(ROOT / "docs" / "index.md") == readme
