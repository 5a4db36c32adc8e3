"""``reef doctor``: each check against the real thing (a running daemon, a daemon that is not there, a token
file with the wrong mode, a wrong token over TCP, a missing adapters package), each problem with its fix, and
the exit code (1 when a check failed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, Daemon, make_home


def doctor(env: dict[str, str], *args: str, cwd: Path | None = None) -> tuple[subprocess.CompletedProcess[str],
                                                                           dict[str, Any]]:
    out = subprocess.run([sys.executable, "-m", "reef_cli.main", "doctor", *args], env=env, capture_output=True,
                         text=True, timeout=120, cwd=cwd)
    data = json.loads(out.stdout) if "--json" in args else {}
    return out, data


def by_name(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in data["checks"]}


def test_a_running_daemon_and_its_files_pass(daemon: Daemon) -> None:
    out, data = doctor(daemon.env, "--json")
    checks = by_name(data)
    assert checks["daemon"]["status"] == "ok" and str(daemon.home) in checks["daemon"]["detail"]
    assert checks["token file"]["status"] == "ok" and "0600" in checks["token file"]["detail"]
    assert checks["socket"]["status"] == "ok"
    assert {"python", "config", "state dir", "disk space", "git", "node", "npm", "model"} <= set(checks)
    assert any(name.startswith("agent ") for name in checks)  # one line per coding agent
    failed = [c for c in data["checks"] if c["status"] == "fail"]
    assert data["ok"] == (not failed) and out.returncode == (1 if failed else 0), out.stdout
    assert all(c["fix"] for c in data["checks"] if c["status"] != "ok")  # every problem says how to fix it


def test_a_token_others_can_read_fails_with_its_fix(daemon: Daemon) -> None:
    token = daemon.home / "token"
    token.chmod(0o644)
    try:
        out, data = doctor(daemon.env, "--json")
        check = by_name(data)["token file"]
        assert check["status"] == "fail" and "0644" in check["detail"]
        assert check["fix"] == f"chmod 600 {token}"
        assert out.returncode == 1 and data["ok"] is False
        human, _ = doctor(daemon.env)
        assert f"fix: chmod 600 {token}" in human.stdout and human.returncode == 1
    finally:
        token.chmod(0o600)


def test_no_daemon_is_a_warning_and_doctor_starts_nothing(tiny_model: Path) -> None:
    home, _, env = make_home(tiny_model)
    try:
        out, data = doctor(env, "--json")
        check = by_name(data)["daemon"]
        assert check["status"] == "warn" and check["fix"] == "reef daemon start"
        assert not (home / "reef.sock").exists() and not (home / "reef.pid").exists()
        assert "Traceback" not in out.stderr
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_a_check_that_passed_shows_no_fix_even_when_the_config_does_not_load(tiny_model: Path) -> None:
    """A config that does not parse ends the checks early; what passed before it (python) still shows no fix
    line, in the table or in JSON, and the config's failure shows its own."""
    home, _, env = make_home(tiny_model)
    try:
        (home / "config.toml").write_text("port = [\n")
        out, data = doctor(env, "--json")
        checks = by_name(data)
        assert checks["python"]["status"] == "ok" and checks["python"]["fix"] is None
        assert checks["config"]["status"] == "fail" and checks["config"]["fix"]
        human, _ = doctor(env)
        lines = human.stdout.splitlines()
        for i, line in enumerate(lines):
            if line.strip().startswith("fix:"):
                assert lines[i - 1].startswith(("warn", "FAIL")), human.stdout  # under a problem only
        assert any(line.strip().startswith("fix:") for line in lines) and human.returncode == 1
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_a_wrong_token_over_tcp_fails(daemon: Daemon) -> None:
    env = {**daemon.env, "REEF_URL": daemon.url, "REEF_TOKEN": "not-the-token"}
    out, data = doctor(env, "--json")
    check = by_name(data)["daemon"]
    assert check["status"] == "fail" and "REEF_TOKEN" in check["fix"] and out.returncode == 1
    assert "not-the-token" not in out.stdout + out.stderr  # a token is never printed


def test_without_the_adapters_package_the_agents_check_degrades(daemon: Daemon, tmp_path: Path) -> None:
    shadow = tmp_path / "shadow" / "adapters"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('adapters is not installed here')\n")
    env = {**daemon.env, "PYTHONPATH": f"{shadow.parent}{os.pathsep}{ROOT}"}
    out, data = doctor(env, "--json", cwd=tmp_path)  # not the checkout: the shadow comes first on the path
    check = by_name(data)["agents"]
    assert check["status"] == "warn" and check["fix"], check
    assert "Traceback" not in out.stderr


def test_disk_space_thresholds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # a full disk cannot be made on demand here without root tricks: stand in for shutil.disk_usage only
    from reef_cli import doctor as doc

    usage = namedtuple("usage", "total used free")
    for free, status in ((200 << 20, "fail"), (3 << 30, "warn"), (50 << 30, "ok")):
        monkeypatch.setattr(doc.shutil, "disk_usage", lambda _p, f=free: usage(100 << 30, 0, f))
        check = doc.check_disk(tmp_path / "not-yet")
        assert check.status == status, (free, check)
        assert (check.fix is None) == (status == "ok")


def fake_installed(agents_dir: Path, adapter: Any) -> None:
    """What ``installed_version`` reads of an npm install (its package.json and its bin), without npm: this test is
    about doctor's report of sizes, not about the agent."""
    pkg = adapter.prefix(agents_dir) / "node_modules" / adapter.package
    pkg.mkdir(parents=True)
    (pkg / "package.json").write_text(json.dumps({"version": adapter.version}))
    adapter.binary_path(agents_dir).parent.mkdir(parents=True, exist_ok=True)
    adapter.binary_path(agents_dir).write_text("#!/bin/sh\n")


def test_doctor_holds_each_agents_first_request_against_each_models_context(tiny_model: Path, tmp_path: Path
                                                                            ) -> None:
    """The default is a model of 8,192 tokens: pi's first request fits, Claude Code's does not (a warning naming
    both sizes and the model that holds it: one of the same context whose template, SmolLM2's, drops the tool
    schemas); a test model as the default is a warning too."""
    from adapters import get_adapter
    from tests.test_harness import short_context_model, toolless_model

    home, _, env = make_home(tiny_model)
    short = short_context_model(tiny_model, tmp_path, 8192)
    smol = toolless_model(tiny_model, tmp_path, 8192)
    agents = tmp_path / "agents"
    for name in ("pi", "claude"):
        fake_installed(agents, get_adapter(name))
    cfg = home / "config.toml"
    cfg.write_text(f'agents_dir = "{agents}"\n' + cfg.read_text().replace('default_model = "tiny"', 'default_model = '
                                                                          '"short"')
                   + f'\n[models.short]\nengine = "transformers"\npath = "{short}"\n'
                   + f'\n[models.smol]\nengine = "transformers"\npath = "{smol}"\n')
    try:
        _, data = doctor(env, "--json")
        checks = by_name(data)
        assert checks["fit pi"]["status"] == "ok" and "1,546" in checks["fit pi"]["detail"]
        claude = checks["fit claude"]
        assert claude["status"] == "warn" and "short 8,192 for about 21,300 too small" in claude["detail"]
        assert "smol 8,192 for about 3,550 (no tool schemas) ok" in claude["detail"]  # as SmolLM2's template reads it
        assert claude["fix"] == "reef scenarios set-model claude smol"  # smol's template drops the tool schemas
        assert "fit opencode" not in checks  # not installed: nothing to say
        assert checks["model"]["status"] == "ok"
        cfg.write_text(cfg.read_text().replace('default_model = "short"', 'default_model = "tiny"'))
        _, data = doctor(env, "--json")
        checks = by_name(data)
        assert checks["model"]["status"] == "warn" and "test model" in checks["model"]["detail"]
        assert checks["fit claude"]["status"] == "ok"
    finally:
        shutil.rmtree(home, ignore_errors=True)
