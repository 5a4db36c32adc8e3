"""The product's shape, held by tests: no module over 800 lines (but a shrinking few), every module named in the
module map of docs/design.md, adapters never importing recipes, and every product module in the import scan whose
circles tests/test_imports.py refuses (imports inside functions included)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.test_imports import ROOT, import_graph, project_modules

PRODUCT = ("daemon", "reef_cli", "adapters", "recipes", "completions")
MAX_LINES = 800
# The modules over MAX_LINES when the rule came in, each with its size then as its ceiling. A module here may shrink,
# never grow; one at or under MAX_LINES leaves the list, and no module joins it (a growing part gets a package).
OVER: dict[str, int] = {}  # daemon/records/store.py (1,189) and daemon/learning.py (850) have left it


def product_files(root: Path = ROOT) -> list[str]:
    """Every Python file of the product, relative to the repository (posix)."""
    return sorted(p.relative_to(root).as_posix() for package in PRODUCT for p in (root / package).rglob("*.py"))


def size_findings(sizes: dict[str, int], over: dict[str, int]) -> list[str]:
    """What breaks the size rule, given each module's line count and the allow-list of ``over``."""
    found = []
    for path, n in sorted(sizes.items()):
        if path in over and n > over[path]:
            found.append(f"{path} grew to {n} lines, over its ceiling of {over[path]}: shrink it, or give it a package")
        elif path not in over and n > MAX_LINES:
            found.append(f"{path} is {n} lines, over {MAX_LINES}: give the growing part a module or a package")
    for path, ceiling in sorted(over.items()):
        if sizes.get(path, 0) <= MAX_LINES:
            found.append(f"{path} is at or under {MAX_LINES} lines now (or gone): take it off the list in "
                         f"tests/test_structure.py")
        elif sizes[path] < ceiling:
            found.append(f"{path} shrank to {sizes[path]} lines: lower its ceiling of {ceiling} to that")
    return found


def test_no_module_over_800_lines_but_the_shrinking_few() -> None:
    sizes = {path: len((ROOT / path).read_text().splitlines()) for path in product_files()}
    assert len(sizes) > 100
    assert not size_findings(sizes, OVER), "\n".join(size_findings(sizes, OVER))


def test_the_size_rule_refuses_a_new_offender_and_a_grown_one_and_keeps_the_list_short() -> None:
    over = {"a.py": 900, "b.py": 850}
    assert size_findings({"a.py": 900, "b.py": 850, "c.py": 800}, over) == []
    assert size_findings({"a.py": 900, "b.py": 850, "c.py": 801}, over) == [
        "c.py is 801 lines, over 800: give the growing part a module or a package"]
    assert size_findings({"a.py": 901, "b.py": 850}, over)[0].startswith("a.py grew to 901 lines")
    assert size_findings({"a.py": 900, "b.py": 800}, over)[0].startswith("b.py is at or under 800 lines")
    assert size_findings({"a.py": 899, "b.py": 850}, over)[0].startswith("a.py shrank to 899 lines")


def named_in_map(design: str) -> set[str]:
    """The modules the module map of ``design`` (docs/design.md) names, as paths: under each top-level folder line
    (``daemon/   web.py ...``), every ``name.py`` and ``sub/name.py``, and ``sub/{a,b}.py`` for each name."""
    block = design.split("## The module map", 1)[1].split("```", 2)[1]
    named: set[str] = set()
    top = None
    for line in block.splitlines():
        m = re.match(r"(\w+)/\s", line)
        if m:
            top = m.group(1)
        line = re.sub(r"([\w/]*)\{([\w,]+)\}\.py",
                      lambda m: " ".join(f"{m.group(1)}{name}.py" for name in m.group(2).split(",")), line)
        named.update(f"{top}/{name}" for name in re.findall(r"(?<![\w/.])([\w/]+\.py)\b", line))
    return named


def test_the_module_map_names_every_module() -> None:
    named = named_in_map((ROOT / "docs" / "design.md").read_text())
    modules = {p for p in product_files() if not p.endswith("/__init__.py")}
    assert not sorted(modules - named), f"modules docs/design.md's module map does not name: {sorted(modules - named)}"
    assert not sorted(named - modules), f"the module map names modules that do not exist: {sorted(named - modules)}"


def test_the_map_reader() -> None:
    design = ("## The module map\n\n```\ndaemon/   web.py (HTTP/1.1 server)  app.py\n          releases/{repo,store}.py "
              "(git chains)\nrecipes/  base.py  harness_search/{pool}.py\n```\ndaemon/ outside.py (not in the map)\n")
    assert named_in_map(design) == {"daemon/web.py", "daemon/app.py", "daemon/releases/repo.py",
                                    "daemon/releases/store.py", "recipes/base.py", "recipes/harness_search/pool.py"}


def test_adapters_never_import_recipes() -> None:
    graph = import_graph()
    up = sorted(f"{m} -> {t} (line {line})" for m, edges in graph.items() if m.split(".")[0] == "adapters"
                for t, line in edges.items() if t.split(".")[0] == "recipes")
    assert not up, f"adapters import recipes (move the shared piece down, into daemon/): {up}"


def test_every_product_module_is_in_the_import_scan() -> None:
    scanned = {p.relative_to(ROOT).as_posix() for p in project_modules().values()}
    assert set(product_files()) <= scanned, sorted(set(product_files()) - scanned)
