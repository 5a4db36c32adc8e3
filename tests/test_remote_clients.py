"""Serving other machines (daemon/listening.py): only when told, by name, over TLS or plain HTTP said plainly.

The other machine is a second network namespace joined to this one by a veth pair (a private link; nothing leaves
the machine): its clients reach the daemon at the link's address, as a machine on a LAN would. Needs root and
iproute2 (install.sh --dev installs it). Certificates are made here with openssl, for the link's address."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.config import load_config
from daemon.errors import BadRequest
from tests.conftest import Daemon, make_home


class Link:
    """A network namespace and a veth pair: this side ``here``, the namespace's side ``there``."""

    def __init__(self) -> None:
        for stale in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split():
            # a run that was killed leaves its namespace and link: cleared when their process is gone
            if stale.startswith("reef-t") and stale[6:].isdigit() and not Path(f"/proc/{stale[6:]}").exists():
                subprocess.run(["ip", "link", "del", f"rt{stale[6:]}a"], capture_output=True)
                subprocess.run(["ip", "netns", "del", stale], capture_output=True)
        n = os.getpid() % 200 + 20
        self.ns, self.dev = f"reef-t{os.getpid()}", f"rt{os.getpid()}"
        self.here, self.there = f"10.231.{n}.1", f"10.231.{n}.2"
        for cmd in (f"ip netns add {self.ns}", f"ip link add {self.dev}a type veth peer name {self.dev}b",
                    f"ip link set {self.dev}b netns {self.ns}", f"ip addr add {self.here}/30 dev {self.dev}a",
                    f"ip link set {self.dev}a up", f"ip -n {self.ns} addr add {self.there}/30 dev {self.dev}b",
                    f"ip -n {self.ns} link set {self.dev}b up", f"ip -n {self.ns} link set lo up"):
            subprocess.run(cmd.split(), check=True, capture_output=True)

    def run(self, script: str, **values: Any) -> dict[str, Any]:
        """Run a Python client in the other namespace; it prints one JSON object."""
        code = "import json, sys\nvalues = json.loads(sys.argv[1])\n" + textwrap.dedent(script)
        out = subprocess.run(["ip", "netns", "exec", self.ns, sys.executable, "-c", code, json.dumps(values)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", f"{self.dev}a"], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)


@pytest.fixture(scope="module")
def link() -> Iterator[Link]:
    made = Link()
    yield made
    made.close()


def make_cert(where: Path, address: str) -> tuple[Path, Path]:
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "1", "-subj", "/CN=reef.test", "-addext",
                    f"subjectAltName=DNS:reef.test,IP:{address}", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


def remote_daemon(tiny_model: Path, top: str) -> Daemon:
    """A daemon whose config.toml starts with ``top`` (the listening keys)."""
    home, port, env = make_home(tiny_model)
    (home / "config.toml").write_text(top + (home / "config.toml").read_text())
    return Daemon(home=home, port=port, env=env)


CLIENT = """
import httpx, openai
url, token, ca = values["url"], values["token"], values.get("ca")
out = {}
verify = ca if ca else False
with httpx.Client(verify=verify, timeout=30) as c:
    for name, host in values.get("hosts", {}).items():
        r = c.get(url + "/reef/status", headers={"Authorization": "Bearer " + token, "Host": host})
        out[name] = [r.status_code, r.json().get("error", {}).get("type") if r.status_code >= 400 else None]
    r = c.get(url + "/reef/status")
    out["no_token"] = r.status_code
host = {"Host": values["sdk_host"]} if values.get("sdk_host") else {}  # a name the client's resolver would give
sdk = openai.OpenAI(base_url=url + "/v1", api_key=token, http_client=httpx.Client(verify=verify, headers=host),
                    max_retries=0)
resp = sdk.chat.completions.with_raw_response.create(model="tiny", max_tokens=2,
                                                     messages=[{"role": "user", "content": "hi"}])
out["receipt"] = resp.headers.get("x-reef-agent-record-id")
if values.get("plain_url"):
    try:
        httpx.get(values["plain_url"] + "/healthz", timeout=10)
        out["plain"] = "answered"
    except httpx.HTTPError as e:
        out["plain"] = type(e).__name__
if ca:
    try:
        httpx.get(url + "/healthz", timeout=10)  # the system's trust store: the daemon's own certificate is not in it
        out["unverified"] = "answered"
    except httpx.HTTPError as e:
        out["unverified"] = type(e).__name__
print(json.dumps(out))
"""


def test_a_machine_on_the_link_is_served_over_tls_by_the_listed_names_only(link: Link, tiny_model: Path) -> None:
    """Catches: TLS configured and not applied (plain HTTP answered), the served names not read (remote Host
    refused) or read too loosely (look-alikes accepted), the token not required beyond loopback."""
    certs = Path(tempfile.mkdtemp(prefix="reef-tls-"))
    cert, key = make_cert(certs, link.here)
    d = remote_daemon(tiny_model, f'host = "{link.here}"\nserve_names = ["reef.test"]\n'
                                  f'tls_cert = "{cert}"\ntls_key = "{key}"\n')
    try:
        d.start()
        assert f"reef serving on https://{link.here}:{d.port}" in d.log_tail(), d.log_tail()
        got = link.run(CLIENT, url=f"https://{link.here}:{d.port}", token=d.token, ca=str(cert),
                       plain_url=f"http://{link.here}:{d.port}",
                       hosts={"address": f"{link.here}:{d.port}", "named": "reef.test", "named_port": "REEF.test:1",
                              "look_alike": "reef.test.evil.example", "other": "evil.example",
                              "prefix": "xreef.test"})
        assert got["address"] == [200, None] and got["named"] == [200, None] and got["named_port"] == [200, None]
        for name in ("look_alike", "other", "prefix"):
            assert got[name] == [400, "invalid_request_error"], (name, got)
        assert got["no_token"] == 401
        assert got["receipt"] and got["receipt"].startswith("rec_"), got  # the official SDK, served and recorded
        assert got["plain"] != "answered" and got["unverified"] != "answered", got
        with d.unix() as c:  # the local CLI's socket is as before
            assert c.get(f"/reef/records/{got['receipt']}").status_code == 200
    finally:
        d.stop()
        shutil.rmtree(d.home, ignore_errors=True)
        shutil.rmtree(certs, ignore_errors=True)


def test_plain_http_beyond_loopback_only_when_told_and_a_wildcard_answers_only_its_names(
        link: Link, tiny_model: Path) -> None:
    d = remote_daemon(tiny_model, 'host = "0.0.0.0"\nserve_names = ["reef.test"]\ninsecure_http = true\n')
    try:
        d.start()
        assert "over plain HTTP (insecure_http = true)" in d.log_tail(), d.log_tail()
        got = link.run(CLIENT, url=f"http://{link.here}:{d.port}", token=d.token,
                       hosts={"named": f"reef.test:{d.port}", "address": f"{link.here}:{d.port}"},
                       sdk_host=f"reef.test:{d.port}")
        assert got["named"] == [200, None], got
        assert got["address"] == [400, "invalid_request_error"], got  # a wildcard listens everywhere, answers names
        assert got["receipt"], got
    finally:
        d.stop()
        shutil.rmtree(d.home, ignore_errors=True)


def test_the_default_daemon_cannot_be_reached_from_another_machine(link: Link, daemon: Daemon) -> None:
    got = link.run("""
import httpx
try:
    httpx.get(values["url"] + "/healthz", timeout=5)
    print(json.dumps({"reached": True}))
except httpx.HTTPError as e:
    print(json.dumps({"reached": False, "error": type(e).__name__}))
""", url=f"http://{link.here}:{daemon.port}")
    assert got == {"reached": False, "error": "ConnectError"}, got


@pytest.mark.parametrize(("top", "says"), [
    ('host = "0.0.0.0"\nserve_names = ["reef.test"]\n', "tls_cert and tls_key"),
    ('host = "10.9.9.9"\n', "insecure_http = true"),
    ('insecure_http = true\n', "does nothing with host '127.0.0.1'"),
    ('tls_cert = "cert.pem"\n', "tls_cert and tls_key go together"),
    ('host = "0.0.0.0"\ntls_cert = "c.pem"\ntls_key = "k.pem"\n', "list the names and addresses"),
    ('serve_names = ["reef.test:8900"]\n', "is not a DNS name or an IP address"),
    ('serve_names = ["https://reef.test"]\n', "is not a DNS name or an IP address"),
    ('serve_names = "reef.test"\n', "must be a list"),
    ('serve_names = { "reef.test" = true }\n', "must be a list"),  # a table: its keys are no list of names
    ('host = "10.9.9.9"\ninsecure_http = "yes"\n', "insecure_http must be true or false"),
    # names are not resolved: only literal loopback addresses and "localhost" itself are loopback (a suffix test
    # without the dot took "evillocalhost" for loopback; a hosts entry can send "api.localhost" anywhere)
    ('host = "evillocalhost"\n', "host 'evillocalhost' is beyond loopback"),
    ('host = "api.localhost"\n', "host 'api.localhost' is beyond loopback"),
    ('host = "ip6-localhost"\n', "host 'ip6-localhost' is beyond loopback"),
    ('host = "localhost"\ninsecure_http = true\n', "does nothing with host 'localhost'"),
    ('host = "127.5.5.5"\ninsecure_http = true\n', "does nothing with host '127.5.5.5'"),
    ('host = "::1"\ninsecure_http = true\n', "does nothing with host '::1'"),
])
def test_settings_that_would_do_nothing_or_leak_the_token_are_refused(tmp_path: Path, top: str, says: str) -> None:
    (tmp_path / "config.toml").write_text(top)
    with pytest.raises(BadRequest) as e:
        load_config({"REEF_HOME": str(tmp_path)})
    assert says in str(e.value), str(e.value)


@pytest.mark.parametrize(("top", "host", "names", "tls", "insecure"), [
    ('host = "10.9.9.9"\ninsecure_http = true\n', "10.9.9.9", (), False, True),  # one address: its own name
    ('host = "10.9.9.9"\ntls_cert = "c.pem"\ntls_key = "k.pem"\n', "10.9.9.9", (), True, False),
    ('host = "0.0.0.0"\nserve_names = ["Reef.LAN.", "[fd00::5]"]\ntls_cert = "c.pem"\ntls_key = "k.pem"\n',
     "0.0.0.0", ("reef.lan", "fd00::5"), True, False),
    ('host = "api.localhost"\ninsecure_http = true\n', "api.localhost", (), False, True),  # a name: beyond loopback
    ('host = "localhost"\nserve_names = ["reef.test"]\n', "localhost", ("reef.test",), False, False),  # a proxy
])
def test_settings_that_serve_other_machines_as_told_are_taken(tmp_path: Path, top: str, host: str,
                                                              names: tuple[str, ...], tls: bool, insecure: bool) -> None:
    (tmp_path / "config.toml").write_text(top)
    cfg = load_config({"REEF_HOME": str(tmp_path)})
    assert (cfg.host, cfg.serve_names, cfg.tls_cert is not None, cfg.insecure_http) == (host, names, tls, insecure)
    if tls:
        assert cfg.tls_cert == tmp_path / "c.pem" and cfg.tls_key == tmp_path / "k.pem"  # relative to the home


def test_a_certificate_that_does_not_load_stops_the_start_with_one_line(tiny_model: Path) -> None:
    certs = Path(tempfile.mkdtemp(prefix="reef-tls-"))
    (certs / "cert.pem").write_text("not a certificate\n")
    (certs / "key.pem").write_text("not a key\n")
    home, port, env = make_home(tiny_model)
    (home / "config.toml").write_text(f'tls_cert = "{certs}/cert.pem"\ntls_key = "{certs}/key.pem"\n'
                                      + (home / "config.toml").read_text())
    try:
        out = subprocess.run([sys.executable, "-m", "daemon"], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode != 0
        assert f"cannot load tls_cert {certs}/cert.pem" in out.stderr, out.stderr[-2000:]
        assert "Traceback" not in out.stderr, out.stderr[-2000:]
    finally:
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(certs, ignore_errors=True)

