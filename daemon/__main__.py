"""``python -m daemon``: run the daemon in the foreground (what ``reef daemon start`` spawns)."""

from __future__ import annotations

import sys

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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
