"""The embedded engine's bulk work: many answers of one load decoded as one batch, and many teacher-forced
divergences in a few forwards, beside the requests being served. The daemon's own questions use it (the held-out
check's greedy answers and its KL from the base, ``daemon/gating/heldout.py``), through
``TransformersEngine.answer_many`` and ``divergence_many``.

Design choices:

- **One forward a turn, beside the serving batch.** A job (``Answers``, ``Divergences``) runs in the generation
  thread (it owns the models), one forward per call, each call posted between two serving steps
  (``TransformersEngine._between_steps``) once the last returned. Users' requests keep their slots (a job's rows
  are not among ``max_batch``), a new request is still prefilled at the next step, and a stream waits at most one
  of the job's forwards between two of its tokens (one decode step of the job's rows, or a prefill of at most
  ``PREFILL_TOKENS`` tokens). As requests each, the check's 34-52 prompts took ``max_batch`` slots and users queued
  behind them.
- **Why a batch.** On one CPU thread a forward costs about 0.12 s however small, plus about 5 ms a token
  (SmolLM2-135M, bfloat16). As requests, 34 prompts of 16 tokens took a prefill each and about 70 decode steps of 8
  rows; here, 2-3 prefills and 16 decode steps of 34 rows.
- **The shared prefix once.** The prompts open alike (the chat template's system prompt: 24 of SmolLM2's 42
  tokens); its keys and values are computed once per job, and each row's cache starts from a slice of them (a
  causal model's keys at a position depend only on the tokens up to it, the prefix cache's argument), so a
  prompt's prefill runs only past what it shares.
- **Left-padded, like the serving batch.** A prefill's rows end in the same column: row r takes the last S tokens
  of its prompt as input (S the longest unshared part among them; shorter prompts are left-padded) and the part of
  the shared prefix before those as cache, left-padded too, so the batch's padding is always on the left and
  ``_Batch`` decodes and trims it as it does the serving rows. Rows are sorted by length (the least padding); a
  decode batch holds at most ``BATCH_TOKENS`` of cache (rows x (longest prompt + max_tokens)), the next rows
  waiting for room as requests wait for slots.
- **The same answer as a request.** Each row is a ``_Seq`` as a request's: the same sampling, stops, text and
  ``Completion``; only the matmul shapes differ, so the logits agree up to float rounding (as the prefix cache's
  and the serving batch's). The jobs' rows are not stored in the prefix cache: the check's prompts are one-offs.
- **Divergences without their distributions piling up.** Each forward keeps logits only where a scored token is
  predicted; a chunk's log-probabilities under the first model wait for the second's forward, then only the
  per-token KL is kept.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from daemon.engines.prompts import SamplingParams
from daemon.engines.rows import Load, _Batch, _choose, _lpad, _Seq
from daemon.errors import EngineError
from daemon.exchange import Completion, EngineEvent, Finish

PREFILL_TOKENS = 256  # input tokens of one prefill forward: a stream pauses about 1 s for it (SmolLM2, one thread)
BATCH_TOKENS = 4096  # cache positions of one decode batch (34 prompts of 50 tokens and 16 answer tokens: 2,244)


def shared_prefix(rows: Sequence[Sequence[int]], last: Sequence[int] | None = None) -> int:
    """How many tokens every row starts with, leaving each row at least its last ``last[r]`` (default 1) tokens to
    run (their logits are what a forward is for)."""
    if not rows:
        return 0
    bound = min(len(r) - (1 if last is None else last[i]) for i, r in enumerate(rows))
    first = rows[0]
    for i in range(max(0, bound)):
        if any(r[i] != first[i] for r in rows):
            return i
    return max(0, bound)


class _Prefix:
    """The keys and values of a job's shared prefix on one load, computed by the first forward that needs them."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = list(tokens)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None if self.tokens else []

    def compute(self, load: Load, adapter: str | None) -> None:
        cache = load.reference_cache()
        load.forward(torch.tensor([self.tokens], device=load.device), cache, [adapter])
        self.layers = [(layer.keys, layer.values) for layer in cache.layers]


def _prefill(load: Load, rows: Sequence[Sequence[int]], prefix: _Prefix, adapters: list[str | None],
             keep: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """One left-padded forward of ``rows`` (each starting with ``prefix``'s tokens) on top of the prefix's keys and
    values: the cache, its mask [rows, columns] (1 real, 0 padding) and the logits of the last ``keep`` positions
    [rows, keep, vocab]. Row r's input is its last S tokens (S the longest unshared part), left-padded where the
    row is shorter; its cache the prefix before those, left-padded: padding only ever on the left."""
    assert prefix.layers is not None
    c = len(prefix.tokens)
    s = max(len(r) - c for r in rows)
    starts = [max(0, len(r) - s) for r in rows]  # where each row's input begins; at most c
    width = max(starts)
    ids, positions, mask = [], [], []
    for r, p in zip(rows, starts, strict=True):
        pad = s - (len(r) - p)
        ids.append([0] * pad + list(r[p:]))
        positions.append([0] * pad + list(range(p, len(r))))
        mask.append([0] * (width - p) + [1] * p + [0] * pad + [1] * (len(r) - p))
    device = load.device
    cache = load.reference_cache()
    if width:
        for layer, (keys, values) in zip(cache.layers, prefix.layers, strict=True):
            layer.update(torch.cat([_lpad(keys[:, :, :p], width, 2) for p in starts]),
                         torch.cat([_lpad(values[:, :, :p], width, 2) for p in starts]))
    attention = torch.tensor(mask, device=device)
    with load.lora.select(adapters, device):
        out = load.model(input_ids=torch.tensor(ids, device=device), attention_mask=attention,
                         position_ids=torch.tensor(positions, device=device), use_cache=True, logits_to_keep=keep,
                         **{load.cache_arg: cache})
    return cache, attention, out.logits


def _take(cache: Any, mask: torch.Tensor, rows: list[int]) -> tuple[Any, torch.Tensor]:
    """Only ``rows`` of a cache and its mask."""
    index = torch.tensor(rows, device=mask.device)
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[index], layer.values[index]
    return cache, mask[index]


class Answers:
    """The answers of one load to many prompts: each ``advance`` runs one forward (the shared prefix, a prefill of
    the next rows, or one decode step of the batch); ``done`` once every row has its ``Completion``."""

    def __init__(self, load: Load, model_name: str,
                 prepared: Sequence[tuple[list[int], SamplingParams, torch.Generator]]) -> None:
        self.load = load
        self.completions: list[Completion | None] = [None] * len(prepared)
        self.seqs = [_Seq(load, model_name, prompt, params, generator, self._collect(i))
                     for i, (prompt, params, generator) in enumerate(prepared)]
        self.waiting = deque(sorted(range(len(self.seqs)), key=lambda i: len(self.seqs[i].prompt)))
        self.prefix = _Prefix(self.seqs[0].prompt[: shared_prefix([s.prompt for s in self.seqs])]
                              if self.seqs else [])
        self.batch = _Batch(load)
        self.forwards = 0

    def _collect(self, i: int) -> Callable[[list[EngineEvent] | BaseException], None]:
        def post(item: list[EngineEvent] | BaseException) -> None:
            if isinstance(item, BaseException):
                raise item
            for event in item:
                if isinstance(event, Finish):
                    self.completions[i] = event.completion
        return post

    @property
    def done(self) -> bool:
        return not self.waiting and not self.batch.seqs

    def results(self) -> list[Completion]:
        assert all(c is not None for c in self.completions), "a job read before it was done"
        return [c for c in self.completions if c is not None]

    def _cells(self, seqs: Sequence[_Seq[Load]]) -> int:
        return len(seqs) * max((len(s.prompt) + s.params.max_tokens for s in seqs), default=0)

    def advance(self) -> None:
        """One forward, in the generation thread."""
        self.forwards += 1
        if self.prefix.layers is None:
            self.prefix.compute(self.load, self.load.adapter)
            return
        chunk: list[_Seq[Load]] = []
        c = len(self.prefix.tokens)
        while self.waiting:
            seq = self.seqs[self.waiting[0]]
            tokens = (len(chunk) + 1) * max(len(seq.prompt) - c, 1)  # rows are sorted: this one is the longest
            if chunk and tokens > PREFILL_TOKENS:
                break
            if (self.batch.seqs or chunk) and self._cells([*self.batch.seqs, *chunk, seq]) > BATCH_TOKENS:
                break
            chunk.append(seq)
            self.waiting.popleft()
        if chunk:
            self._prefill(chunk)
        elif self.batch.seqs:
            self._decode()
        else:  # nothing fits and nothing decodes: cannot happen (an empty batch takes any row)
            raise EngineError("the bulk job made no progress")

    def _prefill(self, chunk: list[_Seq[Load]]) -> None:
        cache, mask, logits = _prefill(self.load, [s.prompt for s in chunk], self.prefix,
                                       [s.load.adapter for s in chunk], 1)
        picks = _choose(logits[:, -1], chunk)
        live = [i for i, (seq, pick) in enumerate(zip(chunk, picks, strict=True)) if not seq.push(*pick)]
        if live:
            cache, mask = _take(cache, mask, live)
            self.batch.merge(cache, mask, [chunk[i] for i in live])

    def _decode(self) -> None:
        picks = _choose(self.batch.step(), self.batch.seqs)
        done = [seq.push(*pick) for seq, pick in zip(self.batch.seqs, picks, strict=True)]
        self.batch.keep([not d for d in done])


class Divergences:
    """Per-token KL(first || second) of two loads' next-token distributions along many (prompt, tokens) pairs,
    teacher-forced: each ``advance`` runs one forward (a shared prefix, or a chunk of rows on one of the loads)."""

    def __init__(self, loads: tuple[Load, Load], pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> None:
        self.loads = loads
        self.pairs = [(list(p), list(t)) for p, t in pairs]
        self.result: list[list[float]] = [[] for _ in self.pairs]
        todo = sorted((i for i, (_, t) in enumerate(self.pairs) if t), key=lambda i: sum(map(len, self.pairs[i])))
        rows = [self.pairs[i][0] + self.pairs[i][1] for i in todo]
        # the prefix stops before each row's last prompt token: its logits predict the first scored token
        n = shared_prefix(rows, [len(self.pairs[i][1]) + 1 for i in todo])
        self.prefixes = [_Prefix(rows[0][:n] if rows else []), _Prefix(rows[0][:n] if rows else [])]
        self.chunks: deque[list[int]] = deque()
        chunk: list[int] = []
        for i, row in zip(todo, rows, strict=True):
            if chunk and (len(chunk) + 1) * (len(row) - n) > PREFILL_TOKENS:  # sorted: this row is the longest
                self.chunks.append(chunk)
                chunk = []
            chunk.append(i)
        if chunk:
            self.chunks.append(chunk)
        self.first: torch.Tensor | None = None  # the chunk's log-probabilities under the first load
        self.forwards = 0

    @property
    def done(self) -> bool:
        return not self.chunks

    def advance(self) -> None:
        """One forward, in the generation thread."""
        self.forwards += 1
        side = 0 if self.first is None else 1
        load, prefix = self.loads[side], self.prefixes[side]
        if prefix.layers is None:
            prefix.compute(load, load.adapter)
            return
        chunk = self.chunks[0]
        counts = [len(self.pairs[i][1]) for i in chunk]
        keep = max(counts) + 1
        _, _, logits = _prefill(load, [self.pairs[i][0] + self.pairs[i][1] for i in chunk], prefix,
                                [load.adapter] * len(chunk), keep)
        logprobs = torch.log_softmax(logits[:, :-1].float().cpu(), dim=-1)  # [rows, keep - 1, vocab]
        if self.first is None:
            self.first = logprobs
            return
        p, q = self.first, logprobs
        kl = (p.exp() * (p - q)).sum(-1)  # [rows, keep - 1]; row r's tokens are its last counts[r] positions
        for row, (i, n) in enumerate(zip(chunk, counts, strict=True)):
            self.result[i] = [float(x) for x in kl[row, keep - 1 - n:]]
        self.first = None
        self.chunks.popleft()
