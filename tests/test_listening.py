"""Who the daemon answers (``daemon/listening.py``) as a unit: what counts as loopback, how ``serve_names`` are
read, every setting refused at load with its reason, which ``Host`` headers are answered, and the TLS context. The
same rules through a real daemon and a second machine are in tests/test_remote_clients.py and
tests/test_hardening.py; these run in milliseconds, so that every mutant of the module meets them
(``bench/mutation.py listening``)."""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path
from typing import Any

import pytest

from daemon.errors import BadRequest, ReefError
from daemon.listening import _canonical, answered_names, check, host_ok, is_loopback, tls_context


@pytest.mark.parametrize("host", ["localhost", "LocalHost", "127.0.0.1", "127.255.255.254", "127.0.0.2", "::1",
                                  "[::1]", "0:0:0:0:0:0:0:1", "[0:0::1]"])
def test_loopback_is_a_literal_loopback_address_or_localhost_itself(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["api.localhost", "ip6-localhost", "evillocalhost", "localhost.", "localhost.evil",
                                  "10.0.0.1", "128.0.0.1", "::2", "[::2]", "0.0.0.0", "::", "", "[localhost]",
                                  "127.0.0.1.evil.example", "::ffff:127.0.0.1",
                                  # a bracket at one end only is no bracketed address (not "127.0.0.1" inside)
                                  "x127.0.0.1]", "[127.0.0.1x", "a::1]", "[::1x"])
def test_everything_else_is_beyond_loopback(host: str) -> None:
    assert not is_loopback(host)


@pytest.mark.parametrize(("name", "canonical"), [
    ("Reef.LAN", "reef.lan"), ("reef.lan.", "reef.lan"), (" 10.0.0.5 ", "10.0.0.5"), ("[::1]", "::1"),
    ("2001:DB8:0:0::1", "2001:db8::1"), ("[2001:db8::1]", "2001:db8::1"), ("a", "a"), ("x-1.example", "x-1.example"),
])
def test_serve_names_are_compared_in_one_spelling(name: str, canonical: str) -> None:
    assert _canonical(name) == canonical


@pytest.mark.parametrize("name", ["reef.lan:443", "10.0.0.5:80", "http://reef.lan", "-bad.lan", "a_b",
                                  "", "reef lan", "[reef.lan]", "user@reef.lan"])
def test_what_is_not_a_name_or_an_address_is_not_a_serve_name(name: str) -> None:
    assert _canonical(name) is None


def checked(tmp_path: Path, **values: Any) -> dict[str, Any]:
    check(values, tmp_path)
    return values


def refused(tmp_path: Path, **values: Any) -> str:
    with pytest.raises(BadRequest) as e:
        check(values, tmp_path)
    return e.value.message


def test_the_default_is_loopback_with_nothing_else(tmp_path: Path) -> None:
    assert checked(tmp_path) == {"serve_names": ()}
    assert checked(tmp_path, host="localhost", insecure_http=False) == {
        "host": "localhost", "insecure_http": False, "serve_names": ()}


def test_serve_names_are_normalised_and_deduplicated_in_order(tmp_path: Path) -> None:
    got = checked(tmp_path, serve_names=["Reef.lan", "10.0.0.5", "reef.LAN.", "[::1]"])
    assert got["serve_names"] == ("reef.lan", "10.0.0.5", "::1")
    assert checked(tmp_path, serve_names=("a.lan",))["serve_names"] == ("a.lan",)


@pytest.mark.parametrize(("names", "says"), [
    ("reef.lan", "serve_names must be a list of names and addresses"),
    ({"reef.lan": 1}, "serve_names must be a list"),
    (["reef.lan:80"], "serve_names: 'reef.lan:80' is not a DNS name or an IP address"),
    ([5], "serve_names: 5 is not a DNS name"),
])
def test_serve_names_that_are_not_a_list_of_names_are_refused(tmp_path: Path, names: Any, says: str) -> None:
    assert says in refused(tmp_path, serve_names=names)


def test_tls_files_are_read_relative_to_the_home(tmp_path: Path) -> None:
    got = checked(tmp_path, tls_cert="cert.pem", tls_key="/etc/reef/key.pem")
    assert got["tls_cert"] == tmp_path / "cert.pem" and got["tls_key"] == Path("/etc/reef/key.pem")
    home = checked(tmp_path, tls_cert="~/c.pem", tls_key="k.pem")
    assert home["tls_cert"] == Path("~/c.pem").expanduser() and home["tls_key"] == tmp_path / "k.pem"


@pytest.mark.parametrize(("values", "says"), [
    ({"tls_cert": "c.pem"}, "tls_cert and tls_key go together"),
    ({"tls_key": "k.pem"}, "tls_cert and tls_key go together"),
    ({"insecure_http": "yes"}, "insecure_http must be true or false, got 'yes'"),
    ({"insecure_http": 1}, "insecure_http must be true or false, got 1"),
    ({"insecure_http": True}, "insecure_http does nothing with host '127.0.0.1' (loopback): remove it"),
    ({"host": "localhost", "insecure_http": True}, "insecure_http does nothing with host 'localhost'"),
    ({"host": "10.0.0.5"}, "host '10.0.0.5' is beyond loopback: set tls_cert and tls_key (TLS), or insecure_http"),
    ({"host": "api.localhost"}, "host 'api.localhost' is beyond loopback"),
    ({"host": "evillocalhost"}, "host 'evillocalhost' is beyond loopback"),  # a name that ends like localhost
    ({"host": "localhost.evil.example"}, "host 'localhost.evil.example' is beyond loopback"),
    ({"host": "0.0.0.0", "insecure_http": True}, "host '0.0.0.0' listens on every address: list the names"),
    ({"host": "::", "tls_cert": "c", "tls_key": "k"}, "host '::' listens on every address"),
    ({"host": "", "insecure_http": True}, "host '' listens on every address"),
    ({"host": "10.0.0.5", "insecure_http": True, "tls_cert": "c", "tls_key": "k"},
     "insecure_http and tls_cert exclude each other"),
])
def test_settings_that_do_nothing_or_leak_the_token_are_refused_by_reason(tmp_path: Path, values: dict[str, Any],
                                                                        says: str) -> None:
    assert says in refused(tmp_path, **values)


@pytest.mark.parametrize("values", [
    {"host": "10.0.0.5", "insecure_http": True},  # one address: its own name is answered
    {"host": "10.0.0.5", "tls_cert": "c", "tls_key": "k"},
    {"host": "0.0.0.0", "insecure_http": True, "serve_names": ["reef.lan"]},
    {"host": "::", "tls_cert": "c", "tls_key": "k", "serve_names": ["10.0.0.5"]},
    {"host": "127.0.0.1", "tls_cert": "c", "tls_key": "k"},  # TLS on loopback too
    {"host": "127.0.0.1", "serve_names": ["reef.lan"]},  # a tunnel that keeps the client's Host
])
def test_settings_that_serve_as_told_are_taken(tmp_path: Path, values: dict[str, Any]) -> None:
    checked(tmp_path, **values)


def test_the_names_answered_besides_loopback() -> None:
    assert answered_names("10.0.0.5", ["reef.lan"]) == {"10.0.0.5", "reef.lan"}
    assert answered_names("Reef.LAN", []) == {"reef.lan"}  # a single name host, in its canonical spelling
    assert answered_names("[2001:db8::1]", []) == {"2001:db8::1"}
    for host in ("0.0.0.0", "::", "", "127.0.0.1", "localhost", "::1"):
        assert answered_names(host, ["reef.lan"]) == {"reef.lan"}, host
    assert answered_names("reef.lan:80", ["x.lan"]) == {"x.lan"}  # not a name: nothing added


NAMES = frozenset({"reef.lan", "10.0.0.5", "2001:db8::1"})


@pytest.mark.parametrize("host", [
    "localhost", "LOCALHOST:8900", "localhost.", "ip6-localhost", "api.localhost", "a.b.localhost:1",
    "127.0.0.1", "127.0.0.1:65535", "127.1.2.3:80", "[::1]", "[::1]:8900", "[0:0::1]",
    "reef.lan", "REEF.LAN:443", "reef.lan.", "10.0.0.5:8900", "[2001:DB8::0:1]", "[2001:db8::1]:443",
])
def test_hosts_answered(host: str) -> None:
    assert host_ok(host, NAMES)


@pytest.mark.parametrize("host", [
    None, "", "evillocalhost", "localhostx", "localhost.evil", "127.0.0.1.evil.example", "localhost:80@evil.com",
    "127.0.0.1:65536", "127.0.0.1:99999", "localhost:", "256.0.0.1", "128.0.0.1", "10.0.0.6", "evil.reef.lan",
    "reef.lan.evil", "[::2]", "[::1", "::1", "[zz::1]", "[2001:db8::2]", "reef.lan:80:80", " localhost",
    "127.0.0.1 ", "-localhost",
    "[1:2:3]", "[::1::]", "[1.2.3.4]",  # bracketed, but no IPv6 address: refused, never taken for one
])
def test_hosts_refused(host: str | None) -> None:
    assert not host_ok(host, NAMES)


def test_named_hosts_need_names() -> None:
    assert not host_ok("reef.lan", frozenset()) and not host_ok("[2001:db8::1]", frozenset())
    assert host_ok("localhost", frozenset())


def test_the_tls_context_loads_the_pair_or_says_why_not(tmp_path: Path) -> None:
    assert tls_context(None, None) is None
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "1", "-subj", "/CN=reef.test", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    assert tls_context(cert, None) is None and tls_context(None, key) is None
    ctx = tls_context(cert, key)
    assert isinstance(ctx, ssl.SSLContext) and ctx.minimum_version == ssl.TLSVersion.TLSv1_2
    with pytest.raises(ReefError, match=f"cannot load tls_cert {cert} and tls_key {tmp_path / 'nope.pem'}"):
        tls_context(cert, tmp_path / "nope.pem")
    with pytest.raises(ReefError, match="cannot load tls_cert"):
        tls_context(key, cert)  # swapped
