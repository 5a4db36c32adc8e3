"""The embedded engine: transformers + torch, in-process, on the CPU or one GPU (its loads, sequences and decode
batch are in ``daemon/engines/rows.py``; its Llama fast path in ``daemon/engines/decode.py``).

Design choices:

- **Loads.** A ``Load`` is one concrete load of weights (model, tokenizer, ``runtime_load_id``
  ``"<incarnation>:<seq>"``). Loads are resident per release content (``content_id``): a request names the
  release it is frozen to, captures that release's ``Load`` object when it arrives and keeps it to the end, so a
  new release loads beside the old ones and in-flight requests never change weights. Several releases (of one
  or several scenarios) serve at once; when the resident loads exceed ``entry.memory_budget_mb``, the least
  recently used load with no running sequence is dropped (and freed by refcounting once nothing holds it).
  Before that, a release that served new requests and serves none any more (``retain``: the daemon names each
  scenario's head, the canary arms and the releases requests pinned lately, ``daemon/residency.py``) is dropped
  once no request runs on it, so a superseded head's adapter is not kept until the budget. Concurrent requests
  for a release being loaded wait on one shared load.
- **LoRA adapter releases** (``daemon/lora.py``) are loads too, each with its own ``runtime_load_id``, sharing the
  model of their base's load (resident once per base content id): the adapter is attached beside the others
  (``daemon/engines/lora.py``, in the generation thread between two steps), the rows of all releases on one base
  decode in one batch, each with its own adapter, and an adapter is detached once its load is dropped and no
  request holds it (a finaliser, as whole loads are freed by refcounting). A base stays while adapters are on it.
- **Threading.** One generation thread owns the models and runs a step loop; torch releases the GIL in its
  kernels, so the event loop stays responsive. Rendering and tokenising a prompt run in ``asyncio.to_thread``.
  Events go back to each request's ``asyncio.Queue`` through ``loop.call_soon_threadsafe``. A request whose
  consumer goes away (generator closed or cancelled) is flagged and dropped at the next step.
- **Batching.** Up to ``max_batch`` sequences are active; more wait in arrival order. Each step prefills one
  new prompt alone, in one forward (chunked prefill measured 2x slower on CPU: transformers then builds an
  explicit attention mask), then runs one decode step for all decoding sequences of a load together: their KV
  caches are kept left-padded in one cache with an attention mask and per-row position ids. Rows are removed
  (and padding no row needs trimmed) as sequences finish. Models whose caches are not plain full-attention
  layers (sliding windows) decode each sequence on its own. A long prompt's prefill pauses running streams
  for its duration (about 2.5 s for 20k tokens on one CPU thread with the tiny model).
- **Prefix cache.** A finished sequence's KV cache is kept (``daemon/engines/prefix_cache.py``, bounded by
  ``entry.prefix_cache_mb``); a new prompt on the same load that starts with the same tokens copies that part and
  prefills only the rest (``Usage.cache_read_tokens`` says how many tokens were reused). Entries are keyed by the
  load (``runtime_load_id``), not the model: the loads of LoRA adapters on one base share its model but never each
  other's (or the bare base's) keys and values, which the adapters change from the first layer on.
- **Opening a model.** The directory is checked first (missing, not a model, truncated weights: an error naming
  the path, ``daemon/model_dirs.py``) and loaded with ``local_files_only``: a path never turns into a download.
- **Sampling.** temperature (default 1; 0, and anything below ``GREEDY_BELOW`` = 1e-5, is greedy), top_k,
  top_p, on float32 logits on the CPU with a ``torch.Generator`` per request (``seed`` makes a request
  repeatable: exactly when it runs alone from a cold prefill, and up to float rounding of the logits when batched
  with others or prefilled from the prefix cache). A row with NaN or +inf after scaling is greedy on its raw
  logits: non-finite values never reach the draw.
  Stops: an EOS token (``"stop"``), a stop string in the decoded text (trimmed, ``"stop_sequence"``; text that
  could begin a stop string is held back until it cannot), ``max_tokens`` (bounded by the output cap and the room
  left in the context, ``daemon/engines/prompts.py``; ``"length"``, or ``"stop"`` where Reef's cap ended it).
- **Log-probs.** ``Completion.logprobs[i]`` is the log-softmax of the raw logits (temperature 1, before top-k /
  top-p) at the sampled token: the model's own distribution, which is what RL recomputes and compares against.
  ``token_ids`` are exactly the sampled ids, EOS included; ``text`` leaves out special tokens.
- **Detokenising.** Incremental over a small window of ids (prefix/read offsets), emitting only text that does
  not end in an incomplete character, so a UTF-8 character split over byte-level tokens is never emitted in halves.
- **Bulk jobs.** The daemon's own many questions (the held-out check's answers and KL) run as one batch beside the
  serving batch, one forward between two steps, holding no slot of ``max_batch`` (``daemon/engines/bulk.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import secrets
import threading
import weakref
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Collection
from pathlib import Path
from typing import Any

import torch

from daemon.engines.base import Engine, EngineInfo, ReleaseRef
from daemon.engines.chat_template import carries_tools
from daemon.engines.entry import ModelEntry
from daemon.engines.lora import read_adapter
from daemon.engines.prefix_cache import TRIM_AFTER_TOKENS, PrefixCache, give_back
from daemon.engines.prompts import (
    SamplingParams,
    check_sampling,
    output_cap,
    sampling_params,
)
from daemon.engines.rows import Load, _Batch, _choose, _device, _Seq
from daemon.errors import (
    BadRequest,
    ContextLengthExceeded,
    EngineError,
    Unavailable,
    Unsupported,
)
from daemon.exchange import Completion, EngineEvent, Exchange, Finish
from daemon.lora import read_dir as adapter_manifest


class TransformersEngine(Engine):
    def __init__(self, entry: ModelEntry) -> None:
        if entry.path is None:
            raise BadRequest(f"config: models.{entry.name}: the transformers engine needs a path")
        self.entry = entry
        self.incarnation = secrets.token_hex(4)
        self.info = EngineInfo(name="transformers", model=entry.name)
        self._device = _device(entry.device)
        self._loads = 0
        self._load_lock = asyncio.Lock()
        self._current: Load | None = None  # the base model, for requests that name no release
        self._resident: OrderedDict[str, Load] = OrderedDict()  # content_id -> load, least recently used first
        self._loading: dict[str, asyncio.Task[Load]] = {}
        self._active: Counter[str] = Counter()  # load id -> running sequences
        self._cond = threading.Condition()
        self._pending: deque[_Seq[Load]] = deque()
        self._calls: deque[Callable[[], None]] = deque()  # model changes the generation thread makes between steps
        self._closing = False
        self._thread: threading.Thread | None = None
        self._keep: frozenset[str] | None = None  # the releases serving new requests (``retain``); None: not told
        self.prefix_cache = PrefixCache(budget_bytes=entry.prefix_cache_mb * 2**20)

    @property
    def runtime_load_id(self) -> str | None:
        return self._current.id if self._current else None

    async def start(self) -> None:
        assert self.entry.path is not None  # __init__ refused an entry without one
        await self.load(self.entry.path)
        self._thread = threading.Thread(target=self._work, name=f"reef-engine-{self.entry.name}", daemon=True)
        self._thread.start()

    async def load(self, path: Path) -> str:
        """Load weights from ``path`` beside the current ones and serve new requests from them; returns the load id.

        Requests already running keep the load they started with; it is freed when the last of them ends.
        """
        load = await self._open(path)
        self._current = load
        self.info = EngineInfo(name="transformers", model=self.entry.name, context_length=load.context_length,
                               accepts_images=False, output_cap=output_cap(self.entry, load.context_length),
                               carries_tools=carries_tools(load.tokenizer))
        return load.id

    async def _open(self, path: Path) -> Load:
        async with self._load_lock:
            self._loads += 1
            load_id = f"{self.incarnation}:{self._loads}"
        return await asyncio.to_thread(functools.partial(Load.open, path, load_id, self._device,
                                                         fast=self.entry.fast_path, pack=self.entry.pack_int4))

    async def preload(self, release: ReleaseRef) -> str | None:
        return (await self._acquire(release)).id

    async def _acquire(self, release: ReleaseRef | None) -> Load:
        """The resident load of a release, loading it (once, however many requests ask) when needed."""
        if release is None:
            return self._serving()
        if self._closing:
            raise Unavailable("the engine is shutting down")
        key = release.content_id
        load = self._resident.get(key)
        if load is not None:
            self._resident.move_to_end(key)
            return load
        task = self._loading.get(key)
        if task is None:
            if release.path is None:
                raise EngineError(f"release {release.release_id} has no checked-out artifact to load")
            task = asyncio.ensure_future(self._open_adapter(release) if release.base else self._open(release.path))
            self._loading[key] = task
            task.add_done_callback(functools.partial(self._loaded, key))
        return await asyncio.shield(task)

    async def _open_adapter(self, release: ReleaseRef) -> Load:
        """A LoRA adapter release: its base resident (shared with every other release on it), the adapter attached
        beside the others. The adapter is detached once its load is dropped and no request holds it."""
        assert release.base is not None and release.path is not None
        base = await self._acquire(release.base)
        manifest = await asyncio.to_thread(adapter_manifest, release.path)
        if manifest is None or manifest.base_content_id != release.base.content_id:
            raise EngineError(f"release {release.release_id}: the adapter's manifest names base "
                              f"{manifest and manifest.base_content_id}, not the resident base "
                              f"{release.base.content_id}; not served")
        weights = await asyncio.to_thread(read_adapter, release.path, base.model, base.device)
        async with self._load_lock:
            self._loads += 1
            load_id = f"{self.incarnation}:{self._loads}"
        await self._between_steps(functools.partial(base.lora.attach, base.model, load_id, weights))
        # the base may have been dropped meanwhile: it stays (and keeps prefix cache entries again) while adapters do
        if self._resident.setdefault(release.base.content_id, base) is base:
            base.dropped = False
        load = dataclasses.replace(base, id=load_id, path=release.path, adapter=load_id, nbytes=weights.nbytes,
                                   dropped=False, served=False)
        detach = weakref.finalize(load, self._post, functools.partial(base.lora.detach, load_id))
        detach.atexit = False
        return load

    async def _between_steps(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` in the generation thread between two steps (it owns the models) and return its result."""
        if self._thread is None or not self._thread.is_alive():
            return fn()  # no generation thread (yet): nothing else touches the models
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            if not done.done():
                done.set_exception(error) if error is not None else done.set_result(result)

        def call() -> None:
            try:
                result, error = fn(), None
            except Exception as e:
                result, error = None, e
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
                loop.call_soon_threadsafe(settle, result, error)

        self._post(call)
        return await done

    def _post(self, call: Callable[[], None]) -> None:
        with self._cond:
            self._calls.append(call)
            self._cond.notify()

    def _loaded(self, key: str, task: asyncio.Task[Load]) -> None:
        self._loading.pop(key, None)
        if task.cancelled() or task.exception() is not None:
            return
        self._resident[key] = load = task.result()
        load.served = self._keep is not None and key in self._keep
        self._evict()

    def _evict(self) -> None:
        budget = self.entry.memory_budget_mb * 2**20
        total = sum(load.nbytes for load in self._resident.values())
        for key, load in list(self._resident.items()):
            if total <= budget or len(self._resident) <= 1:
                break
            based_on = load.adapter is None and len(load.lora)  # a base with adapters attached stays with them
            if self._active[load.id] == 0 and not based_on:
                total -= load.nbytes
                self._drop(key, load)

    def _drop(self, key: str, load: Load) -> None:
        del self._resident[key]
        load.dropped = True  # before forget: a store racing the two leaves at most one entry, aged out
        self.prefix_cache.forget(load.id)

    def retain(self, keep: Collection[str]) -> None:
        self._keep = frozenset(keep)
        for key, load in self._resident.items():
            load.served = load.served or key in self._keep
        self._sweep()

    def _sweep(self) -> None:
        """Drop the loads of releases that served and serve no more (``retain``), unless a request runs on them or
        adapters stand on them; loads for a look (a held-out candidate, reef eval) never served and stay."""
        keep = self._keep or frozenset()
        for key, load in list(self._resident.items()):
            if load.served and key not in keep and not self._active[load.id] \
                    and not (load.adapter is None and len(load.lora)) and load is not self._current:
                self._drop(key, load)

    def _idle(self, load: Load) -> None:
        """A request on ``load`` ended."""
        self._active[load.id] -= 1
        if not self._active[load.id]:
            del self._active[load.id]
            self._sweep()

    @property
    def resident(self) -> dict[str, str]:
        """content_id -> load id of the loads kept in memory."""
        return {k: v.id for k, v in self._resident.items()}

    async def divergence(self, prompt_token_ids: list[int], token_ids: list[int], release: ReleaseRef,
                         reference: ReleaseRef) -> list[float] | None:
        """In the generation thread (it owns the models; a LoRA adapter is selected per call): one forward of each
        load without a cache, the output head only where a completion token is predicted."""
        if not token_ids:
            return []
        loads = [await self._acquire(release), await self._acquire(reference)]
        n = len(token_ids)
        seq = [*prompt_token_ids, *token_ids]

        def log_probs(load: Load) -> torch.Tensor:
            ids = torch.tensor([seq], device=load.device)
            with load.lora.select([load.adapter], load.device):
                logits = load.model(input_ids=ids, use_cache=False, logits_to_keep=n + 1).logits[0, :-1]
            return torch.log_softmax(logits.float().cpu(), dim=-1)

        def run() -> list[float]:
            with torch.inference_mode():
                p, q = log_probs(loads[0]), log_probs(loads[1])
                return [float(x) for x in (p.exp() * (p - q)).sum(-1)]

        for load in loads:
            self._active[load.id] += 1
        try:
            result: list[float] = await self._between_steps(run)
        finally:
            for load in loads:
                self._idle(load)
        return result

    async def answer_many(self, exchanges: list[Exchange], release: ReleaseRef | None = None) -> list[Completion]:
        """What ``generate`` would finish with for each exchange, decoded as one batch beside the requests being
        served (``daemon/engines/bulk.py``: one forward between two serving steps)."""
        from daemon.engines import bulk

        load = await self._acquire(release)
        if not load.batchable:  # sliding-window caches are not left-padded together: each a request
            return await super().answer_many(exchanges, release)
        prepared = await asyncio.to_thread(lambda: [self._prepare(load, e) for e in exchanges])
        job = bulk.Answers(load, self.entry.name, prepared)
        await self._run_bulk(job, [load])
        return job.results()

    async def divergence_many(self, pairs: list[tuple[list[int], list[int]]], release: ReleaseRef,
                              reference: ReleaseRef) -> list[list[float]] | None:
        """``divergence`` of each (prompt, tokens) pair, in a few batched forwards beside the requests being served
        (``daemon/engines/bulk.py``)."""
        from daemon.engines import bulk

        loads = (await self._acquire(release), await self._acquire(reference))
        if not all(load.batchable for load in loads):
            return await super().divergence_many(pairs, release, reference)
        job = bulk.Divergences(loads, pairs)
        await self._run_bulk(job, list(loads))
        return job.result

    async def _run_bulk(self, job: Any, loads: list[Load]) -> None:
        """A bulk job's forwards, one between two serving steps, its loads held (never evicted) meanwhile."""
        for load in loads:
            self._active[load.id] += 1
        try:
            while not job.done:
                if self._closing or self._thread is None or not self._thread.is_alive():
                    raise Unavailable("the engine is shutting down")
                await self._between_steps(job.advance)
        finally:
            for load in loads:
                self._active[load.id] -= 1
                if not self._active[load.id]:
                    del self._active[load.id]

    async def unload(self, release: ReleaseRef) -> None:
        load = self._resident.get(release.content_id)
        if load is not None and not self._active[load.id] and load is not self._current:
            self._drop(release.content_id, load)

    async def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread:
            await asyncio.to_thread(self._thread.join)

    async def count_tokens(self, exchange: Exchange, release: ReleaseRef | None = None) -> int:
        load = await self._acquire(release)
        return len(await asyncio.to_thread(self._encode_checked, load, exchange))

    def _encode_checked(self, load: Load, exchange: Exchange) -> list[int]:
        self._check_content(exchange)  # here, in the thread: 0.2 s on the loop for 870,000 messages
        return load.encode(exchange)

    async def generate(self, exchange: Exchange, release: ReleaseRef | None = None) -> AsyncIterator[EngineEvent]:
        load = await self._acquire(release)  # frozen here: this request runs on this load to the end
        prompt, params, generator = await asyncio.to_thread(self._prepare, load, exchange)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[list[EngineEvent] | BaseException] = asyncio.Queue()

        def post(events: list[EngineEvent] | BaseException) -> None:  # from the generation thread
            loop.call_soon_threadsafe(queue.put_nowait, events)

        seq = exchange.progress = _Seq(load, self.entry.name, prompt, params, generator, post)
        with self._cond:
            if self._closing:
                raise Unavailable("the engine is shutting down")
            self._pending.append(seq)
            self._cond.notify()
        self._active[load.id] += 1
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                for event in item:
                    yield event
                    if isinstance(event, Finish):
                        return
        finally:
            seq.cancelled = True
            self._idle(load)

    # --- request side ----------------------------------------------------------------------------------------

    def _serving(self) -> Load:
        if self._current is None or self._closing:
            raise Unavailable(f"model {self.entry.name} is not loaded")
        return self._current

    def _check_content(self, exchange: Exchange) -> None:
        if exchange.has_images():
            raise Unsupported(f"model {self.entry.name} is text-only: image content is not supported", param="messages")

    def _prepare(self, load: Load, exchange: Exchange) -> tuple[list[int], SamplingParams, torch.Generator]:
        self._check_content(exchange)  # here, in the thread: 0.2 s on the loop for 870,000 messages
        s = exchange.sampling
        check_sampling(s)
        # no token spans more than ``max_token_chars`` characters: a prompt longer than that many per position of
        # the context cannot fit, and is refused without tokenising it (10 MB took 9-13 s and held the GIL); the
        # prompt holds at least its messages' text, so one whose text alone is too long is not even rendered (the
        # chat template over 870,000 messages took longer than all the rest)
        bound = load.context_length * load.max_token_chars
        chars = sum(len(p.text) for m in exchange.messages for p in m.parts if p.type in ("text", "tool_result"))
        if chars > bound:
            raise ContextLengthExceeded(-(-chars // load.max_token_chars), load.context_length, at_least=True)
        text = load.render(exchange)
        if len(text) > bound:
            raise ContextLengthExceeded(-(-len(text) // load.max_token_chars), load.context_length, at_least=True)
        prompt = load.encode_text(text)
        if len(prompt) >= load.context_length:
            raise ContextLengthExceeded(len(prompt), load.context_length)
        params = sampling_params(s, self.entry, load.context_length, len(prompt))
        generator = torch.Generator()
        generator.manual_seed(secrets.randbits(63) if s.seed is None else s.seed & (2**64 - 1))
        return prompt, params, generator

    # --- the generation thread --------------------------------------------------------------------------------

    def _work(self) -> None:
        torch.set_num_threads(self.entry.threads)
        batches: list[_Batch] = []
        batch: _Batch | None = None  # the last one decoded, let go of while idle (below)
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not (self._closing or self._pending or batches or self._calls):
                        self._cond.wait()
                    if self._closing:
                        break
                    calls = [self._calls.popleft() for _ in range(len(self._calls))]
                    while self._pending and self._pending[0].cancelled:
                        self._pending.popleft()
                    room = self.entry.max_batch > sum(len(b.seqs) for b in batches)
                    seq = self._pending.popleft() if self._pending and room else None
                for call in calls:  # model changes (LoRA adapters attached, detached), between two steps
                    call()
                if seq:
                    self._prefill(seq, batches)
                for batch in batches:
                    self._decode(batch)
                batches = [b for b in batches if b.seqs]
                seq = batch = None  # while idle, hold no finished request's load (LoRA adapters detach when free)
        with self._cond:
            left = [*self._pending, *(s for b in batches for s in b.seqs)]
            self._pending.clear()
            calls = [*self._calls]
            self._calls.clear()
        for call in calls:  # an attach still awaited gets its answer
            call()
        for seq in left:
            seq.emit(Unavailable("the engine is shutting down"))

    def _prefill(self, seq: _Seq[Load], batches: list[_Batch]) -> None:
        """Run a new prompt; sample its first token; unless that ends it, add it to its load's batch."""
        try:
            cache = seq.load.new_cache()
            reused = self._reuse_prefix(seq, cache)
            logits = seq.load.forward(torch.tensor([seq.prompt[reused:]], device=seq.load.device), cache)
            if seq.push(*_choose(logits, [seq])[0]):
                self._remember(seq, [(layer.keys, layer.values) for layer in cache.layers])
            else:
                # one batch per model: loads of LoRA adapters on one base share it, each row with its adapter
                batch = next((b for b in batches if b.load.model is seq.load.model and b.load.batchable), None)
                if batch is None:
                    batch = _Batch(seq.load)
                    batches.append(batch)
                batch.add(seq, cache)
            if len(seq.prompt) - reused >= TRIM_AFTER_TOKENS:  # its working memory back to the system
                give_back()
        except Exception as e:  # a failing request must not take the generation thread down
            seq.emit(EngineError(f"generation failed: {type(e).__name__}: {e}"))

    def _reuse_prefix(self, seq: _Seq[Load], cache: Any) -> int:
        """Fill a new ``cache`` with the longest cached prefix of the prompt (same load); returns its length."""
        if not seq.load.batchable:  # sliding-window caches cannot be cut at any length
            return 0
        n, layers = self.prefix_cache.lookup(seq.load.id, seq.prompt)
        for layer, (keys, values) in zip(cache.layers, layers, strict=bool(layers)):
            layer.update(keys, values)  # concatenates onto an empty layer: a copy, the entry stays as it was
        seq.cached = n
        return n

    def _remember(self, seq: _Seq[Load], layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if seq.load.batchable and not seq.load.dropped:
            self.prefix_cache.store(seq.load.id, seq.fed, layers)

    def _decode(self, batch: _Batch) -> None:
        batch.keep([not s.cancelled for s in batch.seqs])
        if not batch.seqs:
            return
        try:
            picks = _choose(batch.step(), batch.seqs)
            done = [seq.push(*pick) for seq, pick in zip(batch.seqs, picks, strict=True)]
            for i, seq in enumerate(batch.seqs):
                if done[i] and self.prefix_cache.enabled:
                    self._remember(seq, batch.row(i))
            batch.keep([not d for d in done])
        except Exception as e:
            for seq in batch.seqs:
                seq.emit(EngineError(f"generation failed: {type(e).__name__}: {e}"))
            batch.keep([False] * len(batch.seqs))
