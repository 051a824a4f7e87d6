"""The docs as tests read them: mkdocs.yml's sections, a page's code blocks (and which are marked syntax only),
its headings' anchors, and the repository paths it names."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import markdown
import yaml

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
README = REPO / "README.md"
SYNTAX_ONLY = re.compile(r"^<!-- test: syntax only: (.+) -->$")
"""The mark above a code block that is only checked for syntax, with why (it needs PyTorch, a GPU, Docker)."""
FENCE = re.compile(r"^(\s*)```(\w*)")
REPO_PATH = re.compile(r"`((?:bench|clients|dashboards|deploy|dockerfiles|rpycdl|scripts|servers|tests)/[\w./-]*)`")
"""A path of the repository named in a code span: `clients/first_job.py`, `deploy/kubernetes/`."""


@dataclass(frozen=True)
class Block:
    """A fenced code block of a page: its language, its code, the line its fence opens on, and why it is
    only checked for syntax (None: it runs)."""

    page: Path
    language: str
    code: str
    line: int
    syntax_only: str | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def section(title: str) -> list[Path]:
    """The pages of one section of the site's nav (mkdocs.yml), in order."""
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    entries = next(entry[title] for entry in nav if title in entry)
    return [DOCS / next(iter(entry.values())) for entry in entries]


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a page. A fence must start its line: an indented one (in a list) is refused,
    so that no example escapes the tests."""
    lines = page.read_text().splitlines()
    found, number = [], 0
    while number < len(lines):
        fence = FENCE.match(lines[number])
        if not fence:
            number += 1
            continue
        if fence.group(1):
            raise AssertionError(f"{page.relative_to(REPO)}:{number + 1}: a fenced block inside a list: "
                                 "give it a line of its own, so that the docs' tests find it")
        end = lines.index("```", number + 1)
        before = next((line for line in reversed(lines[:number]) if line.strip()), "")
        mark = SYNTAX_ONLY.match(before)
        found.append(Block(page, fence.group(2), "\n".join(lines[number + 1:end]) + "\n", number + 1,
                           mark.group(1) if mark else None))
        number = end + 1
    return found


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, as the site makes them (Python-Markdown's toc extension)."""
    html = markdown.Markdown(extensions=["toc", "tables", "fenced_code"]).convert(page.read_text())
    return set(re.findall(r'<h\d id="([^"]+)"', html))


def links(page: Path) -> list[str]:
    """The relative links of a page, outside code."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [target for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", text))
            if not re.match(r"[a-z]+:", target)]


def repo_paths(page: Path) -> list[str]:
    """The repository paths a page names in code spans."""
    return REPO_PATH.findall(page.read_text())
