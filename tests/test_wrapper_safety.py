"""The wrapper's writes into an agent's config home never follow a planted symlink out of it.

Real files and symlinks in a temp dir: a link planted at a write's temp name or at its final name, a symlinked
directory leading to a sibling whose name starts with the home's (``home-evil`` beside ``home``), a planted
marker link and a FIFO. Each time the file outside the home is untouched.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from adapters import ADAPTERS, Target
from adapters.base import HARNESS_MARKER, install_harness, installed_release, safe_join
from daemon.errors import BadRequest

PI = ADAPTERS["pi"]
TREE = {"AGENTS.md": b"- run the tests\n", "skills/tdd/SKILL.md": b"red, green, refactor\n"}


@pytest.fixture
def home(tmp_path: Path) -> Path:
    h = tmp_path / "home"
    (h / ".pi" / "agent").mkdir(parents=True)
    return h


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    f = tmp_path / "outside.txt"
    f.write_bytes(b"precious\n")
    return f


def test_a_symlink_planted_at_the_temp_name_is_not_followed(home: Path, outside: Path) -> None:
    # the temp name the installer used to write through before renaming
    (home / ".pi" / "agent" / ".AGENTS.md.tmp").symlink_to(outside)
    install_harness(home, "r1", PI.render(TREE))
    assert outside.read_bytes() == b"precious\n"
    dest = home / ".pi" / "agent" / "AGENTS.md"
    assert not dest.is_symlink() and dest.read_bytes() == TREE["AGENTS.md"]


def test_a_symlink_at_the_final_name_is_replaced_not_followed(home: Path, outside: Path) -> None:
    dest = home / ".pi" / "agent" / "AGENTS.md"
    dest.symlink_to(outside)
    result = install_harness(home, "r1", PI.render(TREE))
    assert outside.read_bytes() == b"precious\n"
    assert not dest.is_symlink() and dest.read_bytes() == TREE["AGENTS.md"]
    assert ".pi/agent/AGENTS.md" in result["written"]


def test_a_symlink_at_the_final_name_is_replaced_even_when_its_target_holds_the_same_bytes(home: Path,
                                                                                           outside: Path) -> None:
    outside.write_bytes(TREE["AGENTS.md"])
    dest = home / ".pi" / "agent" / "AGENTS.md"
    dest.symlink_to(outside)
    install_harness(home, "r1", PI.render(TREE))
    assert not dest.is_symlink(), "the agent would read the harness through a link out of its home"


def test_a_planted_marker_link_is_not_followed(home: Path, outside: Path) -> None:
    (home / HARNESS_MARKER).symlink_to(outside)
    install_harness(home, "r1", PI.render(TREE))
    assert outside.read_bytes() == b"precious\n"
    assert installed_release(home) == "r1"


@pytest.mark.parametrize("marker", [b'{"release_id": 5}', b'["r1"]', b'"r1"', b"{", b'{"files": []}'])
def test_a_marker_without_a_release_id_names_no_release(home: Path, marker: bytes) -> None:
    # what the wrapper compares with the daemon's head: only a text id counts (a number, a list, a torn file: none,
    # so the daemon's files are installed again rather than compared with something that is not an id)
    (home / HARNESS_MARKER).write_bytes(marker)
    assert installed_release(home) is None
    (home / HARNESS_MARKER).write_bytes(b'{"release_id": "r1", "files": []}')
    assert installed_release(home) == "r1"


def test_a_sibling_whose_name_starts_with_the_homes_is_outside(tmp_path: Path, home: Path) -> None:
    evil = tmp_path / "home-evil"
    (evil / "agent").mkdir(parents=True)
    os.rename(home / ".pi", tmp_path / "pi-moved")
    (home / ".pi").symlink_to(evil)  # home/.pi/agent resolves to home-evil/agent: a string prefix of home
    with pytest.raises(BadRequest, match="outside"):
        safe_join(home, ".pi/agent/skills/tdd/SKILL.md")
    with pytest.raises(BadRequest):
        install_harness(home, "r1", PI.render(TREE))
    assert [p.relative_to(evil).as_posix() for p in evil.rglob("*")] == ["agent"]
    assert installed_release(home) is None, "nothing is written when one path is refused"


def test_a_symlinked_directory_inside_the_home_is_refused_too(home: Path) -> None:
    (home / "real").mkdir()
    (home / ".pi" / "agent" / "skills").symlink_to(home / "real")
    with pytest.raises(BadRequest, match="symlink"):
        install_harness(home, "r1", PI.render(TREE))
    assert list((home / "real").iterdir()) == []


def test_removing_a_stale_file_unlinks_a_symlink_not_its_target(home: Path, outside: Path) -> None:
    install_harness(home, "r1", PI.render(TREE))
    skill = home / ".pi" / "agent" / "skills" / "tdd" / "SKILL.md"
    skill.unlink()
    skill.symlink_to(outside)
    result = install_harness(home, "r2", PI.render({"AGENTS.md": TREE["AGENTS.md"]}))
    assert result["removed"] == [".pi/agent/skills/tdd/SKILL.md"]
    assert not skill.is_symlink() and outside.read_bytes() == b"precious\n"


def test_a_fifo_at_the_final_name_does_not_hang_the_install(home: Path) -> None:
    dest = home / ".pi" / "agent" / "AGENTS.md"
    os.mkfifo(dest)
    done = threading.Event()
    errors: list[BaseException] = []

    def go() -> None:
        try:
            install_harness(home, "r1", PI.render(TREE))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        done.set()

    threading.Thread(target=go, daemon=True).start()
    assert done.wait(30), "reading a FIFO at the harness path blocked the install"  # hang guard only
    assert not errors and dest.read_bytes() == TREE["AGENTS.md"]


def test_the_agents_provider_config_is_written_without_following_a_planted_temp_link(home: Path,
                                                                                      outside: Path) -> None:
    agent = home / ".pi" / "agent"
    (agent / ".models.json.tmp").symlink_to(outside)
    (agent / ".settings.json.tmp").symlink_to(outside)
    target = Target(url="http://127.0.0.1:1", scenario="pi", run="run_1", model="tiny")
    PI.prepare(home, target)
    assert outside.read_bytes() == b"precious\n"
    models = json.loads((agent / "models.json").read_text())
    assert models["providers"]["reef"]["baseUrl"] == "http://127.0.0.1:1/s/pi/r/run_1/v1"
    assert not (agent / "models.json").is_symlink()
