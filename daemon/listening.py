"""Who the daemon answers: loopback always; other machines only when told, by name, and over TLS.

By default Reef listens on 127.0.0.1 and answers only requests whose ``Host`` header names this machine's loopback
(``localhost``, ``127.x.y.z``, ``[::1]``): a web page cannot reach it by DNS rebinding. To serve other machines
(several daemons' clients, a team's agents), ``config.toml`` says so explicitly::

    host = "0.0.0.0"                         # or one address of this machine
    serve_names = ["reef.lan", "10.0.0.5"]   # the names and addresses clients put in Host (any other: refused)
    tls_cert = "/etc/reef/cert.pem"          # the certificate chain (PEM) and its key: the TCP port speaks TLS
    tls_key = "/etc/reef/key.pem"
    # insecure_http = true                   # instead of TLS: plain HTTP beyond loopback, said at start

Rules, each checked at load (``check``) so that no setting is accepted and ignored:

- ``host`` is loopback only as a literal loopback address or the name ``localhost`` itself (``is_loopback``: names
  are not resolved); ``api.localhost`` or ``ip6-localhost`` is beyond loopback, as any other name.
- ``host`` beyond loopback needs ``tls_cert`` and ``tls_key``, or ``insecure_http = true`` (the token would cross
  the network in clear text: refused unless told plainly). ``insecure_http`` with a loopback host is refused (it
  would do nothing).
- ``host`` beyond loopback needs names to answer: ``serve_names``, or ``host`` itself when it is one address (a
  wildcard ``0.0.0.0`` / ``::`` with no ``serve_names`` would refuse every remote client: refused at start).
- ``serve_names`` are DNS names or IP addresses, without ports; a ``Host`` matches one exactly (case-insensitive,
  any port). Loopback names stay accepted. ``serve_names`` with a loopback host is allowed (a tunnel or reverse
  proxy that keeps the client's ``Host``).
- ``tls_cert`` without ``tls_key`` (or the reverse) is refused; the pair is loaded when the daemon starts, and a
  file that cannot be read or does not match is a one-line start error. TLS may be used on loopback too.
- The Unix sockets (the CLI's and the sandbox's) never use TLS: they do not leave the machine.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daemon.errors import BadRequest, ReefError

if TYPE_CHECKING:
    import ssl

# Host = name [ ":" port ], name a DNS name or dotted quad, or "[" IPv6 "]" (RFC 9110 7.2, RFC 3986 3.2.2): parsed
# strictly as a whole, so nothing can ride along (``localhost:80@evil.com``, ``127.0.0.1.evil.example``)
HOST = re.compile(r"(?:(?P<name>[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?\.?)|\[(?P<ip6>[0-9A-Fa-f:.]+)\])"
                  r"(?::(?P<port>[0-9]{1,5}))?")
# loopback names a Host header may carry (``host_ok``): a page of another site cannot make a browser send them (a
# browser resolves ``.localhost`` to loopback itself), so accepting them opens no DNS rebinding; what may receive a
# key or the token in clear text is narrower (``is_loopback``)
LOOPBACK_NAMES = {"localhost", "ip6-localhost"}
WILDCARDS = {"0.0.0.0", "::", ""}
KEYS = ("serve_names", "tls_cert", "tls_key", "insecure_http")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a listening address, an upstream URL's host) surely means this machine's loopback, so that
    the token or a key may go to it in clear text: a literal loopback address (``127.0.0.0/8``, ``::1``, bracketed
    or not) or the name ``localhost`` exactly. Any other name is beyond loopback, whatever it resolves to now.

    Names are not resolved: a lookup here would be a check of one moment (the resolver may answer differently when
    the connection is made, or at the next start) and a wait on DNS inside config loading, and a hosts entry can send
    ``api.localhost`` or ``ip6-localhost`` anywhere. ``localhost`` is kept because every local server's
    instructions use it and RFC 6761 has resolvers answer it with loopback; nothing else gets that trust."""
    name = host.lower()
    if name == "localhost":
        return True
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _canonical(name: str) -> str | None:
    """A serve_names entry as a Host's name compares: lower case, no trailing dot, IPv6 unbracketed and compressed;
    None when it is neither a DNS name nor an IP address."""
    raw = name.strip()
    try:
        return ipaddress.ip_address(raw.strip("[]")).compressed
    except ValueError:
        pass
    m = HOST.fullmatch(raw)
    if m is None or m["name"] is None or m["port"] is not None:
        return None
    return m["name"].lower().rstrip(".")


def check(values: dict[str, Any], home: Path) -> None:
    """The listening settings of ``load_config``'s ``values``, normalised in place or refused."""
    host = str(values.get("host", "127.0.0.1"))
    names = values.get("serve_names", ())
    if isinstance(names, str) or not isinstance(names, list | tuple):
        raise BadRequest('config: serve_names must be a list of names and addresses, e.g. ["reef.lan", "10.0.0.5"]')
    canonical = []
    for n in names:
        c = _canonical(n) if isinstance(n, str) else None
        if c is None:
            raise BadRequest(f"config: serve_names: {n!r} is not a DNS name or an IP address (no port, no scheme)")
        canonical.append(c)
    values["serve_names"] = tuple(dict.fromkeys(canonical))
    for key in ("tls_cert", "tls_key"):
        if values.get(key) is not None:
            p = Path(str(values[key])).expanduser()
            values[key] = p if p.is_absolute() else home / p
    if (values.get("tls_cert") is None) != (values.get("tls_key") is None):  # pragma: no mutate (bools: is not is !=)
        raise BadRequest("config: tls_cert and tls_key go together (the certificate chain and its private key)")
    insecure = values.get("insecure_http", False)
    if not isinstance(insecure, bool):
        raise BadRequest(f"config: insecure_http must be true or false, got {insecure!r}")
    tls = values.get("tls_cert") is not None
    if is_loopback(host):
        if insecure:
            raise BadRequest(f"config: insecure_http does nothing with host {host!r} (loopback): remove it")
        return
    if not tls and not insecure:
        raise BadRequest(f"config: host {host!r} is beyond loopback: set tls_cert and tls_key (TLS), or "
                         "insecure_http = true to send the token in clear text over the network")
    if host in WILDCARDS and not canonical:
        raise BadRequest(f"config: host {host!r} listens on every address: list the names and addresses clients "
                         "use in serve_names (requests naming any other host are refused)")
    if tls and insecure:
        raise BadRequest("config: insecure_http and tls_cert exclude each other")


def answered_names(host: str, serve_names: Iterable[str]) -> frozenset[str]:
    """The names besides loopback that a ``Host`` header may carry: ``serve_names``, and ``host`` when it is one
    address (what a client of ``http(s)://<host>:<port>`` sends)."""
    names = set(serve_names)
    if host not in WILDCARDS and not is_loopback(host):
        c = _canonical(host)
        if c is not None:
            names.add(c)
    return frozenset(names)


def host_ok(host: str | None, names: frozenset[str]) -> bool:
    """Whether a ``Host`` header is one the daemon answers: loopback, or one of ``names`` (any port)."""
    if not host:
        return False
    m = HOST.fullmatch(host)
    if m is None or (m["port"] is not None and int(m["port"]) > 65535):
        return False
    if m["ip6"] is not None:
        try:
            ip6 = ipaddress.IPv6Address(m["ip6"])
        except ValueError:
            return False
        return ip6.is_loopback or ip6.compressed in names
    name = m["name"].lower().rstrip(".")
    if name in LOOPBACK_NAMES or name.endswith(".localhost") or name in names:
        return True
    try:
        return ipaddress.IPv4Address(name).is_loopback  # 127.0.0.0/8, each part a number up to 255
    except ValueError:
        return False


def tls_context(cert: Path | None, key: Path | None) -> ssl.SSLContext | None:
    """The TCP listener's TLS context (TLS 1.2 or later), or None without a certificate."""
    if cert is None or key is None:
        return None
    import ssl

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise ReefError(f"cannot load tls_cert {cert} and tls_key {key}: {e}") from None
    return ctx
