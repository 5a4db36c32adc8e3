"""``python -m daemon``: run the daemon in the foreground (what ``reef daemon start`` spawns)."""

from __future__ import annotations

import atexit
import os
import sys
import threading

from daemon.config import load_config
from daemon.errors import ReefError
from daemon.server import run, setup_logging, storing


def main(argv: list[str]) -> int:
    """Serve until a signal; an error is one line on stderr and its exit code (6: storage, e.g. a full disk)."""
    try:
        with storing("running the daemon"):  # what no narrower step named (opening the log file, say)
            config = load_config()
            setup_logging(config, to_file="--log-file" in argv)
            run(config)
    except ReefError as e:
        print(f"reef: {e.message}", file=sys.stderr)
        return e.exit_code
    return 0


def exit_now(code: int) -> None:
    """Exit as the interpreter would, less its teardown of every module: with torch and transformers loaded that
    teardown took 2-5 s after the daemon had stopped (its last log line written, its stores closed), which a
    ``reef daemon stop`` (and every test's daemon) waited for. What exit does that matters runs first: other threads
    are joined, the atexit handlers (logging's flush, executors) run, stdout and stderr are flushed."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or full stream: nothing more to say on it
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
