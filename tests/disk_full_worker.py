"""A release store on a tiny tmpfs that fills up at a chosen moment of a rollback (run by test_release_faults.py).

Usage (inside ``unshare -rm`` with a tmpfs mounted on DIR): ``disk_full_worker.py MODE DIR OUT``. It publishes an
init and a train release on ``DIR/artifacts.git``, then rolls back to the init with the disk filled (by a file
written until ENOSPC, a real full disk) at the moment MODE names:

- ``commit``: just before the release commit is written (libgit2 then returns the id of a commit it never wrote);
- ``commit-then-space``: the same, and the space comes back just before the ref update (so the ref update works);
- ``ref``: just before the ref update (the objects are all written).

Then it frees the space, copies the repository to ``OUT/artifacts.git`` (the tmpfs dies with this process) and
prints one JSON line: the error the rollback raised (class, status, message), the heads before and after.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pygit2

from daemon.errors import ReefError
from daemon.releases import ReleaseStore

FILES = {"AGENTS.md": "Be brief.\n"}


def fill(path: Path) -> None:
    """Write ``path`` until the file system has no block left (a real ENOSPC, not a simulated one)."""
    with open(path, "ab", buffering=0) as f:
        for size in (1 << 16, 512, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                pass


def once(cls: type, name: str, before: object) -> None:
    """Run ``before()`` the first time ``cls.name`` is called, then call the real method."""
    real = getattr(cls, name)
    done = []

    def wrapper(self: object, *args: object, **kwargs: object) -> object:
        if not done:
            done.append(True)
            before()  # type: ignore[operator]
        return real(self, *args, **kwargs)

    setattr(cls, name, wrapper)


def main(mode: str, root: Path, out: Path) -> None:
    store = ReleaseStore(root / "artifacts.git")
    r0 = store.publish("demo", FILES, expected_head=None, operation="init", kind="harness", recipe="lessons")
    r1 = store.publish("demo", {"AGENTS.md": "Be briefer.\n"}, expected_head=r0.release_id, operation="train",
                       kind="harness", recipe="lessons")
    filler = root / "fill"
    if mode in ("commit", "commit-then-space"):
        once(pygit2.Repository, "create_commit", lambda: fill(filler))
    if mode == "commit-then-space":
        once(pygit2.Repository, "transaction", lambda: filler.unlink())
    if mode == "ref":
        once(pygit2.Repository, "transaction", lambda: fill(filler))
    error = None
    try:
        store.rollback("demo", r0.release_id, expected_head=r1.release_id)
    except ReefError as e:
        error = {"class": type(e).__name__, "status": e.status, "message": e.message}
    filler.unlink(missing_ok=True)
    after = ReleaseStore(root / "artifacts.git").head("demo")
    shutil.copytree(root / "artifacts.git", out / "artifacts.git", symlinks=True)
    print(json.dumps({"error": error, "before": r1.release_id, "after": after, "init": r0.release_id}))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
