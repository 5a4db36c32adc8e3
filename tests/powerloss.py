"""The power-loss double: what a disk holds after the power is cut, rebuilt from a trace of a real daemon.

A process killed with ``kill -9`` loses nothing the kernel already has (the page cache survives), so kill -9
tests cannot see a missing fsync. Here the daemon runs under ``powerloss_shim.c`` (LD_PRELOAD), which logs
every file operation under its state dir at the C library's boundary: Reef's Python code, SQLite and libgit2
alike. ``Trace`` replays that log on a model of the file system that keeps two states per file and directory,
what the kernel has and what is durable, and ``Trace.image`` writes out the durable state at any point of the
log, as a power cut at that moment would leave it:

- starting state: the directory as it was before the daemon started (``Snapshot``), all of it durable;
- file contents reach the disk only through ``fsync``/``fdatasync`` of that file (or ``sync``/``syncfs``, or
  an ``O_SYNC`` fd): every write, truncate or size change not followed by one is dropped;
- names (create, rename, unlink, mkdir, link) reach the disk through ``fsync`` of a directory they touch (a
  rename is one operation, durable when either of its directories is fsynced), and a directory's changes reach
  it in order. One rule beyond POSIX, as ext4, XFS and btrfs behave and as git and libgit2 assume: an fsync of a
  newly created file or directory also makes its name durable, and the names of new directories above it.
  A rename, a link or an unlink still needs an fsync of the directory.

Three flavours of cut, each a state a real disk can be in after a crash, so correct code survives them all:
``fsync`` is the above; ``journal`` keeps every name operation up to the cut (a journaling file system commits
metadata on its own, and with delayed allocation the data may still be missing: the zero-length file after a
rename without fsync); ``torn`` is ``fsync`` plus a random subset of the unsynced writes, cut into 512-byte
sectors (unsynced writes reach the disk in any order, as in SQLite's crash tests).

Not modelled: a sector torn inside itself or garbage in unsynced sectors (SQLite's crash test writes random
bytes there), fsync errors (TESTING.md item 3), a disk that lies about flushing, file modes and times, and
writes through ``mmap`` (only SQLite's ``-shm`` wal-index is written that way; it is memory shared between
connections, rebuilt from the WAL by the first connection after a crash, so images leave it out). A trace the
model cannot follow fails loudly: ``Trace.check_complete`` compares the model's kernel state with the real
directory after the daemon died.
"""

from __future__ import annotations

import contextlib
import os
import random
import stat
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import machine_lock

HERE = Path(__file__).resolve().parent
RECORD = struct.Struct("<cBHIQQQqQII")
SECTOR = 512
FLAVOURS = ("fsync", "journal", "torn")


def build_shim(dest_dir: Path) -> Path:
    """Compile the recorder with the system C compiler (install.sh --dev installs gcc)."""
    out = dest_dir / "powerloss.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", str(out),
                    str(HERE / "powerloss_shim.c"), "-ldl"], check=True, capture_output=True, text=True)
    return out


def traced_env(env: dict[str, str], shim: Path, root: Path, log: Path) -> dict[str, str]:
    """``env`` for a process (and its children) whose file operations under ``root`` are logged to ``log``."""
    return {**env, "LD_PRELOAD": str(shim), "POWERLOSS_ROOT": str(root), "POWERLOSS_LOG": str(log)}


@contextlib.contextmanager
def quiesced(log: Path) -> Iterator[None]:
    """Hold the recorder's lock: no traced process is between doing a file operation and logging it.

    Kill the traced processes inside this block and the log matches the disk exactly."""
    with machine_lock(log):  # the shim takes the same flock on the log around each operation and its entry
        yield


def log_position(log: Path) -> int:
    """Where the log ends now: everything a traced process did before this call is before this position."""
    try:
        return log.stat().st_size
    except FileNotFoundError:
        return 0


Op = tuple[int, str, int, int, int, int, int, str, str, bytes]  # end, op, flags, ino, ino2, ino3, off, p1, p2, data


def wait_until(log: Path, done: Callable[[list[Op]], bool], what: str, timeout: float = 60) -> None:
    """Wait until the log's records so far satisfy ``done`` (an event in the traced processes)."""
    deadline = time.monotonic() + timeout  # a hang guard only
    while time.monotonic() < deadline:
        raw = log.read_bytes()
        if done(list(Trace._parse(raw[: _whole(raw)]))):
            return
        time.sleep(0.02)
    raise TimeoutError(f"{what}: not seen in {timeout}s")


def _whole(raw: bytes) -> int:
    """The length of the whole records at the start of ``raw`` (a traced process may be appending one)."""
    i = 0
    while i + RECORD.size <= len(raw):
        *_, n, l1, l2 = RECORD.unpack_from(raw, i)
        if i + RECORD.size + l1 + l2 + n > len(raw):
            break
        i += RECORD.size + l1 + l2 + n
    return i


@dataclass
class _Node:
    kind: str  # "file", "dir" or "link"
    data: bytearray = field(default_factory=bytearray)  # durable contents (files), the target (links)
    pending: list[tuple[str, int, bytes]] = field(default_factory=list)  # unsynced ("w", off, data) / ("z", size, b"")
    entries: dict[str, int] = field(default_factory=dict)  # durable names (dirs)


@dataclass
class _NameOp:
    """One pending name operation: ``dels`` and ``adds`` as (dir id, name[, node id]); durable as a whole."""

    dirs: frozenset[int]
    dels: tuple[tuple[int, str], ...] = ()
    adds: tuple[tuple[int, str, int], ...] = ()
    creates: int | None = None  # the node a create op made


@dataclass
class CutStats:
    dropped_writes: int  # unsynced data operations (write, truncate) left out of the image (torn: some sectors kept)
    dropped_names: int  # unsynced name operations left out of the image
    kept_writes: int  # data operations the image holds that were logged since the snapshot


class TraceError(AssertionError):
    """The trace holds something the model cannot follow (an op it does not know, an inode it never saw)."""


def _apply(data: bytearray, op: tuple[str, int, bytes]) -> None:
    kind, n, payload = op
    if kind == "w":
        end = n + len(payload)
        if len(data) < n:
            data.extend(bytes(n - len(data)))
        data[n:end] = payload
    elif kind == "z":
        del data[n:]
        if len(data) < n:
            data.extend(bytes(n - len(data)))
    elif kind == "e" and len(data) < n:
        data.extend(bytes(n - len(data)))


def _sectors(op: tuple[str, int, bytes]) -> Iterator[tuple[str, int, bytes]]:
    kind, off, payload = op
    if kind != "w":
        yield op
        return
    at = off
    while at < off + len(payload):
        nxt = min((at // SECTOR + 1) * SECTOR, off + len(payload))
        yield ("w", at, payload[at - off : nxt - off])
        at = nxt


class Snapshot:
    """The watched directory before the traced run: every file's bytes and every directory's names."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.nodes: dict[int, _Node] = {}  # by inode number
        self.root_ino = self._take(root)

    def _take(self, path: Path) -> int:
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode):
            node = _Node("dir")
            for entry in os.scandir(path):
                ino = self._take(Path(entry.path))
                if ino:
                    node.entries[entry.name] = ino
        elif stat.S_ISREG(st.st_mode):
            node = _Node("file", bytearray(path.read_bytes()))
        elif stat.S_ISLNK(st.st_mode):
            node = _Node("link", bytearray(os.fsencode(os.readlink(path))))
        else:
            raise TraceError(f"snapshot: {path} is not a file, a directory or a symlink")
        self.nodes[st.st_ino] = node
        return st.st_ino


class Trace:
    """A snapshot plus the recorder's log: the durable state at any log position, and the kernel's at the end."""

    def __init__(self, snapshot: Snapshot, log: Path) -> None:
        self.snapshot = snapshot
        self.root = snapshot.root
        self.log = log
        self.records = list(self._parse(log.read_bytes()))
        self.counts: dict[str, int] = {}
        for rec in self.records:
            self.counts[rec[1]] = self.counts.get(rec[1], 0) + 1

    @staticmethod
    def _parse(raw: bytes) -> Iterator[Op]:
        i = 0
        while i < len(raw):
            op, flags, _, _pid, ino, ino2, ino3, off, n, l1, l2 = RECORD.unpack_from(raw, i)
            i += RECORD.size
            p1 = raw[i : i + l1].decode(errors="surrogateescape")
            i += l1
            p2 = raw[i : i + l2].decode(errors="surrogateescape")
            i += l2
            data = raw[i : i + n]
            i += n
            yield i, op.decode(), flags, ino, ino2, ino3, off, p1, p2, data

    # --- the replay ------------------------------------------------------------------------------------------

    def _replay(self, upto: int) -> tuple[dict[int, _Node], int, list[_NameOp], int]:
        """Replay records ending at or before ``upto``: (nodes by id, root id, pending name ops, data ops kept)."""
        nodes: dict[int, _Node] = {}
        ids: dict[int, int] = {}  # inode number -> id of the node it names now (inode numbers are reused)
        for ino, snap in self.snapshot.nodes.items():
            nodes[ino] = _Node(snap.kind, bytearray(snap.data), [], dict(snap.entries))
            ids[ino] = ino
        next_id = max(nodes, default=0) + 1
        names: list[_NameOp] = []
        created: dict[int, _NameOp] = {}  # node id -> the pending op that created it
        kept = 0

        def node(ino: int, what: str) -> tuple[int, _Node]:
            if ino not in ids:
                raise TraceError(f"{what}: inode {ino} was never created under {self.root} (an unlogged open?)")
            return ids[ino], nodes[ids[ino]]

        def sync_file(n: _Node) -> int:
            for op in n.pending:
                _apply(n.data, op)
            count = len(n.pending)
            n.pending.clear()
            return count

        def flush(seeds: list[_NameOp] | None) -> None:
            """Make ``seeds`` durable (all pending name ops if None), and with them every earlier op on a
            directory they touch: a directory's changes reach the disk in order (its durable ones are a prefix)."""
            marked = {id(op) for op in seeds} if seeds is not None else None
            dirs: set[int] = set()
            durable = [False] * len(names)
            for i in range(len(names) - 1, -1, -1):
                if marked is None or id(names[i]) in marked or names[i].dirs & dirs:
                    durable[i] = True
                    dirs |= names[i].dirs
            done = [op for op, d in zip(names, durable, strict=True) if d]
            self._all_names(nodes, done)
            for op in done:
                if op.creates is not None:
                    created.pop(op.creates, None)
            names[:] = [op for op, d in zip(names, durable, strict=True) if not d]

        def fsync(nid: int) -> None:
            # Linux's rule (ext4, XFS, btrfs): fsync of a new file or directory also makes its name durable,
            # and the names of the new directories above it; a directory's fsync makes its entries durable
            seeds = []
            x: int | None = nid
            while x is not None and x in created:
                seeds.append(created[x])
                x = created[x].adds[0][0]
            if nodes[nid].kind == "dir":
                seeds += [op for op in names if nid in op.dirs]
            flush(seeds)

        for end, op, flags, ino, ino2, ino3, off, p1, p2, data in self.records:
            if end > upto:
                break
            if op == "C":
                pid, _ = node(ino2, f"create {p1}")
                nid = next_id
                next_id += 1
                nodes[nid] = _Node("dir" if flags & 2 else "link" if flags & 4 else "file")
                if flags & 4:
                    nodes[nid].data[:] = p2.encode(errors="surrogateescape")
                ids[ino] = nid
                names.append(_NameOp(frozenset({pid}), adds=((pid, os.path.basename(p1), nid),), creates=nid))
                created[nid] = names[-1]
            elif op in "WZE":
                _, n = node(ino, f"{op} {p1}")
                change = ("w", off, data) if op == "W" else (op.lower(), off, b"")
                if flags & 1:  # O_SYNC fd: durable when the call returns
                    _apply(n.data, change)
                    kept += 1
                else:
                    n.pending.append(change)
            elif op == "S":
                nid, n = node(ino, f"fsync {p1}")
                kept += sync_file(n)
                fsync(nid)
            elif op == "Y":
                for n in nodes.values():
                    kept += sync_file(n)
                flush(None)
            elif op == "R":
                nid, _ = node(ino, f"rename {p1}")
                sp, _ = node(ino2, f"rename {p1} (its directory)")
                dp, _ = node(ino3, f"rename {p2} (its directory)")
                names.append(_NameOp(frozenset({sp, dp}), dels=((sp, os.path.basename(p1)),),
                                     adds=((dp, os.path.basename(p2), nid),)))
            elif op == "U":
                pid, _ = node(ino2, f"unlink {p1}")
                names.append(_NameOp(frozenset({pid}), dels=((pid, os.path.basename(p1)),)))
            elif op == "L":
                nid, _ = node(ino, f"link {p2}")
                pid, _ = node(ino2, f"link {p2} (its directory)")
                names.append(_NameOp(frozenset({pid}), adds=((pid, os.path.basename(p2), nid),)))
            else:
                raise TraceError(f"the model cannot follow {op!r} {p1} {p2}")
        return nodes, ids[self.snapshot.root_ino], names, kept

    # --- images ----------------------------------------------------------------------------------------------

    def image(self, upto: int, dest: Path, flavour: str = "fsync", seed: int = 0) -> CutStats:
        """Write the durable state at log position ``upto`` into the new directory ``dest``."""
        assert flavour in FLAVOURS, flavour
        nodes, root_id, names, kept = self._replay(upto)
        dropped_names = len(names)
        if flavour == "journal":
            self._all_names(nodes, names)
            dropped_names = 0
        rng = random.Random(seed)
        dropped = 0
        for n in nodes.values():
            for op in n.pending:
                if flavour == "torn":
                    for piece in _sectors(op):
                        if rng.random() < 0.5:
                            _apply(n.data, piece)
                dropped += 1
        self._write(nodes, root_id, dest)
        return CutStats(dropped_writes=dropped, dropped_names=dropped_names, kept_writes=kept)

    @staticmethod
    def _all_names(nodes: dict[int, _Node], names: list[_NameOp]) -> None:
        for op in names:
            for d, name in op.dels:
                nodes[d].entries.pop(name, None)
            for d, name, target in op.adds:
                nodes[d].entries[name] = target

    def _write(self, nodes: dict[int, _Node], root_id: int, dest: Path) -> None:
        dest.mkdir()
        stack = [(root_id, dest)]
        while stack:
            nid, path = stack.pop()
            for name, child in sorted(nodes[nid].entries.items()):
                if name.endswith("-shm"):
                    continue  # SQLite's wal-index: shared memory, rebuilt after a crash (see the module docstring)
                target = path / name
                if nodes[child].kind == "dir":
                    target.mkdir()
                    stack.append((child, target))
                elif nodes[child].kind == "link":
                    target.symlink_to(nodes[child].data.decode(errors="surrogateescape"))
                else:
                    target.write_bytes(nodes[child].data)

    def kernel_state(self) -> dict[str, bytes | None]:
        """What the kernel held at the end of the log, by relative path (``None`` for a directory)."""
        nodes, root_id, names, _ = self._replay(1 << 62)
        for n in nodes.values():
            for op in n.pending:
                _apply(n.data, op)
        self._all_names(nodes, names)
        return self._flatten(nodes, root_id)

    @staticmethod
    def _flatten(nodes: dict[int, _Node], root_id: int) -> dict[str, bytes | None]:
        out: dict[str, bytes | None] = {}
        stack = [(root_id, "")]
        while stack:
            nid, prefix = stack.pop()
            for name, child in nodes[nid].entries.items():
                rel = prefix + name
                if name.endswith("-shm"):
                    continue
                if nodes[child].kind == "dir":
                    out[rel] = None
                    stack.append((child, rel + "/"))
                elif nodes[child].kind == "link":
                    out[rel] = b"-> " + bytes(nodes[child].data)
                else:
                    out[rel] = bytes(nodes[child].data)
        return out

    def check_complete(self) -> None:
        """The model's kernel state is the real directory, byte for byte (run after the traced processes died).

        This is what keeps the double honest: an operation the recorder missed shows up here."""
        real: dict[str, bytes | None] = {}
        for dirpath, dirnames, filenames in os.walk(self.root):
            rel = os.path.relpath(dirpath, self.root)
            prefix = "" if rel == "." else rel + "/"
            for name in dirnames + filenames:
                p = os.path.join(dirpath, name)
                mode = os.lstat(p).st_mode
                if name.endswith("-shm") or stat.S_ISSOCK(mode):
                    continue
                if stat.S_ISLNK(mode):
                    real[prefix + name] = b"-> " + os.fsencode(os.readlink(p))
                else:
                    real[prefix + name] = None if stat.S_ISDIR(mode) else Path(p).read_bytes()
        model = self.kernel_state()
        missing = sorted(set(real) - set(model))
        extra = sorted(set(model) - set(real))
        differ = sorted(k for k in set(real) & set(model) if real[k] != model[k])
        if missing or extra or differ:
            raise TraceError(f"the trace does not explain the directory: on disk only {missing[:5]}, in the model"
                             f" only {extra[:5]}, different {differ[:5]}")
