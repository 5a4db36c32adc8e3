"""A wrapped agent's requests that run long, said on the wrapper's stderr while the agent waits.

A slow model (SmolLM2 on a busy CPU) can take minutes over one answer while the agent shows nothing; the wrapper
asks the daemon what its run has in flight (``GET /reef/inflight?run=``, the engine's own count of tokens so far)
and says, once a request has run ``after_s`` and every ``every_s`` after that: ``the model is still answering: N
tokens in M s``. Standard library only (the wrapper's start-up path imports it).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

AFTER_S = 30.0  # a request this old is said to be running long
EVERY_S = 60.0  # then said again this often
POLL_S = 5.0  # how often the daemon is asked


def long_lines(inflight: list[dict[str, Any]], said: dict[str, float], *, after_s: float = AFTER_S,
               every_s: float = EVERY_S) -> list[str]:
    """The lines to say now for ``inflight`` (``GET /reef/inflight``'s list); ``said`` (receipt -> elapsed time at
    which it was last said) is updated."""
    out = []
    for x in inflight:
        elapsed, last = float(x["elapsed_s"]), said.get(x["receipt"])
        if elapsed < after_s or (last is not None and elapsed - last < every_s):
            continue
        said[x["receipt"]] = elapsed
        n, prompt = x.get("output_tokens"), x.get("prompt_tokens")
        if n is None:
            out.append(f"the model is still answering: {elapsed:.0f} s so far")
        elif n == 0:
            out.append(f"the model is still reading its prompt ({prompt:,} tokens): {elapsed:.0f} s so far"
                       if prompt else f"the model has not begun its answer: {elapsed:.0f} s so far")
        else:
            cap = x.get("output_cap")
            out.append(f"the model is still answering: {n:,} tokens in {elapsed:.0f} s"
                       + (f" (at most {cap:,})" if cap else ""))
    return out


@contextlib.contextmanager
def watch(get: Callable[[str], Any], run: str, say: Callable[[str], None], *, after_s: float = AFTER_S,
          every_s: float = EVERY_S, poll_s: float = POLL_S) -> Iterator[None]:
    """While the block runs (the agent), say the run's long requests (``get(path)``: one daemon request)."""
    stop = threading.Event()
    said: dict[str, float] = {}

    def loop() -> None:
        while not stop.wait(poll_s):
            try:
                inflight = get(f"/reef/inflight?run={run}")["inflight"]
            except Exception:  # the daemon restarting, or gone: the agent's own errors say so
                continue
            for line in long_lines(inflight, said, after_s=after_s, every_s=every_s):
                if not stop.is_set():
                    say(line)

    thread = threading.Thread(target=loop, name="reef-long-requests", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(poll_s + 5)
