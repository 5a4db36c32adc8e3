"""The wrapper's process handling with real processes: signals sent to the wrapper reach the agent, and the
agent's exit code (or 128 + the signal that killed it) is the wrapper's."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.procs import wait_until_forwarding

# SIGHUP set back to its default first: under ``nohup`` (a suite started that way) it is ignored, an agent started
# then inherits that, and a shell cannot trap a signal ignored on entry
RUN = ("import os, signal, sys; signal.signal(signal.SIGHUP, signal.SIG_DFL); from reef_cli.wrapper import spawn; "
       "sys.exit(spawn(sys.argv[1:], dict(os.environ)))")


def start(*argv: str, ready: bool = False) -> subprocess.Popen[bytes]:
    """The wrapper's ``spawn`` running ``argv``, once it forwards signals (and, with ``ready``, once the agent
    has printed its first line)."""
    proc = subprocess.Popen([sys.executable, "-c", RUN, *argv], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if ready:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    wait_until_forwarding(proc)  # spawn's handlers are in place: signals are forwarded from here
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_to_the_wrapper_reaches_the_agent_and_its_exit_code_is_kept(sig: signal.Signals) -> None:
    # the agent handles the signal itself and exits 7: the wrapper must forward it and keep that code
    proc = start("sh", "-c", f"trap 'echo got-{sig.name}; kill $!; exit 7' {sig.name.removeprefix('SIG')}; "
                             "echo ready; sleep 30 & wait", ready=True)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)  # hang guard only
    assert proc.returncode == 7 and f"got-{sig.name}".encode() in out


def test_an_agent_killed_by_a_signal_gives_128_plus_the_signal() -> None:
    proc = start("sleep", "30")
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM


def test_the_agents_own_exit_code_is_kept() -> None:
    proc = subprocess.run([sys.executable, "-c", RUN, "sh", "-c", "exit 42"], capture_output=True, timeout=30)
    assert proc.returncode == 42
