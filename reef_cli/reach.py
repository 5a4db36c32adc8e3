"""What a user reads when the daemon does not answer (``unreachable``): shared by the CLI's client, the wrappers'
lean client (``reef_cli/runs.py``) and the TUI. Standard library only: the wrappers import it on their start path, and
``reef doctor`` imports the client where the adapters package is missing."""

from __future__ import annotations

from daemon.config import Config
from daemon.errors import ReefError


def unreachable(config: Config, e: BaseException) -> ReefError:
    """What a user reads when the daemon does not answer: which daemon, what happened in words (never a bare errno
    text), and how it comes back."""
    import errno as errnos

    from daemon.errors import DaemonNotRunning

    cause: BaseException = e
    while not isinstance(cause, OSError) and (under := cause.__cause__ or cause.__context__) is not None:
        cause = under
    code = cause.errno if isinstance(cause, OSError) else None
    text = str(e).lower()
    if isinstance(cause, FileNotFoundError) or code == errnos.ENOENT:
        what = "not running (no socket there)"
    elif isinstance(cause, ConnectionRefusedError) or code == errnos.ECONNREFUSED or "refused" in text:
        what = "not answering (connection refused: it stopped or crashed)"
    elif (isinstance(cause, (ConnectionResetError, BrokenPipeError)) or code in (errnos.ECONNRESET, errnos.EPIPE)
          or type(e).__name__ == "RemoteProtocolError" or "reset" in text):
        what = "gone mid-request (it closed the connection: it may have crashed)"
    else:
        what = f"not answering ({type(cause).__name__})"
    if config.url:
        return DaemonNotRunning(f"the Reef daemon at {config.url} is {what}: check that it runs there and that "
                                "REEF_URL names it")
    return DaemonNotRunning(f"the Reef daemon at {config.socket_path} is {what}: start it with `reef daemon start` "
                            f"(`reef daemon logs` shows why it stopped)")
