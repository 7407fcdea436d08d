"""MkDocs hooks (mkdocs.yml `hooks:`): build-time fixes that keep the pages' Markdown right on
GitHub as well as on the site.

    on_page_markdown   a `\\|` inside a code span of a table row becomes `|`
"""

from __future__ import annotations

import re
from typing import Any

CODE_SPAN = re.compile(r"`[^`\n]*`")


def on_page_markdown(markdown: str, **_: Any) -> str:
    """GitHub splits a table row on every pipe that is not escaped, code spans included, so the
    pages write `\\|` there; Python-Markdown's tables leave pipes inside code spans alone and would
    show the backslash."""
    lines = markdown.split("\n")
    for i, line in enumerate(lines):
        if line.startswith("|") and "\\|" in line:
            lines[i] = CODE_SPAN.sub(lambda m: m.group(0).replace("\\|", "|"), line)
    return "\n".join(lines)
