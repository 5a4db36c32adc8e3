"""What a chain remote is trusted with (issue 22): to say which releases exist, never to write outside a follower's
directories, to cost it more than the configured bounds, or to learn its credentials from a command line.

The attacker here controls the remote: crafted releases are written straight into a real bare repository with
pygit2 (raw tree objects, so names libgit2's tree builder would refuse, such as ``..``, are possible), and a real
follower (a store, or a real daemon) fetches them with the git binary.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pygit2
import pytest

import daemon.chain_remote as chain_remote
from daemon.chain_remote import ChainRemote
from daemon.config import load_config
from daemon.errors import RemoteRefused, RemoteReleaseRefused
from daemon.releases import MANIFEST, ReleaseStore, lfs_pointer
from tests.git_servers import GitHttp
from tests.test_chain_remote import bare, remote_head, served_by, with_top_level
from tests.test_chain_transports import _processes_naming
from tests.test_records_pg import _until

HARNESS = {"kind": "harness", "recipe": "lessons"}
SIG = pygit2.Signature("mallory", "mallory@localhost", 1_800_000_000, 0)

Tree = dict[bytes, "bytes | Tree | tuple[int, bytes]"]  # name -> file bytes, subtree, or (mode, bytes)


def raw_tree(repo: pygit2.Repository, entries: Tree) -> pygit2.Oid:
    """Write a tree object byte by byte: no name is checked (git's own tree format allows ``..`` and ``a/b``)."""
    rows = []
    for name, value in entries.items():
        if isinstance(value, dict):
            mode, oid = b"40000", raw_tree(repo, value)
        elif isinstance(value, tuple):
            mode, oid = b"%o" % value[0], repo.create_blob(value[1])
        else:
            mode, oid = b"100644", repo.create_blob(value)
        rows.append((name + (b"/" if mode == b"40000" else b""), mode + b" " + name + b"\0" + oid.raw))
    data = b"".join(row for _, row in sorted(rows))
    return repo.odb.write(pygit2.enums.ObjectType.TREE, data)


def entries_of(repo: pygit2.Repository, tree: pygit2.Tree) -> Tree:
    out: Tree = {}
    for e in tree:
        obj = repo[e.id]
        out[e.name.encode()] = entries_of(repo, obj) if isinstance(obj, pygit2.Tree) else (int(e.filemode), obj.data)
    return out


def craft(remote: Path, scenario: str, extra: Tree | None = None, on: str | None = None, **manifest: Any) -> str:
    """What an attacker with write access to the remote does: a release on top of the scenario's head (or ``on``) with
    ``extra`` entries in its tree and ``manifest`` keys overriding its manifest (``content_id`` defaults to the
    real content tree, so that only the intended defect is there). Returns the crafted release id."""
    repo = pygit2.Repository(str(remote))
    ref = f"refs/reef/scenarios/{scenario}"
    parent = repo[on] if on is not None else repo.references[ref].peel(pygit2.Commit)
    content = {k: v for k, v in entries_of(repo, parent.tree).items() if k != MANIFEST.encode()}
    content.update(extra or {})
    old = json.loads(parent.tree[MANIFEST].data)
    body = {**old, "step": old["step"] + 1, "operation": "train", "parent": str(parent.id),
            "content_id": str(raw_tree(repo, content)), **manifest}
    tree = raw_tree(repo, {**content, MANIFEST.encode(): json.dumps(body).encode()})
    oid = repo.create_commit(None, SIG, SIG, f"crafted step {body['step']}", tree, [parent.id])
    repo.references.create(ref, oid, force=True)
    return str(oid)


def stores(tmp_path: Path, **bounds: int) -> tuple[Path, ReleaseStore, ReleaseStore, str]:
    """A remote, a publisher and a follower (with ``bounds``), and the scenario ``s`` they both have."""
    remote = bare(tmp_path / "r.git")
    a = ReleaseStore(tmp_path / "a.git", remote=ChainRemote(tmp_path / "a.git", str(remote)))
    b = ReleaseStore(tmp_path / "b.git", remote=ChainRemote(tmp_path / "b.git", str(remote), **bounds))
    init = a.publish("s", {"AGENTS.md": "be kind\n"}, expected_head=None, operation="init", **HARNESS).release_id
    assert b.follow() == ["refs/reef/scenarios/s"]
    return remote, a, b, init


# --- path traversal (item 2) ---------------------------------------------------------------------------------

CRAFTED = {
    "content_id is a path": ({}, {"content_id": "../../victim"}),
    "an entry named ..": ({b"..": {b"x": b"outside\n"}}, {}),
    "an entry named ../x": ({b"../x": b"outside\n"}, {}),
    "an absolute entry name": ({b"/tmp/reef-abs-x": b"outside\n"}, {}),
    "a .git directory": ({b".GIT": {b"config": b"[core]\n\tfsmonitor = sh -c id\n"}}, {}),
    "a symlink": ({b"link": (0o120000, b"/etc/passwd")}, {}),
    "an LFS id that is a path": ({}, {"lfs": {"AGENTS.md": {"oid": "sha256:../../../../x", "size": 1}}}),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_release_is_refused_by_name_and_the_follower_keeps_its_head(tmp_path: Path, case: str) -> None:
    remote, _a, b, init = stores(tmp_path)
    extra, manifest = CRAFTED[case]
    crafted = craft(remote, "s", extra, **manifest)
    with pytest.raises(RemoteReleaseRefused) as e:
        b.follow()
    assert crafted in e.value.message and str(remote) in e.value.message, e.value.message
    assert e.value.moved == [] and b.head("s") == init
    with pytest.raises(RemoteReleaseRefused):  # and again at the next follow, from memory
        b.follow()
    out = b.checkout(init, tmp_path / "co")  # what it has still reads
    assert sorted(p.name for p in out.iterdir()) == ["AGENTS.md"]
    assert not (tmp_path / "x").exists() and not Path("/tmp/reef-abs-x").exists()
    assert b.fsck()["ok"]


def test_a_good_release_after_a_refused_one_elsewhere_is_taken_in(tmp_path: Path) -> None:
    """One crafted chain does not stop the others from being followed."""
    remote, a, b, _init = stores(tmp_path)
    other = a.publish("t", {"AGENTS.md": "t\n"}, expected_head=None, operation="init", **HARNESS).release_id
    craft(remote, "s", {b"..": {b"x": b"outside\n"}})
    with pytest.raises(RemoteReleaseRefused) as e:
        b.follow()
    assert e.value.moved == ["refs/reef/scenarios/t"] and b.head("t") == other


def test_a_follower_daemon_keeps_serving_and_its_victim_survives_a_crafted_release(daemon_factory,
                                                                                    tmp_path: Path) -> None:
    """The probe's attack, end to end: a release whose ``content_id`` is ``../../victim`` (the follower's checkout
    directory would be ``$REEF_HOME/victim``, removed as a half-done checkout) and whose tree holds ``..`` entries
    (written above the checkout). The follower refuses it, says so in its status, and serves what it had."""
    remote = bare(tmp_path / "chains.git")
    d = with_top_level(daemon_factory(start=False), f'chain_remote = "{remote}"\nchain_fetch_s = 0.2\n')
    victim = d.home / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine\n")
    escaped = f"escaped-{secrets.token_hex(4)}.txt"
    try:
        with d.http() as c:
            init = served_by(c, "shared")  # a weights release: served from a checkout under cache/releases
            crafted = craft(remote, "shared", {b"..": {b"..": {escaped.encode(): b"outside\n"}}},
                            content_id="../../victim")

            def refused() -> str | None:
                error = c.get("/reef/status").json()["chain_remote"]["error"] or ""
                return error if crafted in error else None

            said = _until("the follower says it refused the release", refused)
            assert str(remote) in said and ("content_id" in said or "holds the entry" in said), said
            assert served_by(c, "shared") == init
            assert c.get("/reef/scenarios/shared/releases").json()["head"] == init
        assert (victim / "keep.txt").read_text() == "mine\n"
        found = [p for p in (d.home, d.home.parent) for p in [p / escaped] if p.exists()]
        found += list((d.home / "cache").rglob(escaped))
        assert found == []
    finally:
        for p in (d.home / escaped, d.home.parent / escaped):
            p.unlink(missing_ok=True)


# --- size bounds (item 8) ------------------------------------------------------------------------------------

@pytest.mark.parametrize("packed", [False, True], ids=["loose", "packed"])
def test_a_git_object_over_the_bound_is_refused_without_being_read_whole(tmp_path: Path, packed: bool) -> None:
    """32 MiB of zeros is a 32 KiB object on the wire; the follower's bound is 1 MiB. It is refused from its header,
    in bounded memory (tracemalloc sees every bytes object Python makes, and libgit2 is never asked to read it)."""
    remote = bare(tmp_path / "r.git")
    a = ReleaseStore(tmp_path / "a.git", lfs_threshold=1 << 30,  # a publisher that keeps big files in git
                     remote=ChainRemote(tmp_path / "a.git", str(remote)))
    b = ReleaseStore(tmp_path / "b.git", remote=ChainRemote(tmp_path / "b.git", str(remote), max_blob_bytes=1 << 20))
    if packed:  # fewer than fetch.unpackLimit objects arrive as loose objects; this follower keeps the pack
        subprocess.run(["git", f"--git-dir={tmp_path / 'b.git'}", "config", "fetch.unpackLimit", "1"], check=True)
    init = a.publish("s", {"AGENTS.md": "x\n"}, expected_head=None, operation="init", **HARNESS).release_id
    b.follow()
    big = a.publish("s", {"big.bin": bytes(32 << 20)}, expected_head=init, operation="train", **HARNESS).release_id
    tracemalloc.start()
    try:
        with pytest.raises(RemoteReleaseRefused) as e:
            b.follow()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert big in e.value.message and "over the bound" in e.value.message and "chain_max_blob_bytes" in e.value.message
    assert peak < 8 << 20, f"{peak} bytes in Python while refusing it"
    assert b.head("s") == init and remote_head(remote, "s") == big


def test_an_lfs_object_over_the_bound_is_refused_before_it_is_copied(tmp_path: Path) -> None:
    remote, a, b, init = stores(tmp_path, max_lfs_bytes=1 << 20)
    weights = os.urandom(3 << 20)  # over the store's 1 MiB LFS threshold: an LFS object
    big = a.publish("s", {"w.bin": weights}, expected_head=init, operation="train", **HARNESS)
    sha = big.lfs["w.bin"]["oid"].split(":")[1]
    with pytest.raises(RemoteReleaseRefused, match="over the bound of 1048576 \\(chain_max_lfs_bytes\\)"):
        b.follow()
    assert not b.lfs_path(sha).exists() and b.head("s") == init
    # an LFS object larger than its manifest says is not copied past the declared size either
    lying = craft(remote, "s", {b"w.bin": lfs_pointer(sha, 1000)}, on=init,
                  lfs={"w.bin": {"oid": f"sha256:{sha}", "size": 1000}})
    with pytest.raises(RemoteRefused, match=f"holds {3 << 20} bytes, not the 1000"):
        b.follow()
    assert not b.lfs_path(sha).exists() and b.head("s") == init and remote_head(remote, "s") == lying


@pytest.mark.parametrize(("toml", "message"), [
    ('chain_remote = "/r.git"\nchain_max_blob_bytes = 0', "chain_max_blob_bytes must be a whole number"),
    ('chain_remote = "/r.git"\nchain_max_lfs_bytes = "1GB"', "chain_max_lfs_bytes must be a whole number"),
    ("chain_max_lfs_bytes = 10", "needs chain_remote"),
])
def test_size_bound_settings(tmp_path: Path, toml: str, message: str) -> None:
    from daemon.errors import BadRequest

    (tmp_path / "config.toml").write_text(toml + "\n")
    with pytest.raises(BadRequest, match=message):
        load_config({"REEF_HOME": str(tmp_path)})
    (tmp_path / "config.toml").write_text('chain_remote = "/r.git"\nchain_max_blob_bytes = 4096\n')
    cfg = load_config({"REEF_HOME": str(tmp_path)})
    assert (cfg.chain_max_blob_bytes, cfg.chain_max_lfs_bytes) == (4096, 64 << 30)


# --- credentials (item 7) ------------------------------------------------------------------------------------

@pytest.fixture
def argvs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list[str]]]:
    """Every command line the chain remote starts."""
    seen: list[list[str]] = []
    real = chain_remote.subprocess.Popen

    def popen(argv: list[str], *args: Any, **kw: Any) -> Any:
        seen.append(list(argv))
        return real(argv, *args, **kw)

    monkeypatch.setattr(chain_remote.subprocess, "Popen", popen)
    yield seen


def test_a_token_in_the_url_is_on_no_command_line_and_in_no_message(tmp_path: Path, argvs: list[list[str]]) -> None:
    token = "tok-" + secrets.token_hex(12)
    bare(tmp_path / "srv" / "chains.git")
    server = GitHttp(tmp_path / "srv", basic_auth=("reef-bot", token))
    found: list[str] = []
    stop = threading.Event()

    def watch() -> None:  # what any local user can read while git runs
        while not stop.is_set():
            found.extend(_processes_naming(token))
            time.sleep(0.001)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        url = server.url("chains.git").replace("://", f"://reef-bot:{token}@")
        a = ReleaseStore(tmp_path / "a.git", remote=ChainRemote(tmp_path / "a.git", url, timeout=30))
        b = ReleaseStore(tmp_path / "b.git", remote=ChainRemote(tmp_path / "b.git", url, timeout=30))
        init = a.publish("s", {"AGENTS.md": "x\n"}, expected_head=None, operation="init", **HARNESS).release_id
        assert b.follow() == ["refs/reef/scenarios/s"] and b.head("s") == init
        assert server.authorized > 0  # the server took the token: it went where it should
        wrong = url.replace(token, token[:-4] + "0000")
        c = ReleaseStore(tmp_path / "c.git", remote=ChainRemote(tmp_path / "c.git", wrong, timeout=30))
        with pytest.raises(RemoteRefused) as e:
            c.follow()
        assert token[:-4] not in e.value.message and "***@" in e.value.message, e.value.message
    finally:
        stop.set()
        watcher.join(10)
        server.close()
    assert argvs and not [argv for argv in argvs if any(token[:-4] in arg for arg in argv)]
    assert found == []
