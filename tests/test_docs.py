"""The documentation holds together: every relative link in ``README.md`` and ``docs/*.md`` reaches a file that
exists and, for ``#anchor`` links, a heading that exists; the README stays a short front door whose map names
every package; ``.ci/run`` runs exactly the README's test command."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^ *(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str, *, keep_code: bool = False) -> list[str]:
    """The lines outside fenced code blocks, with inline code spans blanked (links there are not links) unless
    ``keep_code`` (a heading's code spans are part of its anchor)."""
    out, fence = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fence = not fence
            continue
        if not fence:
            out.append(line if keep_code else _INLINE_CODE.sub("``", line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (but ``-`` and ``_``), spaces to ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors by its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a page; a repeated heading gets ``-1``, ``-2``... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(page.read_text(), keep_code=True):
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(page: Path) -> list[str]:
    return [m.group(1) for line in prose_lines(page.read_text()) for m in _LINK.finditer(line)]


def test_the_pages_exist() -> None:
    names = {p.name for p in PAGES}
    assert "README.md" in names and "design.md" in names and "commands.md" in names, names
    assert len(PAGES) > 10, names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_a_heading(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...: not checked here
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / unquote(path_part)).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
            continue
        if ROOT not in dest.parents and dest != ROOT:
            broken.append(f"{target}: outside the repository")
            continue
        if anchor:
            if dest.suffix != ".md":
                broken.append(f"{target}: an anchor on a file that is not markdown")
            elif unquote(anchor) not in anchors(dest):
                broken.append(f"{target}: no heading with that anchor in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_the_link_check_sees_links_and_anchors() -> None:
    """The checker itself: links in code are not links, and anchors follow GitHub's rules."""
    assert slug("Coding agents: `reef-pi`, `reef-claude`") == "coding-agents-reef-pi-reef-claude"
    assert slug("`harness-search`: harness evolution that searches") == "harness-search-harness-evolution-that-searches"
    assert slug("A real model: SmolLM2-135M-Instruct") == "a-real-model-smollm2-135m-instruct"
    sample = prose_lines("see [a](a.md#x) and `[b](b.md)`\n```\n[c](c.md)\n```\n[d `e`](d.md \"title\")")
    found = [m.group(1) for line in sample for m in _LINK.finditer(line)]
    assert found == ["a.md#x", "d.md"], found


def test_no_page_points_outside_the_repository() -> None:
    """The design document came into the repository: no page sends a reader to a path beside it."""
    for page in PAGES:
        text = page.read_text()
        assert "../shared" not in text and "/work/" not in text, page


def test_the_readme_is_a_front_door() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme) < 12_000, f"README.md is {len(readme)} characters: move detail to a docs/ page"
    for page in sorted((ROOT / "docs").glob("*.md")):  # every page is reachable from the README
        assert f"(docs/{page.name})" in readme or f"(docs/{page.name}#" in readme, page.name


def test_the_readme_map_names_every_package() -> None:
    """A package added without a line in the map fails here, so the map keeps finding recipes, engines, adapters."""
    readme = (ROOT / "README.md").read_text()
    map_part = readme.split("## Map of the repository", 1)[1]
    packages = sorted(  # the Python packages Reef ships (build/ and virtual environments are not the source)
        str(d.relative_to(ROOT)) + "/"
        for top in ("reef_cli", "daemon", "recipes", "adapters")
        for d in [ROOT / top, *(ROOT / top).glob("**/")]
        if (d / "__init__.py").exists()
    )
    for top in ("completions/", "tests/", "bench/", "docs/", "install.sh"):
        packages.append(top)
    missing = [p for p in packages if f"[`{p}`]({p})" not in map_part]
    assert not missing, f"not in README.md's map (one line each, as [`dir/`](dir/)): {missing}"
    for what in ("add a recipe", "add an engine", "add an agent adapter"):
        assert what in map_part, what


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)\n```", readme.split("## Quick start", 1)[1], re.S)
    assert len(blocks) >= 2, blocks
    serve, test = blocks[0].strip(), blocks[1].strip()
    assert serve == "./install.sh && ~/.local/bin/reef serve"
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1].strip() == test, (ci[-1], test)
