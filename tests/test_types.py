"""The type checker runs in the test command: mypy, strict, on what ``[tool.mypy]`` in ``pyproject.toml`` lists:
the product packages whole (``daemon``, ``reef_cli``, ``adapters``, ``recipes``), so that every product module is
held to it, a new one included. mypy comes with the dev extra (``./install.sh --dev``), pinned, so that a new mypy
release cannot turn the suite red by itself."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from tests.test_structure import PRODUCT, ROOT

CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]


def mypy(*args: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, "-m", "mypy", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert "No module named mypy" not in out.stderr, "mypy is not installed: ./install.sh --dev (the dev extra)"
    return out


def uncovered(files: list[str], root: Path = ROOT) -> list[str]:
    """The product's .py files that no entry of ``files`` (a file, or a directory holding it) names."""
    listed = [root / f for f in files]
    return [str(p.relative_to(root)) for package in PRODUCT for p in sorted((root / package).rglob("*.py"))
            if not any(p == entry or entry in p.parents for entry in listed)]


def test_every_product_module_is_held_to_strict() -> None:
    assert CONFIG["strict"] is True
    assert uncovered(CONFIG["files"]) == [], "add the package to [tool.mypy] files in pyproject.toml"
    assert len(list((ROOT / "daemon").rglob("*.py"))) > 100  # the walk found the product


def test_a_module_left_out_is_named(tmp_path: Path) -> None:
    # a package the list does not name, and a module beside a listed one: both reported, the listed ones not
    for rel in ("daemon/listed.py", "daemon/inner/listed.py", "daemon/other.py", "recipes/new/module.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert uncovered(["daemon/listed.py", "daemon/inner"], tmp_path) == ["daemon/other.py", "recipes/new/module.py"]
    assert uncovered(["daemon", "recipes"], tmp_path) == []


def test_the_strict_modules_type_check() -> None:
    out = mypy()
    assert out.returncode == 0, f"mypy (strict, pyproject.toml [tool.mypy]) found type errors:\n{out.stdout}{out.stderr}"


def test_the_configuration_refuses_what_strict_refuses(tmp_path: Path) -> None:
    # the same configuration on a module with an unannotated function and a wrong type: both are errors
    bad = tmp_path / "bad.py"
    bad.write_text("def untyped(x):\n    return x\n\n\ndef wrong() -> int:\n    return 'one'\n")
    out = mypy("--config-file", str(ROOT / "pyproject.toml"), str(bad))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "[no-untyped-def]" in out.stdout and "[return-value]" in out.stdout, out.stdout
