"""``reef agents doctor`` (issue 44: it printed nothing for 8 minutes, left four ``doctor-*`` scenarios behind, and
the agents it gave up on kept running, their requests with them). Now: a line as each check starts and ends, a bound
per check (``--timeout``) after which the wrapper's whole process group is ended, and nothing left: each check's run
is forgotten (records, run file), one scenario ``doctor`` is reused, and the pointer to each agent's last run is put
back, so ``reef-pi report`` still scores the user's own run.

The real ``reef agents doctor`` against a real daemon; the agents are small scripts where the adapters look for the
installed ones (a package.json with the pinned version beside them): pi makes one real request, as pi would;
Claude Code hangs with a child of its own, as an agent stuck on a slow model does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from adapters import ADAPTERS
from tests.conftest import Daemon
from tests.test_wrapper_typos import ASKS


def install_fake(agents: Path, name: str, body: str) -> None:
    adapter = ADAPTERS[name]
    binary = adapter.binary_path(agents)
    binary.parent.mkdir(parents=True, exist_ok=True)
    binary.write_text("#!/bin/sh\n" + body + "\n")
    binary.chmod(0o755)
    manifest = adapter.prefix(agents) / "node_modules" / adapter.package / "package.json"
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"name": adapter.package, "version": adapter.version}))


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def test_doctor_says_each_check_bounds_it_and_leaves_nothing(daemon: Daemon, tmp_path: Path) -> None:
    """Bugs caught: the verdicts printed only at the end, a check that kills the wrapper but leaves the agent (and its
    child) running, the check's run and records left in the scenario, the user's last run replaced by the check's."""
    agents = tmp_path / "agents"
    asks = tmp_path / "asks.py"
    asks.write_text(ASKS.replace("/s/exits/", "/s/doctor/").format(url=daemon.url, token=daemon.token))
    install_fake(agents, "pi", f'exec "{sys.executable}" "{asks}"')
    child = tmp_path / "child.pid"
    install_fake(agents, "claude", f'sleep 300 &\necho $! > "{child}"\nwait')
    runs = daemon.home / "runs"
    runs.mkdir(exist_ok=True)
    (runs / "last-pi").write_text("run_users_own\n")  # the user's own last pi run
    env = {**daemon.env, "REEF_AGENTS_DIR": str(agents)}
    proc = subprocess.Popen([sys.executable, "-m", "reef_cli.main", "agents", "doctor", "pi", "claude",
                             "--timeout", "20"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # each line as it comes: the pi verdict is out before the claude check ends
        lines.append(line.rstrip("\n"))
        if line.startswith("[2/2] checking claude"):
            assert any(x.startswith("ok    pi") for x in lines), lines
    proc.stdout.close()
    assert proc.wait(timeout=120) == 1
    text = "\n".join(lines)
    assert [x.split(":")[0] for x in lines if x.startswith("[")] == ["[1/2] checking pi", "[2/2] checking claude"]
    assert "FAIL  claude: no answer in 20 s (stopped, with what it started)" in text, text
    assert not alive(int(child.read_text())), "the hung agent's child outlived the check"
    with daemon.http() as c:
        records = [r for r in c.get("/reef/scenarios/doctor/records").json()["records"] if not r.get("forgotten_at")]
        names = [s["name"] for s in c.get("/reef/scenarios").json()["scenarios"]]
    assert records == [] and not [n for n in names if n.startswith("doctor-")], (records, names)
    assert not [p for p in runs.glob("run_*.json") if json.loads(p.read_text())["scenario"] == "doctor"]
    assert (runs / "last-pi").read_text() == "run_users_own\n" and not (runs / "last-claude").exists()
