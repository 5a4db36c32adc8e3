"""The chain remote over each URL scheme a team's git host speaks, for real on 127.0.0.1 (paths and ``git://`` are
in test_chain_remote.py), with the servers those hosts run (``tests/git_servers.py``):

- http://: ``git http-backend``. Two daemons: a publish on one is served by the other (weights through the shared
  ``chain_lfs`` directory); a push the server refuses (401 asking for credentials, 403) publishes nothing, says
  why, and does not wait for a password nobody types; a fetch that fails is shown in the follower's status while
  it serves on.
- https://: the same with a self-signed certificate the client is set up to trust (git's ``http.sslCAInfo``), and
  refused, naming the certificate, where it is not.
- ssh://: OpenSSH's sshd; the key and host key come from git's ``core.sshCommand`` or ``GIT_SSH_COMMAND``, as a
  user sets them up. A key the server does not accept, or a host key nobody has checked, is a refusal, not a prompt.
- A remote that never answers is refused after the timeout, and leaves no transport process behind.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.chain_remote import ChainRemote
from daemon.errors import HeadMoved, RemoteRefused
from daemon.releases import ReleaseStore, files_from_dir
from tests.conftest import assert_canonical_error
from tests.git_servers import GitHttp, Sshd, self_signed
from tests.test_chain_remote import bare, remote_head, served_by, wait_served, with_top_level
from tests.test_records_pg import _until
from tests.test_release_serving import make_weights

HARNESS = {"operation": "train", "kind": "harness", "recipe": "lessons"}


@pytest.fixture
def git_http(tmp_path: Path) -> Iterator[GitHttp]:
    bare(tmp_path / "srv" / "chains.git")
    server = GitHttp(tmp_path / "srv")
    yield server
    server.close()


def store(path: Path, url: str, **git_config: str) -> ReleaseStore:
    """A release store pushing to ``url``, with ``git_config`` set in its repository's config (as a user would set
    it in ~/.gitconfig for the daemon's account)."""
    s = ReleaseStore(path, remote=ChainRemote(path, url, timeout=30))
    for key, value in git_config.items():
        subprocess.run(["git", f"--git-dir={path}", "config", key, value], check=True)
    return s


def askpass(tmp_path: Path) -> dict[str, str]:
    """The environment of a desktop session whose askpass program answers every question: it writes the question
    down in ``asked`` and says yes. A prompt Reef let through shows up there (and would wait for a person)."""
    script = tmp_path / "askpass"
    script.write_text(f'#!/bin/sh\necho "$1" >> {tmp_path / "asked"}\necho yes\n')
    script.chmod(0o755)
    return {"SSH_ASKPASS": str(script), "SSH_ASKPASS_REQUIRE": "force", "DISPLAY": ":0"}


def init(s: ReleaseStore, scenario: str) -> str:
    return s.publish(scenario, {"f.txt": "0"}, expected_head=None, operation="init", kind="harness",
                     recipe="lessons").release_id


def test_http_remote_serves_a_publish_on_the_other_daemon_and_a_refused_push_publishes_nothing(
        daemon_factory, git_http: GitHttp, tiny_model: Path, tmp_path: Path) -> None:
    url, lfs, remote = git_http.url("chains.git"), tmp_path / "lfs", tmp_path / "srv" / "chains.git"
    lfs.mkdir()
    config = f'chain_remote = "{url}"\nchain_lfs = "{lfs}"\nchain_fetch_s = 0.5\n'  # a fetch: 2-3 CGI runs
    a, b = daemon_factory(start=False), daemon_factory(start=False)
    a.env.update(askpass(tmp_path))
    a, b = with_top_level(a, config), with_top_level(b, config)
    with a.http() as ca, b.http() as cb:
        first = served_by(ca, "web")
        assert remote_head(remote, "web") == first and served_by(cb, "web") == first
        path = a.home / "artifacts.git"  # a trainer on A publishes into A's store, which pushes over http
        pushed = ReleaseStore(path, remote=ChainRemote(path, url, lfs_store=lfs))
        new = pushed.publish("web", files_from_dir(make_weights(tiny_model, tmp_path / "w1", seed=1)),
                             expected_head=first, operation="train", kind="weights", recipe="record").release_id
        wait_served(cb, "web", new)
        sha = pushed.get(new).lfs["model.safetensors"]["oid"].split(":")[1]
        assert (lfs / sha[:2] / sha[2:4] / sha).exists()  # the weights went through the shared LFS directory
        assert ReleaseStore(b.home / "artifacts.git").lfs_path(sha).exists()
        assert any(r.startswith("POST /chains.git/git-receive-pack") for r in git_http.seen)  # smart HTTP, for real

        for status, says in ((401, "Authentication failed"), (403, "error: 403")):
            git_http.refuse_push = status
            resp = ca.post("/reef/scenarios/web/rollback", json={"release_id": first, "expected_head": new})
            err = assert_canonical_error(resp, 502)
            assert err["type"] == "remote_error" and says in err["message"] and url in err["message"], err
            assert remote_head(remote, "web") == new
            assert ca.get("/reef/scenarios/web/releases").json()["head"] == new
            assert served_by(ca, "web") == new and served_by(cb, "web") == new
        assert not (tmp_path / "asked").exists()  # git asked nobody for a user name or a password
        git_http.refuse_push = None
        remote.rename(remote.with_name("gone.git"))  # the server loses the repository: B cannot fetch
        said = _until("B says it cannot fetch", lambda: cb.get("/reef/status").json()["chain_remote"]["error"])
        assert "not found" in said and url in said, said
        assert served_by(cb, "web") == new  # and serves on from its own store
        remote.with_name("gone.git").rename(remote)
        rolled = ca.post("/reef/scenarios/web/rollback", json={"release_id": first, "expected_head": new})
        assert rolled.status_code == 201, rolled.text
        wait_served(cb, "web", rolled.json()["release_id"])
        assert cb.get("/reef/status").json()["chain_remote"]["error"] is None


def test_https_remote_with_a_certificate_the_client_trusts(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    bare(tmp_path / "srv" / "chains.git")
    server = GitHttp(tmp_path / "srv", tls=(cert, key))
    try:
        url = server.url("chains.git")
        a = store(tmp_path / "a.git", url, **{"http.sslCAInfo": str(cert)})
        b = store(tmp_path / "b.git", url, **{"http.sslCAInfo": str(cert)})
        head = init(a, "tls")
        assert b.follow() == ["refs/reef/scenarios/tls"] and b.read_file(head, "f.txt") == b"0"
        won = b.publish("tls", {"f.txt": "b"}, expected_head=head, **HARNESS)
        with pytest.raises(HeadMoved) as moved:  # compare-and-swap against the remote's ref, over https too
            a.publish("tls", {"f.txt": "a"}, expected_head=head, **HARNESS)
        assert moved.value.actual == won.release_id
        stranger = store(tmp_path / "c.git", url)  # nobody told this one to trust the certificate
        with pytest.raises(RemoteRefused, match="certificate"):
            init(stranger, "tls")
        assert stranger.head("tls") is None
    finally:
        server.close()


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[Sshd]:
    server = Sshd(tmp_path / "ssh")
    yield server
    server.close()


def test_ssh_remote_uses_the_ssh_git_is_set_up_with(sshd: Sshd, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    remote = bare(tmp_path / "chains.git")
    url = sshd.url(remote)
    a = store(tmp_path / "a.git", url, **{"core.sshCommand": sshd.ssh_command()})
    b = store(tmp_path / "b.git", url, **{"core.sshCommand": sshd.ssh_command()})
    head = init(a, "ssh")
    assert remote_head(remote, "ssh") == head
    assert b.follow() == ["refs/reef/scenarios/ssh"] and b.read_file(head, "f.txt") == b"0"
    won = b.publish("ssh", {"f.txt": "b"}, expected_head=head, **HARNESS)
    with pytest.raises(HeadMoved) as moved:
        a.publish("ssh", {"f.txt": "a"}, expected_head=head, **HARNESS)
    assert moved.value.actual == won.release_id and a.head("ssh") == won.release_id

    wrong_key = store(tmp_path / "c.git", url, **{"core.sshCommand": sshd.ssh_command(sshd.other_key)})
    with pytest.raises(RemoteRefused, match=r"Permission denied \(publickey\)"):
        init(wrong_key, "other")
    unknown = tmp_path / "empty_known_hosts"
    unknown.touch()  # a host key nobody has checked: ssh would ask whether to trust it; BatchMode refuses instead
    unchecked = store(tmp_path / "d.git", url, **{"core.sshCommand": f"ssh -F /dev/null -i {sshd.key} "
                                                  f"-o UserKnownHostsFile={unknown} -o StrictHostKeyChecking=ask"})
    for name, value in askpass(tmp_path).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RemoteRefused, match="Host key verification failed"):
        init(unchecked, "other")
    assert not (tmp_path / "asked").exists() and remote_head(remote, "other") is None

    monkeypatch.setenv("GIT_SSH_COMMAND", sshd.ssh_command())  # the environment's choice, as git itself takes it
    env_set = store(tmp_path / "e.git", url)
    assert env_set.follow() == ["refs/reef/scenarios/ssh"] and env_set.head("ssh") == won.release_id


def _processes_naming(text: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{pid}: {cmdline}")
    return found


def test_a_remote_that_never_answers_is_refused_after_the_timeout_leaving_no_git_behind(tmp_path: Path) -> None:
    with socket.socket() as silent:  # connections are taken (the kernel's backlog) and never answered
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/chains.git"
        s = ReleaseStore(tmp_path / "a.git", remote=ChainRemote(tmp_path / "a.git", url, timeout=1))
        with pytest.raises(RemoteRefused, match="did not finish in 1 s"):
            init(s, "silent")
        assert s.head("silent") is None
        # the transport helper git started (git-remote-http) died with it, rather than waiting on the socket
        assert _processes_naming(url) == []
