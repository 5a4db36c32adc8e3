"""What every adapter shares: installing a coding agent from npm into Reef's own prefix, an isolated config
home per scenario, and rendering a neutral harness tree into the agent's own layout.

A wrapped run looks like this (``reef_cli/wrapper.py``): the agent's config home is
``$REEF_HOME/homes/<adapter>/<scenario>``; the adapter writes its provider config there (pointing at the daemon's
``/s/<scenario>/r/<run>`` base URL, the token taken from ``$REEF_TOKEN`` at run time, never written to a file),
installs the scenario's harness release there, and returns the environment that makes the agent read that home
and stay off the network.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daemon.errors import AgentError, BadRequest
from daemon.layout import check_tree_path

HARNESS_MARKER = ".reef-harness.json"
PROPOSALS_HEADING = "## Changing these rules"  # in the config home: which release is installed, which files it wrote


@dataclass(frozen=True)
class Target:
    """Where a wrapped run sends its traffic."""

    url: str  # the daemon over TCP, e.g. http://127.0.0.1:8900
    scenario: str
    run: str
    model: str  # the scenario's model (the name the agent asks for)
    release_id: str | None = None  # the harness release installed for this run (pinned on every request)
    context_window: int = 32768

    @property
    def base(self) -> str:
        return f"{self.url.rstrip('/')}/s/{self.scenario}/r/{self.run}"


class Adapter:
    name: str  # pi | claude | opencode | codex
    package: str  # the npm package
    version: str  # the pinned version
    binary: str  # the executable's name under node_modules/.bin
    wire: str  # the API format the agent speaks to Reef
    # neutral harness path prefix -> path under the config home
    layout: Mapping[str, str]
    override_home: bool = True  # the agent reads other config under $HOME: give it the isolated home as HOME
    # the size of the agent's first request in SmolLM2 tokens (its system prompt and tool schemas), measured with the
    # pinned version; None: not measured. The wrapper and ``reef doctor`` hold it against a model's context.
    first_request_tokens: int | None = None
    # of which its tool schemas: what a model whose chat template drops tools (SmolLM2's) never sees
    first_request_tool_tokens: int = 0

    def first_request_seen(self, renders_tools: bool | None) -> int | None:
        """About how many tokens the agent's first request is to a model, as its chat template renders it: without
        the tool schemas where the template drops them (``renders_tools`` False), else all of it."""
        if self.first_request_tokens is None:
            return None
        return self.first_request_tokens - (self.first_request_tool_tokens if renders_tools is False else 0)

    @property
    def command(self) -> str:
        return f"reef-{self.name}"

    # --- installation --------------------------------------------------------------------------------------

    def prefix(self, agents_dir: Path) -> Path:
        return agents_dir / self.name

    def binary_path(self, agents_dir: Path) -> Path:
        return self.prefix(agents_dir) / "node_modules" / ".bin" / self.binary

    def installed_version(self, agents_dir: Path) -> str | None:
        """The installed version in ``agents_dir`` (``Config.agents_path``), or None."""
        manifest = self.prefix(agents_dir) / "node_modules" / self.package / "package.json"
        try:
            version = json.loads(manifest.read_text())["version"]
        except (OSError, ValueError, KeyError):
            return None
        return str(version) if self.binary_path(agents_dir).exists() else None

    def install(self, agents_dir: Path, *, progress: Callable[[str], None] | None = None,
                force: bool = False) -> dict[str, Any]:
        """Install the pinned version with npm into ``agents_dir/<name>`` (atomically: a failed or interrupted
        install leaves what was there). Returns what was done."""
        import shutil
        import subprocess
        import tempfile
        import time

        say = progress or (lambda _msg: None)
        current = self.installed_version(agents_dir)
        if current == self.version and not force:
            return {"agent": self.name, "version": current, "installed": False, "seconds": 0.0}
        npm = shutil.which("npm")
        if npm is None:
            raise AgentError("npm is not installed; install Node.js 20+ (with npm) to use the coding agents")
        agents_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".{self.name}-install-", dir=agents_dir))
        spec = f"{self.package}@{self.version}"
        say(f"installing {spec} from npm into {self.prefix(agents_dir)}")
        (tmp / "package.json").write_text(json.dumps({"name": f"reef-agent-{self.name}", "private": True}) + "\n")
        env = {**os.environ, "npm_config_update_notifier": "false", "npm_config_fund": "false",
               "npm_config_audit": "false"}
        proc = subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", "--loglevel=error", "--prefix", str(tmp), spec],
            capture_output=True, text=True, env=env,
        )
        if proc.returncode != 0 or not (tmp / "node_modules" / ".bin" / self.binary).exists():
            shutil.rmtree(tmp, ignore_errors=True)
            detail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise AgentError(f"npm install {spec} failed (exit {proc.returncode}): {' '.join(detail)}")
        dest = self.prefix(agents_dir)
        old = None
        if dest.exists():
            old = dest.with_name(f".{self.name}-old-{os.getpid()}")
            dest.rename(old)
        tmp.rename(dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        seconds = round(time.monotonic() - t0, 1)
        say(f"installed {spec} in {seconds} s")
        return {"agent": self.name, "version": self.version, "installed": True, "seconds": seconds}

    # --- a run ---------------------------------------------------------------------------------------------

    def home(self, homes_dir: Path, scenario: str) -> Path:
        return homes_dir / self.name / scenario

    def env(self, home: Path, target: Target, token: str) -> dict[str, str]:
        """Environment overrides for the agent: isolation, offline switches, the daemon."""
        out = {"REEF_TOKEN": token, "REEF_RUN": target.run, "REEF_SCENARIO": target.scenario,
               "REEF_RELEASE_ID": target.release_id or ""}
        if self.override_home:
            out["HOME"] = str(home)
        return out

    def unset_env(self) -> tuple[str, ...]:
        """Variables removed from the agent's environment (they would point it elsewhere)."""
        return ()

    def prepare(self, home: Path, target: Target) -> None:
        """Write the agent's provider config into its home (no secret is written)."""

    def argv(self, binary: Path, args: list[str], target: Target) -> list[str]:
        return [str(binary), *args]

    # --- harness -------------------------------------------------------------------------------------------

    def proposal_rule(self) -> str:
        """The one rule that tells the agent how to propose a change to its own harness (``daemon/proposals.py``),
        with this agent's wrapper command."""
        c = self.command
        return (f"To change your own rules or skills, propose it with a reason: `{c} propose --add-rule \"RULE\" "
                f"--reason \"WHY\"` (also `--replace-rule ID \"RULE\"`, `--retire-rule ID`, `--add-skill NAME "
                f"\"TEXT\"`, `--retire-skill NAME`; a rule's ID is the [id] before it, or its whole text). "
                "A gate decides; the change reaches your next run.")

    def render(self, tree: Mapping[str, bytes], *, proposals: bool = False) -> dict[str, bytes]:
        """A neutral harness tree as files under the config home, in the agent's layout; ``proposals``: the rules
        end with ``proposal_rule`` (a scenario that takes proposals, for a wrapped run; not in an episode)."""
        out: dict[str, bytes] = {}
        for path, data in sorted(tree.items()):
            check_tree_path(path)
            for src, dst in self.layout.items():
                if path == src or (src.endswith("/") and path.startswith(src)):
                    out[dst + path[len(src):]] = data
                    break
        if proposals:
            rules = self.layout["AGENTS.md"]
            text = out.get(rules, b"").decode("utf-8", "replace").rstrip("\n")
            section = f"{PROPOSALS_HEADING}\n\n- {self.proposal_rule()}\n"
            out[rules] = (f"{text}\n\n{section}" if text else section).encode()
        return out


def write_json(path: Path, value: object) -> None:
    """Write a config file the agent reads, atomically, and only when its content changes."""
    data = (json.dumps(value, indent=2) + "\n").encode()
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _read_regular(dir_fd, path.name) != data:
            _replace_at(dir_fd, path.name, data)
    finally:
        os.close(dir_fd)


def write_file(path: Path, data: bytes) -> None:
    """Write ``path`` atomically (fresh temp name, fsync, rename) without following a symlink at either name."""
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _replace_at(dir_fd, path.name, data)
    finally:
        os.close(dir_fd)


def _replace_at(dir_fd: int, name: str, data: bytes) -> None:
    """Write ``name`` in the directory ``dir_fd`` atomically, never following a symlink.

    The data goes to a fresh random temp name opened with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (a file or symlink
    planted at a temp name makes the open fail and another name is drawn; nothing planted can redirect the write),
    then is renamed over ``name``: a symlink at ``name`` is replaced itself, its target is never opened."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(16):
        tmp = f".{name}.{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(tmp, flags, 0o644, dir_fd=dir_fd)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"no free temp name for {name}")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.fsync(dir_fd)  # the new name is durable too
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def _read_regular(dir_fd: int, name: str) -> bytes | None:
    """The bytes of ``name`` in ``dir_fd`` if it is a regular file (not a symlink, FIFO or directory), else None."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read() if stat.S_ISREG(os.fstat(f.fileno()).st_mode) else None


def _open_dir(root: Path, parts: list[str], *, create: bool) -> int:
    """A descriptor of ``root/parts...``, each step opened with ``O_NOFOLLOW`` from the one before (made when
    ``create``), so no symlink or file below ``root`` can lead elsewhere, even one planted after the checks."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, part in enumerate(parts):
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
            try:
                step = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                where = "/".join(parts[:i + 1])
                raise BadRequest(f"refusing harness path {where!r}: it is a symlink or a file in {root}",
                                 param="path") from None
            os.close(fd)
            fd = step
        return fd
    except BaseException:
        os.close(fd)
        raise


def safe_join(root: Path, rel: str) -> Path:
    """``root/rel``, refusing anything that would land outside ``root`` (absolute paths, ``..``, a symlinked
    directory on the way). Paths are compared as paths, so a sibling ``root-evil`` is outside ``root``. A symlink
    at ``rel`` itself is no escape: writes replace the link, never follow it."""
    if not rel or rel.startswith("/") or "\\" in rel or "\x00" in rel or any(p in ("", ".", "..")
                                                                            for p in rel.split("/")):
        raise BadRequest(f"refusing harness path {rel!r}: it is not a plain relative path", param="path")
    dest = root / rel
    real_root = root.resolve()
    parent = dest.parent
    while not parent.exists() and not parent.is_symlink():
        parent = parent.parent
    if not parent.resolve().is_relative_to(real_root):
        raise BadRequest(f"refusing harness path {rel!r}: it leads outside {root}", param="path")
    return dest


def install_harness(home: Path, release_id: str | None, files: Mapping[str, bytes]) -> dict[str, Any]:
    """Write a rendered harness into an agent's config home, removing files the previous release wrote and this
    one does not have. Every path is checked before anything is written. Idempotent.

    No write follows a symlink: directories are walked with ``O_NOFOLLOW`` from ``home``, files are written to a
    fresh ``O_EXCL`` temp name and renamed into place (a symlink at a file's own name is replaced)."""
    home.mkdir(parents=True, exist_ok=True)
    for rel in files:
        safe_join(home, rel)
    try:
        before = json.loads(_read_marker(home) or b"{}")
    except ValueError:
        before = {}
    written = []
    for rel, data in files.items():
        *dirs, name = rel.split("/")
        dir_fd = _open_dir(home, dirs, create=True)
        try:
            if _read_regular(dir_fd, name) != data:
                _replace_at(dir_fd, name, data)
                written.append(rel)
        finally:
            os.close(dir_fd)
    removed = []
    for rel in before.get("files", []) if isinstance(before, dict) else []:
        if rel in files:
            continue
        try:
            safe_join(home, rel)
            *dirs, name = rel.split("/")
            dir_fd = _open_dir(home, dirs, create=False)
        except (OSError, BadRequest, TypeError, AttributeError):
            continue
        try:
            os.unlink(name, dir_fd=dir_fd)  # unlink removes a symlink itself, never its target
            removed.append(rel)
        except OSError:
            pass
        finally:
            os.close(dir_fd)
    marker = {"release_id": release_id, "files": sorted(files)}
    write_file(home / HARNESS_MARKER, (json.dumps(marker, indent=1) + "\n").encode())
    return {"release_id": release_id, "written": written, "removed": removed}


def _read_marker(home: Path) -> bytes | None:
    try:
        dir_fd = os.open(home, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return _read_regular(dir_fd, HARNESS_MARKER)
    finally:
        os.close(dir_fd)


def installed_release(home: Path) -> str | None:
    try:
        marker = json.loads(_read_marker(home) or b"{}")
    except ValueError:
        return None
    release_id = marker.get("release_id") if isinstance(marker, dict) else None
    return release_id if isinstance(release_id, str) else None
