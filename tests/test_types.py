"""The type checker runs in the test command: mypy, strict, on the modules ``[tool.mypy]`` in ``pyproject.toml``
lists (``daemon/releases/``, ``daemon/gate.py``, ``daemon/canary.py`` and more). mypy comes with the dev extra
(``./install.sh --dev``), pinned, so that a new mypy release cannot turn the suite red by itself."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]


def mypy(*args: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, "-m", "mypy", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert "No module named mypy" not in out.stderr, "mypy is not installed: ./install.sh --dev (the dev extra)"
    return out


def test_the_strict_modules_type_check() -> None:
    assert CONFIG["strict"] is True
    for required in ("daemon/releases", "daemon/gate.py", "daemon/canary.py", "daemon/records/scored.py"):
        assert required in CONFIG["files"]
    out = mypy()
    assert out.returncode == 0, f"mypy (strict, pyproject.toml [tool.mypy]) found type errors:\n{out.stdout}{out.stderr}"


def test_the_configuration_refuses_what_strict_refuses(tmp_path: Path) -> None:
    # the same configuration on a module with an unannotated function and a wrong type: both are errors
    bad = tmp_path / "bad.py"
    bad.write_text("def untyped(x):\n    return x\n\n\ndef wrong() -> int:\n    return 'one'\n")
    out = mypy("--config-file", str(ROOT / "pyproject.toml"), str(bad))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "[no-untyped-def]" in out.stdout and "[return-value]" in out.stdout, out.stdout
