"""Git servers on 127.0.0.1 for the chain-remote tests, each the real program a team's git host runs:

- ``GitHttp``: git's smart HTTP, ``git http-backend`` (git's own CGI program, what runs behind Apache or nginx)
  behind a threaded ``http.server``, optionally over TLS, optionally refusing pushes (401 asking for credentials,
  or 403) as a hosted remote does for a missing or read-only token.
- ``Sshd``: OpenSSH's ``sshd`` (Debian's openssh-server) as the test's own user on a free port, with a generated
  host key and one authorized key; ``ssh_command`` is how a client is set up to use them.
"""

from __future__ import annotations

import base64
import http.server
import os
import pwd
import shutil
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

HANG_GUARD_S = 30


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":  # git sends large packs chunked
            parts = []
            while size := int(self.rfile.readline().split(b";")[0], 16):
                parts.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                pass
            return b"".join(parts)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _serve(self) -> None:
        url = urlsplit(self.path)
        body = self._body()
        push = "git-receive-pack" in url.path or "service=git-receive-pack" in url.query
        self.server.seen.append(f"{self.command} {self.path}")
        if self.server.basic_auth is not None:  # a hosted remote's token: every request, fetch or push
            wanted = "Basic " + base64.b64encode(":".join(self.server.basic_auth).encode()).decode()
            if self.headers.get("Authorization") != wanted:
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Basic realm="reef-chains"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.server.authorized += 1
        if push and self.server.refuse_push:
            self.send_response(self.server.refuse_push)
            if self.server.refuse_push == 401:
                self.send_header("WWW-Authenticate", 'Basic realm="reef-chains"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin", "GIT_PROJECT_ROOT": str(self.server.root),
            "GIT_HTTP_EXPORT_ALL": "1", "REMOTE_USER": "reef", "REMOTE_ADDR": "127.0.0.1",
            "REQUEST_METHOD": self.command, "PATH_INFO": url.path, "QUERY_STRING": url.query,
            "CONTENT_TYPE": self.headers.get("Content-Type", ""), "CONTENT_LENGTH": str(len(body)),
            "HTTP_CONTENT_ENCODING": self.headers.get("Content-Encoding", ""),
            "GIT_PROTOCOL": self.headers.get("Git-Protocol", ""),
        }
        proc = subprocess.run(["git", "http-backend"], input=body, env=env, capture_output=True, timeout=60)
        head, _, out = proc.stdout.partition(b"\r\n\r\n")
        status, headers = 200, []
        for line in head.decode("latin-1").split("\r\n"):
            name, _, value = line.partition(":")
            if name.lower() == "status":
                status = int(value.split()[0])
            elif name:
                headers.append((name, value.strip()))
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    root: Path
    refuse_push: int | None
    seen: list[str]
    basic_auth: tuple[str, str] | None
    authorized: int


class GitHttp:
    """Serves the bare repositories under ``root`` at ``url(name)``; ``tls``: (certificate, key) files for https.
    Set ``refuse_push`` to 401 or 403 to refuse pushes (fetches still work); ``seen`` lists the requests.
    ``basic_auth``: (user, password) every request must carry (HTTP basic, as a hosted remote's token);
    ``authorized`` counts the requests that did."""

    def __init__(self, root: Path, *, tls: tuple[Path, Path] | None = None,
                 basic_auth: tuple[str, str] | None = None) -> None:
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.root, self._server.refuse_push, self._server.seen = root, None, []
        self._server.basic_auth, self._server.authorized = basic_auth, 0
        self.scheme = "http"
        if tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(str(tls[0]), str(tls[1]))
            self._server.socket = ctx.wrap_socket(self._server.socket, server_side=True)
            self.scheme = "https"
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def refuse_push(self) -> int | None:
        return self._server.refuse_push

    @refuse_push.setter
    def refuse_push(self, status: int | None) -> None:
        self._server.refuse_push = status

    @property
    def seen(self) -> list[str]:
        return self._server.seen

    @property
    def authorized(self) -> int:
        return self._server.authorized

    def url(self, name: str) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}/{name}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (and its key), made with the openssl binary; it is its own CA."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


class Sshd:
    """``sshd -D`` on 127.0.0.1 with its files under ``directory``: it accepts ``key`` (and no password, no other
    key); ``other_key`` is a key it does not accept. Logs in as the user running the tests."""

    def __init__(self, directory: Path) -> None:
        binary = shutil.which("sshd") or "/usr/sbin/sshd"
        if not os.access(binary, os.X_OK):
            raise RuntimeError("sshd is not installed (Debian: apt-get install openssh-server; install.sh --dev)")
        directory.mkdir(parents=True, exist_ok=True)
        self.dir = directory
        self.host_key, self.key, self.other_key = (directory / n for n in ("host_key", "key", "other_key"))
        for k in (self.host_key, self.key, self.other_key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "reef-test", "-f", str(k)],
                           check=True, capture_output=True, timeout=30)
        (directory / "authorized_keys").write_text(Path(f"{self.key}.pub").read_text())
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.known_hosts = directory / "known_hosts"
        self.known_hosts.write_text(f"[127.0.0.1]:{self.port} {Path(f'{self.host_key}.pub').read_text()}")
        config = directory / "sshd_config"
        config.write_text("\n".join([
            f"Port {self.port}", "ListenAddress 127.0.0.1", f"HostKey {self.host_key}",
            f"AuthorizedKeysFile {directory / 'authorized_keys'}", "PidFile none",
            "StrictModes no",  # the files live under /tmp, which is world-writable
            "UsePAM no", "PasswordAuthentication no", "KbdInteractiveAuthentication no", "PubkeyAuthentication yes",
            "PermitRootLogin prohibit-password", "LogLevel ERROR", "",
        ]))
        if os.geteuid() == 0:  # sshd as root needs its privilege-separation directory (made by Debian's unit at boot)
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        self.user = pwd.getpwuid(os.geteuid()).pw_name
        self._log = open(directory / "sshd.log", "wb")
        self.proc = subprocess.Popen([binary, "-D", "-e", "-f", str(config)], stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=self._log)
        deadline = time.monotonic() + HANG_GUARD_S
        while not self._banner():  # up once it greets
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"sshd did not start: {(directory / 'sshd.log').read_text()}")
            time.sleep(0.02)

    def _banner(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
                return s.recv(64).startswith(b"SSH-2.0-")
        except OSError:
            return False

    def url(self, path: Path) -> str:
        return f"ssh://{self.user}@127.0.0.1:{self.port}{path}"

    def ssh_command(self, key: Path | None = None) -> str:
        """The ssh a client uses for this server: ``key`` (default: the accepted one), its host key, no user config."""
        return (f"ssh -F /dev/null -o IdentitiesOnly=yes -i {key or self.key} -o UserKnownHostsFile={self.known_hosts} "
                "-o StrictHostKeyChecking=yes")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self._log.close()
