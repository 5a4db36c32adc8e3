"""The embedded engine's prefix cache: the KV caches of recently finished sequences, reused by a new request whose
prompt starts with the same tokens, so an agent's next turn (the same system prompt and history, plus a little)
prefills only what is new.

Design choices:

- **What an entry is.** The load it was computed with (its id: the same weights), the token ids it covers (the
  prompt plus every generated token but the last, which was never fed back) and, per layer, its keys and values
  ``[1, kv_heads, tokens, head_dim]``, copied out of the batch's left-padded cache so an entry holds exactly its
  own memory. Entries are never changed after they are made: a request gets fresh tensors (``DynamicLayer.update``
  concatenates), so an entry can serve any number of later requests.
- **Matching on token ids, not text.** A lookup takes the entry of the same load with the longest common prefix
  with the new prompt. The next turn's prompt holds the previous answer re-rendered by the chat template, which can
  tokenise differently from the sampled ids; the match then simply stops there. At least ``min_tokens`` must match
  (a few shared template tokens are not worth a copy), and the last prompt token is always run, since its logits
  give the first sampled token.
- **Exact.** Running the rest of the prompt on top of a copied cache computes the same attention as one forward
  over the whole prompt (positions continue from the cache length; the causal mask covers the cached part); only
  the matmul shapes differ, so logits agree up to float rounding.
- **Bounded.** At most ``max_entries`` entries and ``budget_bytes`` of tensors, least recently used out first. An
  entry that a newer one extends is dropped (it can never match longer than its extension), and one that an existing
  entry already extends is not kept. Entries of a load that the engine dropped are forgotten with it, and a
  request still running on it stores none (no later request gets that load: its release loads again, under a new id).
- **Threads.** The generation thread looks up and stores; the event loop forgets dropped loads. One lock.
- **Memory given back.** A long prefill's working memory, freed, stays with the process: the C allocator keeps it
  between the entries' long-lived blocks, and 3,000-token prompts took SmolLM2's daemon 1.7x past the cache's
  bytes (docs/recipes.md, "The daemon's memory"). After a prefill of ``TRIM_AFTER_TOKENS`` new tokens or more the
  engine returns the heap's free pages (``give_back``: glibc's ``malloc_trim``, 10-170 ms; elsewhere nothing).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

TRIM_AFTER_TOKENS = 1024


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def give_back() -> None:
    """Return the heap's free pages to the system."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@dataclass(eq=False)
class Entry:
    load_id: str
    tokens: torch.Tensor  # [n] int64
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # (keys, values), each [1, kv_heads, n, head_dim]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)


@dataclass
class Stats:
    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0  # prompt tokens whose keys and values came from the cache
    prefilled_tokens: int = 0  # prompt tokens the engine computed


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two 1-d tensors."""
    n = min(len(a), len(b))
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if len(diff) else n


class PrefixCache:
    """KV caches of finished sequences, keyed by load, matched on the longest common token prefix."""

    def __init__(self, budget_bytes: int, max_entries: int = 32, min_tokens: int = 16) -> None:
        self.budget_bytes = budget_bytes
        self.max_entries = max_entries
        self.min_tokens = min_tokens
        self.stats = Stats()
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._keys = itertools.count()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0 and self.max_entries > 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def lookup(self, load_id: str, prompt: list[int]) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The longest cached prefix of ``prompt`` computed with ``load_id``: (its length, per-layer (keys, values)
        views of that length), or (0, []) when none of at least ``min_tokens`` tokens is cached. Counts the hit or
        miss; the views must only be copied from, never written."""
        best, best_n = None, 0
        if self.enabled and len(prompt) > self.min_tokens:
            ids = torch.tensor(prompt)
            with self._lock:
                for key, entry in self._entries.items():
                    if entry.load_id == load_id and (n := common_prefix(entry.tokens, ids)) > best_n:
                        best, best_n = key, n
                best_n = min(best_n, len(prompt) - 1)  # the last prompt token is run: it gives the first token
                if best is None or best_n < self.min_tokens:
                    best, best_n = None, 0
                else:
                    self._entries.move_to_end(best)
                    entry = self._entries[best]
        if best is None:
            self.stats.misses += 1
            self.stats.prefilled_tokens += len(prompt)
            return 0, []
        self.stats.hits += 1
        self.stats.reused_tokens += best_n
        self.stats.prefilled_tokens += len(prompt) - best_n
        return best_n, [(k[:, :, :best_n], v[:, :, :best_n]) for k, v in entry.layers]

    def store(self, load_id: str, tokens: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep the keys and values of ``tokens`` (a finished sequence) for later requests on the same load.

        ``layers`` must be tensors nothing else writes to (copies, or the cache of a sequence that has ended)."""
        if not self.enabled or len(tokens) < self.min_tokens:
            return
        assert all(k.shape[0] == 1 and k.shape[2] == len(tokens) == v.shape[2] for k, v in layers), "one row, n tokens"
        entry = Entry(load_id, torch.tensor(tokens), layers)
        if entry.nbytes > self.budget_bytes:
            return
        with self._lock:
            for key, old in list(self._entries.items()):
                if old.load_id != load_id:
                    continue
                n = common_prefix(old.tokens, entry.tokens)
                if n == len(entry.tokens):  # an entry already holds all of this one
                    self._entries.move_to_end(key)
                    return
                if n == len(old.tokens):  # this one extends an older entry: the older can never match longer
                    self._drop(key)
            self._entries[next(self._keys)] = entry
            self._bytes += entry.nbytes
            while len(self._entries) > self.max_entries or self._bytes > self.budget_bytes:
                self._drop(next(iter(self._entries)))

    def forget(self, load_id: str) -> None:
        """Drop every entry computed with ``load_id`` (the engine no longer holds that load)."""
        with self._lock:
            for key in [k for k, e in self._entries.items() if e.load_id == load_id]:
                self._drop(key)

    def _drop(self, key: int) -> None:
        self._bytes -= self._entries.pop(key).nbytes

    def describe(self) -> dict[str, Any]:
        s = self.stats
        return {"entries": len(self._entries), "bytes": self._bytes, "hits": s.hits, "misses": s.misses,
                "reused_tokens": s.reused_tokens, "prefilled_tokens": s.prefilled_tokens}
