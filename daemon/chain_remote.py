"""A release store's git remote: publishing as compare-and-swap against the remote's refs, large files in the
remote's LFS store, and following the remote's heads.

``daemon/releases/`` owns the local store (its ``remote.py`` is the side that uses this transport); with
``chain_remote`` set, every ref update it makes under ``refs/reef/`` goes through ``ChainRemote.push`` first, and
the daemon calls ``ReleaseStore.follow`` on an interval (``chain_fetch_s``) to take in what other daemons published.

Design choices:
- The git binary does the transport (``git push`` / ``git fetch`` with ``--git-dir`` on the local bare store):
  libgit2 has no push with an expected old value, and the git binary speaks every transport a team has (a path,
  ``git://``, ``http(s)://``, ``ssh://``) with the credentials already set up for it in git's config (a
  credential helper, ``http.sslCAInfo``, ``core.sshCommand`` or ``GIT_SSH_COMMAND`` naming a key and a known-hosts
  file). Prompts are off (``GIT_TERMINAL_PROMPT=0``, an empty askpass, ssh ``BatchMode``), every call has a timeout
  and runs in its own process group (killed whole on the timeout): a remote that asks for a password, hangs or is
  gone is a refusal (``RemoteRefused``, 502), never a stalled publish or a lingering transport process.
- Compare-and-swap: one ``git push --atomic --porcelain`` per ref update, with ``--force-with-lease=<ref>:<old>``
  for each ref (an empty ``<old>``: the ref must not exist). git's receive-pack checks each old value under the
  remote's ref lock, so two daemons publishing on the same head cannot both win; the loser's push is refused as
  "stale info" / "fetch first" / "failed to update ref", which is ``HeadMoved`` (409) with the remote's actual
  head, exactly as a local head move. The local ref moves only after the remote accepted, so a refused push
  publishes nothing anywhere.
- Large files: the LFS objects a pushed release names are copied into the remote's LFS store before the push
  (temp file + fsync + rename, sha256 checked), and copied back when a follower takes in a release, before its
  local head moves: a head never names bytes that are not there. The store is a directory in the Git LFS
  layout (``objects/<aa>/<bb>/<sha256>``): by default ``<remote>/lfs/objects`` for a path remote, the layout
  ``git lfs`` itself uses for a file remote (so a Reef store is a valid remote, and ``git lfs`` tooling can read
  it); for a URL remote, ``chain_lfs`` names such a directory on shared storage, and without one a release with
  large files is refused before anything is pushed.
- Following: ``git fetch --prune`` of ``+refs/reef/*`` into ``refs/reef-remote/*`` (a mirror namespace nothing
  else reads), then each local ref that differs is moved to the remote's value by the store's own local
  compare-and-swap (after its LFS objects are in). The remote is the shared truth: a local ref that is not an
  ancestor of the remote's is moved anyway, with a warning naming both. Local chains the remote lacks (made
  before the remote was configured) are pushed to it on the first follow, as an init would be.
- What a remote is trusted with: to say which releases exist, not to write anywhere else. Before a ref moves to a
  fetched commit, the store checks every commit it newly reaches (``releases.Remote._incoming``): tree entry names
  safe on disk, a ``content_id`` that is the commit's content tree (it names a checkout directory), LFS ids that
  are sha256 ids, and sizes under ``max_blob_bytes`` (a git object, read from its header before it is inflated)
  and ``max_lfs_bytes`` (an LFS object, from the manifest before the copy, and the copy stops at the declared
  size). A release that fails is refused by name, its ref stays, and serving goes on.
- Credentials in the URL (``https://user:token@host/...``) never reach a command line (``/proc/<pid>/cmdline`` is
  readable by every local user): git is given the URL without them, and a credential helper configured through
  ``GIT_CONFIG_*`` environment variables (readable by this user only) answers with them from its environment.
  Messages and logs show the URL as ``//***@host``.
- A path remote's hooks would run as this daemon's user (git runs ``receive-pack`` in the remote repository on
  a push); the push runs it with ``core.hooksPath=/dev/null``, so they never do. A remote's own policy belongs on
  a git server (its hooks run as the server's user).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from daemon import durable
from daemon.errors import BadRequest, HeadMoved, LockBusy, RemoteRefused

log = logging.getLogger("reef.remote")

MIRROR_REF = "refs/reef-remote/"
URL_SCHEMES = ("git://", "http://", "https://", "ssh://")
_ZERO = "0" * 40
# what git says when the remote's ref is not at the value the push expected (client side or under the remote's lock)
_MOVED = re.compile(r"stale info|fetch first|non-fast-forward|failed to update ref|but expected|already exists|"
                    r"cannot lock ref")
_CHUNK = 4 << 20
# The size bounds on what a remote sends (``chain_max_blob_bytes`` / ``chain_max_lfs_bytes``). Reef stores every
# file over ``lfs_threshold`` (1 MiB) as an LFS object, so the git objects of a release it published are small: a
# manifest, harness text, configs; 64 MiB is far above any of them. LFS objects are weights files: single safetensors
# shards are <= 5-50 GB as transformers writes them and a 70B GGUF at 4 bits is about 40 GB, so 64 GiB takes any
# one weights file while refusing what only an attacker or a mistake sends. LFS objects are streamed (never held in
# memory); the bound is on disk.
DEFAULT_MAX_BLOB_BYTES = 64 << 20
DEFAULT_MAX_LFS_BYTES = 64 << 30
# answers git's "get" with the URL's credentials from its own environment (never from its command line)
_HELPER = ('!f() { if test "$1" = get; then printf \'username=%s\\npassword=%s\\n\' "$REEF_CHAIN_USERNAME" '
           '"$REEF_CHAIN_PASSWORD"; fi; }; f')
_ADVICE = {"Please make sure you have the correct access rights", "and the repository exists."}


def check_remote(remote: str, home: Path) -> str:
    """A ``chain_remote`` as the git binary is given it: a URL with a known scheme, or a path (relative to
    ``home``, made absolute). Anything else is a ``BadRequest`` naming what is accepted."""
    if not isinstance(remote, str) or not remote.strip():
        raise BadRequest("config: chain_remote must be a path or a git://, http(s):// or ssh:// URL")
    remote = remote.strip()
    host, colon, path = remote.partition(":")
    if colon and "/" not in host and "://" not in remote and not remote.startswith(("/", ".", "~")):
        # git reads ``host:path`` (``git@host:org/chains.git``) as ssh; taken as a path here it would name a
        # directory that never exists, so it is refused with the URL that means the same
        where = path if path.startswith("/") else f"/~/{path}"
        raise BadRequest(f"config: chain_remote {remote!r} is scp-style; write it as the URL ssh://{host}{where}")
    if remote.startswith("file://"):
        remote = remote[len("file://"):]
    elif "://" in remote:
        if not remote.startswith(URL_SCHEMES):
            raise BadRequest(f"config: chain_remote {remote!r}: unknown scheme; use a path or a "
                             f"{', '.join(s[:-3] for s in URL_SCHEMES)} URL")
        return remote
    p = Path(remote).expanduser()
    return str(p if p.is_absolute() else home / p)


def is_path(remote: str) -> bool:
    return not remote.startswith(URL_SCHEMES)


def split_credentials(url: str) -> tuple[str, str | None, str | None]:
    """``(url without credentials, user name, password)``. An ssh URL keeps its user name (ssh logs in as it; a
    password there is dropped: ssh takes none from a URL), a git:// URL loses both (it has no authentication)."""
    if is_path(url):
        return url, None, None
    parts = urlsplit(url)
    userinfo, at, host = parts.netloc.rpartition("@")
    if not at:
        return url, None, None
    user, colon, password = userinfo.partition(":")
    if url.startswith("ssh://"):
        return parts._replace(netloc=f"{user}@{host}").geturl(), None, None
    bare = parts._replace(netloc=host).geturl()
    if url.startswith("git://"):
        return bare, None, None
    return bare, unquote(user), unquote(password) if colon else ""


@dataclass(frozen=True)
class RefPush:
    """One ref of an atomic push: move ``name`` from ``old`` (None: absent) to ``new`` (None: delete)."""

    name: str
    new: str | None
    old: str | None


class ChainRemote:
    """The git remote of a release store (``path``: the local bare repository)."""

    def __init__(self, path: Path, url: str, *, lfs_store: str | os.PathLike[str] | None = None,
                 timeout: float = 60.0, max_blob_bytes: int = DEFAULT_MAX_BLOB_BYTES,
                 max_lfs_bytes: int = DEFAULT_MAX_LFS_BYTES) -> None:
        if shutil.which("git") is None:
            raise BadRequest("config: chain_remote needs the git binary on PATH (apt-get install git)")
        self.path = Path(path)
        # the URL git is given (no credentials: a command line is readable by every local user); the credentials
        # reach git only through the environment of its credential helper (``_git``)
        self.url, self._username, self._password = split_credentials(url)
        self.shown = re.sub(r"//[^/@]*@", "//***@", url)  # the URL as messages and logs show it: no credentials
        self.timeout = timeout
        self.max_blob_bytes = max_blob_bytes  # the largest git object a fetched release may hold (its header)
        self.max_lfs_bytes = max_lfs_bytes  # the largest LFS object a fetched release may name
        # the directory that must exist already (a missing share or remote is refused, never created here)
        self._lfs_root: Path | None = None
        if lfs_store is not None:
            self.lfs_dir: Path | None = Path(lfs_store)
            self._lfs_root = self.lfs_dir
        elif is_path(url):
            self.lfs_dir = Path(url) / "lfs" / "objects"
            self._lfs_root = Path(url)
        else:
            self.lfs_dir = None  # a URL remote without a shared LFS directory: large files are refused

    # --- git -----------------------------------------------------------------------------------------------

    def _git(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GIT_", "REEF_CHAIN_"))}
        env.update(GIT_TERMINAL_PROMPT="0", GIT_ASKPASS="true", LC_ALL="C")
        if self.url.startswith("ssh://") and args[0] != "config":
            env["GIT_SSH_COMMAND"] = self._ssh_command()
        if self._username is not None:
            # for this remote's host only: an empty helper first drops the helpers configured before it, so the
            # URL's credentials are the ones used; the helper reads them from its environment
            parts = urlsplit(self.url)
            key = f"credential.{parts.scheme}://{parts.netloc}.helper"
            env.update(GIT_CONFIG_COUNT="2", GIT_CONFIG_KEY_0=key, GIT_CONFIG_VALUE_0="", GIT_CONFIG_KEY_1=key,
                       GIT_CONFIG_VALUE_1=_HELPER, REEF_CHAIN_USERNAME=self._username,
                       REEF_CHAIN_PASSWORD=self._password or "")
        argv = ["git", f"--git-dir={self.path}", *args]
        # its own process group: on a timeout the transport helper (git-remote-http, ssh) it started dies with it,
        # rather than hanging on the remote for as long as the daemon runs
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise RemoteRefused(self.shown, f"git {args[0]} did not finish in {self.timeout:.0f} s") from None
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)

    def _ssh_command(self) -> str:
        """The ssh git is set up to use here (``GIT_SSH_COMMAND``, else ``core.sshCommand`` from any git config
        level, else ``ssh``: how a key, a known-hosts file or a port is chosen), with prompts off: a passphrase, a
        password or an unknown host key is a refusal, never a question nobody answers."""
        chosen = os.environ.get("GIT_SSH_COMMAND", "").strip()
        if not chosen:
            chosen = self._git("config", "--get", "core.sshCommand").stdout.strip()
        return f"{chosen or 'ssh'} -o BatchMode=yes -o ConnectTimeout=10"

    def _why(self, proc: subprocess.CompletedProcess[str]) -> str:
        # the last lines that say something: git's own, or its transport's (ssh's "Permission denied (publickey)"
        # comes before git's "Could not read from remote repository"), without git's stock advice and hints
        lines = [ln.strip() for ln in (proc.stderr or "").splitlines()
                 if ln.strip() and not ln.startswith("hint:") and ln.strip() not in _ADVICE]
        return self._redact(" ".join((lines or [f"git exited {proc.returncode}"])[-3:]))

    def _redact(self, text: str) -> str:
        """``text`` with the URL as shown (no credentials), and no credential however git chose to print it."""
        text = text.replace(self.url, self.shown)
        # a user name alone is the token (``https://<token>@host``) when long enough to be one
        token = self._username if not self._password and len(self._username or "") >= 8 else None
        for secret in (self._password, token):
            if secret:
                text = text.replace(secret, "***")
        return text

    def remote_heads(self, prefix: str = "refs/reef/") -> dict[str, str]:
        """The remote's refs under ``prefix`` as it has them now (``git ls-remote``)."""
        proc = self._git("ls-remote", self.url, f"{prefix}*")
        if proc.returncode != 0:
            raise RemoteRefused(self.shown, self._why(proc))
        out = {}
        for line in proc.stdout.splitlines():
            oid, _, name = line.partition("\t")
            if name.startswith(prefix):
                out[name] = oid
        return out

    def push(self, updates: Iterable[RefPush], scenario: str) -> None:
        """Apply ``updates`` on the remote, all or none, each only if the remote's ref is at its ``old`` value.

        ``HeadMoved`` when a ref was not (its actual value read back from the remote); ``RemoteRefused`` for
        anything else (unreachable, no such repository, auth, a hook's refusal): nothing was changed."""
        updates = list(updates)
        args = ["push", "--atomic", "--porcelain", "--no-verify"]
        if is_path(self.url):  # receive-pack runs in the remote repository, as this user: never its hooks
            args.append("--receive-pack=git -c core.hooksPath=/dev/null receive-pack")
        specs = []
        for u in updates:
            args.append(f"--force-with-lease={u.name}:{u.old or ''}")
            specs.append(f"{u.new}:{u.name}" if u.new is not None else f":{u.name}")
        proc = self._git(*args, self.url, *specs)
        if proc.returncode == 0:
            return
        text = f"{proc.stdout}\n{proc.stderr}"
        rejected = [ln for ln in proc.stdout.splitlines() if ln.startswith("!")]
        # the ref check fails client side ("stale info") or under the remote's lock (receive-pack prints "cannot lock
        # ref ...: is at X but expected Y" and, with --atomic, rejects every ref as "atomic transaction failed")
        if _MOVED.search(text):
            main = next((u for u in updates if u.name.startswith("refs/reef/scenarios/")), updates[0])
            try:
                actual = self.remote_heads(main.name).get(main.name)
            except RemoteRefused:
                actual = None
            if actual == main.old:  # the remote's ref is where we expected: its lock was busy, not moved
                raise LockBusy(main.name, f"{self.shown} (remote)", self.timeout)
            raise HeadMoved(scenario, main.old, actual)
        why = self._why(proc)
        if rejected:  # what the remote said about each ref, and what its hooks printed
            said = [ln.strip() for ln in proc.stderr.splitlines() if ln.startswith("remote:") and ln[7:].strip()]
            why = "; ".join([ln.split("\t")[-1] for ln in rejected] + said[-3:])
        log.warning("push to %s refused: %s", self.shown, self._redact(text.strip()[-2000:]))
        raise RemoteRefused(self.shown, why)

    def fetch(self) -> dict[str, str]:
        """Take the remote's ``refs/reef/*`` into the mirror namespace; returns ``{local ref name: commit}``."""
        proc = self._git("fetch", "--prune", "--no-tags", "--quiet", self.url, f"+refs/reef/*:{MIRROR_REF}*")
        if proc.returncode != 0:
            raise RemoteRefused(self.shown, self._why(proc))
        out = {}
        listed = self._git("for-each-ref", "--format=%(objectname) %(refname)", MIRROR_REF)
        for line in listed.stdout.splitlines():
            oid, _, name = line.partition(" ")
            out["refs/reef/" + name[len(MIRROR_REF):]] = oid
        return out

    # --- LFS -----------------------------------------------------------------------------------------------

    def _remote_lfs(self, sha: str) -> Path:
        assert self.lfs_dir is not None
        return self.lfs_dir / sha[:2] / sha[2:4] / sha

    def upload(self, objects: Iterable[tuple[str, int, Path]]) -> None:
        """Copy LFS objects ``(sha256, size, local file)`` into the remote's LFS store unless already there."""
        objects = list(objects)
        if not objects:
            return
        if self.lfs_dir is None:
            raise RemoteRefused(self.shown, f"a release with {len(objects)} large file(s) needs an LFS store, and "
                                "this remote is a URL: set chain_lfs to a directory all daemons share")
        assert self._lfs_root is not None
        if not self._lfs_root.is_dir():
            raise RemoteRefused(self.shown, f"{self._lfs_root} does not exist or is not a directory, so the LFS store "
                                f"{self.lfs_dir} cannot take this release's large files")
        try:
            for sha, size, src in objects:
                final = self._remote_lfs(sha)
                if final.exists() and final.stat().st_size == size:
                    continue
                _copy_verified(src, final, sha, size)
        except OSError as e:
            raise RemoteRefused(self.shown, f"cannot write the LFS store {self.lfs_dir}: {e}") from e

    def download(self, sha: str, size: int, dest: Path) -> None:
        """Copy one LFS object from the remote's store to ``dest`` (checked against its sha256 and size)."""
        if self.lfs_dir is None:
            raise RemoteRefused(self.shown, f"LFS object {sha} is not here and this remote has no LFS store "
                                "(set chain_lfs)")
        if size > self.max_lfs_bytes:
            raise RemoteRefused(self.shown, f"LFS object {sha} is {size} bytes, over the bound of "
                                f"{self.max_lfs_bytes} (chain_max_lfs_bytes)")
        src = self._remote_lfs(sha)
        try:
            _copy_verified(src, dest, sha, size)
        except FileNotFoundError:
            raise RemoteRefused(self.shown, f"LFS object {sha} is missing from {self.lfs_dir}") from None
        except OSError as e:
            raise RemoteRefused(self.shown, f"cannot read LFS object {sha} from {self.lfs_dir}: {e}") from e


def _copy_verified(src: Path, final: Path, sha: str, size: int) -> None:
    """Copy ``src`` to ``final`` durably (temp beside it, fsync, rename, fsync the directory), refusing bytes that
    do not hash to ``sha`` (a torn or foreign file is never put in place)."""
    durable.mkdirs(final.parent)
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=".obj-")
    try:
        h = hashlib.sha256()
        n = 0
        with open(src, "rb") as f, open(fd, "wb", closefd=False) as out:
            if os.fstat(f.fileno()).st_size != size:  # never copy more than the release says the object holds
                raise OSError(f"{src} holds {os.fstat(f.fileno()).st_size} bytes, not the {size} of LFS object {sha}")
            while n <= size and (chunk := f.read(min(_CHUNK, size + 1 - n))):
                h.update(chunk)
                n += len(chunk)
                out.write(chunk)
        if h.hexdigest() != sha or n != size:
            raise OSError(f"{src} does not hold LFS object {sha} ({n} bytes, sha256 {h.hexdigest()})")
        durable.sync_fd(fd)
        os.close(fd)
        fd = -1
        os.chmod(tmp, 0o444)
        os.rename(tmp, final)
        durable.sync_dir(final.parent)
    finally:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
