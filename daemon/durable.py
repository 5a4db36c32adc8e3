"""Durable files: the one place Reef's own Python code makes a file or a directory survive a power cut.

A write reaches the disk only when it is fsynced; a new, renamed or removed name only when its directory is.
So every file Reef keeps (release-store LFS objects, the token, checkouts, trained candidates, built models)
is written to a temp file beside its final name, fsynced, renamed into place, and its directory fsynced;
a directory that is renamed into place has every file and directory in it fsynced first. ``kill -9`` cannot
tell whether any of this is done (the page cache survives a killed process), so tests/test_power_loss.py
runs the daemon under a double that drops every unsynced write and checks what is left.

SQLite (the record store, ``synchronous=FULL``) and libgit2 (git objects and refs, with its fsync option on)
make their own writes durable; the same test covers them at the C library's boundary.

Call through the module (``durable.sync_fd(fd)``), not with names imported from it: the power-loss test's
negative controls replace these functions in a daemon process to show that a missing fsync is caught.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def sync_fd(fd: int) -> None:
    """Make an open file's contents (and size) durable."""
    os.fsync(fd)


def sync_file(path: str | os.PathLike[str]) -> None:
    """Make a file's contents durable (its name needs ``sync_dir`` of its directory)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        sync_fd(fd)
    finally:
        os.close(fd)


def sync_dir(path: str | os.PathLike[str]) -> None:
    """Make the names in a directory durable: files created, renamed into it or removed from it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(path: str | os.PathLike[str]) -> None:
    """Make every file and directory under ``path`` durable, deepest first (before renaming it into place)."""
    for dirpath, _dirnames, filenames in os.walk(path, topdown=False):
        for name in filenames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                sync_file(p)
        sync_dir(dirpath)


@contextlib.contextmanager
def staged_dir(dest: Path) -> Iterator[Path]:
    """A temp directory beside ``dest`` to write what becomes ``dest`` (``publish_dir``), all or nothing: whatever
    the block leaves unpublished, on an exception or not, is removed."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already once published


def publish_dir(tmp: Path, dest: Path) -> None:
    """Rename the complete directory ``tmp`` to ``dest`` durably: every file in it synced first, then the name."""
    sync_tree(tmp)
    os.rename(tmp, dest)
    sync_dir(dest.parent)


def mkdirs(path: str | os.PathLike[str]) -> None:
    """``mkdir -p`` whose new directories are durable: the parent of each one made is synced."""
    path = Path(path)
    missing: list[Path] = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made by another process, which may not have synced it yet
            d.mkdir()
        sync_dir(d.parent)


def write_atomic(path: str | os.PathLike[str], data: bytes, *, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data``, all or nothing, durably: temp file beside it, fsync, rename, fsync the
    directory. A reader (or a power cut) sees the old contents or the new, never a mix or an empty file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            sync_fd(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    sync_dir(path.parent)
