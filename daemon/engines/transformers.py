"""The embedded engine: transformers + torch, in-process, on the CPU or one GPU.

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
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import secrets
import threading
import weakref
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from daemon.engines.base import Engine, EngineInfo, ReleaseRef
from daemon.engines.chat_template import carries_tools
from daemon.engines.entry import ModelEntry
from daemon.engines.lora import Adapters, read_adapter
from daemon.engines.prefix_cache import TRIM_AFTER_TOKENS, PrefixCache, give_back
from daemon.engines.prompts import (
    SamplingParams,
    check_sampling,
    output_cap,
    render_chat,
    sampling_params,
)
from daemon.errors import (
    BadRequest,
    ContextLengthExceeded,
    EngineError,
    ModelUnavailable,
    ReefError,
    Unavailable,
    Unsupported,
)
from daemon.exchange import Completion, EngineEvent, Exchange, Finish, StopReason, TextDelta, Usage
from daemon.hf import no_progress_bars
from daemon.lora import read_dir as adapter_manifest


def _device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


@dataclass(eq=False)
class Load:
    """One load of weights into the engine; requests hold the load they arrived under until they end."""

    id: str
    path: Path
    model: Any
    tokenizer: Any
    device: torch.device
    eos_ids: frozenset[int]
    context_length: int
    batchable: bool  # plain full-attention KV caches: sequences can share a left-padded cache
    cache_arg: str
    nbytes: int = 0  # parameter memory, for the resident-load budget
    # LoRA: the adapters resident on this model (shared by the base's load and its adapter loads), and the one
    # this load decodes with (None: the model's own weights)
    lora: Adapters = field(default_factory=Adapters)
    adapter: str | None = None
    # set once the engine has dropped this load: a request still running on it keeps no prefix cache entry (a
    # later request on the same release gets a new load, with a new id, so the entry could never be used)
    dropped: bool = False
    served: bool = False  # among the releases that serve new requests (``retain``) at some time while resident

    def forward(self, ids: torch.Tensor, cache: Any, adapters: list[str | None] | None = None,
                **kwargs: Any) -> torch.Tensor:
        """Run the model over ``ids`` [rows, n], extending ``cache`` in place; returns the last logits [rows, vocab].
        ``adapters`` names each row's LoRA adapter (rows of several loads of one base decode together); default:
        this load's, for every row."""
        with self.lora.select(adapters or [self.adapter] * ids.shape[0], self.device):
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self.cache_arg: cache}, **kwargs)
        return out.logits[:, -1]

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @classmethod
    def open(cls, path: Path, load_id: str, device: torch.device) -> Load:
        from daemon.hf import LOAD_LOCK
        from daemon.model_dirs import check_model_dir

        check_model_dir(Path(path))
        try:
            with LOAD_LOCK, no_progress_bars():  # one transformers load at a time in the process (daemon/hf.py)
                from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
                from transformers.cache_utils import DynamicLayer

                tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
                model = AutoModelForCausalLM.from_pretrained(path, dtype="auto", local_files_only=True)
                model = model.to(device).eval()
        except ReefError:
            raise
        except Exception as e:  # whatever the loaders raise for a broken directory: name the path, no traceback
            raise ModelUnavailable(f"cannot load the model at {path}: {type(e).__name__}: {e}", path=path) from None
        if getattr(tokenizer, "backend_tokenizer", None) is None:
            raise ModelUnavailable(f"{path}: the transformers engine needs a fast tokenizer (tokenizer.json)", path=path)
        eos = model.generation_config.eos_token_id
        eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        return cls(
            id=load_id,
            path=Path(path),
            model=model,
            tokenizer=tokenizer,
            device=device,
            eos_ids=frozenset(eos_ids),
            context_length=getattr(model.config, "max_position_embeddings", None) or tokenizer.model_max_length,
            batchable=all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers),
            # transformers 5.x renamed ``past_key_values`` to ``cache`` (the old name warns, then goes away)
            cache_arg="cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values",
            nbytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        )

    def render(self, exchange: Exchange) -> str:
        return render_chat(self.tokenizer, exchange)

    def encode(self, exchange: Exchange) -> list[int]:
        return self.encode_text(self.render(exchange))

    def encode_text(self, text: str) -> list[int]:
        # the backend (Rust) tokenizer directly: no per-call state, safe to share between threads; a batch of one,
        # because ``encode_batch`` lets go of the GIL and ``encode`` holds it (650,000 characters: 0.64 s of the
        # event loop held from the worker thread, against 24 ms)
        return self.tokenizer.backend_tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for (its vocabulary's longest symbol; a byte-level symbol is
        one byte, at least one character, per symbol character): a bound for refusing a prompt untokenised."""
        return max(1, max((len(t) for t in self.tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True)),
                          default=1))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=True)


# Temperatures below this are greedy: at 1e-5 a logit lead of 1e-4 already weighs e^10 to 1, and far smaller ones
# overflow float32 when the logits are divided by them (1e-300 turns every logit into +-inf or NaN).
GREEDY_BELOW = 1e-5


def _greedy(logits: torch.Tensor) -> int:
    """The most likely token; a NaN never wins (``argmax`` takes NaN for the largest value)."""
    clean = logits.masked_fill(logits.isnan(), float("-inf"))
    top = int(clean.argmax())
    if not clean[top] > float("-inf"):
        raise EngineError("the model produced no finite logits")
    return top


def _sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    """One token from one row of float32 logits.

    Non-finite values never reach the sampler: a row whose scaled maximum is NaN or +inf (a NaN from the model, or
    logits too large for the temperature) has no distribution to draw from, so it falls back to greedy on the raw
    logits; a row with nothing above -inf is an ``EngineError``."""
    if p.temperature < GREEDY_BELOW:
        return _greedy(logits)
    x = logits / p.temperature
    if not torch.isfinite(x.max()):  # max is NaN if any value is, +inf if any is, -inf if all are
        return _greedy(logits)
    if 0 < p.top_k < x.numel():
        x = x.masked_fill(x < x.topk(p.top_k).values[-1], float("-inf"))
    if p.top_p < 1:
        sorted_x, order = x.sort(descending=True)
        probs = sorted_x.softmax(-1)
        x[order[probs.cumsum(-1) - probs > p.top_p]] = float("-inf")  # the most likely token always stays
    # inverse CDF with one uniform draw: 10x faster than torch.multinomial over a whole vocabulary
    cdf = x.softmax(-1).double().cumsum(-1)
    i = int(torch.searchsorted(cdf, torch.rand((), dtype=torch.float64, generator=generator) * cdf[-1], right=True))
    return i if i < len(cdf) else int(torch.searchsorted(cdf, cdf[-1]))  # the draw rounded up to the total


@dataclass(eq=False)
class _Seq:
    """One request in the generation thread: its load, tokens, text and where its events go."""

    load: Load
    model_name: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    post: Callable[[list[EngineEvent] | BaseException], object]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # chars of ``text`` already emitted
    window: tuple[int, int] = (0, 0)  # detokeniser prefix/read offsets into token_ids
    cancelled: bool = False
    cached: int = 0  # prompt tokens whose KV came from the prefix cache

    @property
    def output_tokens(self) -> int:
        """Tokens sampled so far (what ``/reef/inflight`` shows of a request in flight)."""
        return len(self.token_ids)

    @property
    def position(self) -> int:
        """Position of the last sampled token, the input of the next decode step."""
        return len(self.prompt) + len(self.token_ids) - 1

    @property
    def fed(self) -> list[int]:
        """The tokens whose keys and values are in this sequence's cache: all but the last sampled one."""
        return (self.prompt + self.token_ids)[: self.position]

    def emit(self, item: list[EngineEvent] | BaseException) -> None:
        try:
            self.post(item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancelled = True

    def push(self, token: int, logprob: float) -> bool:
        """Take one sampled token; emit what text is safe to show; return True when the sequence has finished."""
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        eos = token in self.load.eos_ids
        final = eos or len(self.token_ids) >= self.params.max_tokens
        self.text += self._detokenise(final)
        stop = self._find_stop()
        reason: StopReason | None = (
            "stop_sequence" if stop else "stop" if eos or (final and self.params.capped) else "length" if final
            else None
        )
        end = len(self.text) if reason else max(self.sent, len(self.text) - self._held_back())
        events: list[EngineEvent] = [TextDelta(self.text[self.sent : end])] if end > self.sent else []
        self.sent = end
        if reason:
            events.append(Finish(self._completion(reason, stop)))
        if events:
            self.emit(events)
        return reason is not None

    def _detokenise(self, final: bool) -> str:
        start, read = self.window
        prefix = self.load.decode(self.token_ids[start:read])
        full = self.load.decode(self.token_ids[start:])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        self.window = (read, len(self.token_ids))
        return full[len(prefix) :]

    def _find_stop(self) -> str | None:
        # emitted text never holds a stop string or the start of one, so a new match starts at or after ``sent``
        hits = [(i, s) for s in self.params.stop if (i := self.text.find(s, self.sent)) >= 0]
        if not hits:
            return None
        i, stop = min(hits)
        self.text = self.text[:i]
        return stop

    def _held_back(self) -> int:
        return max((k for s in self.params.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)

    def _completion(self, reason: StopReason, stop: str | None) -> Completion:
        return Completion(
            text=self.text,
            stop_reason=reason,
            stop_sequence=stop,
            usage=Usage(input_tokens=len(self.prompt), output_tokens=len(self.token_ids), cache_read_tokens=self.cached),
            model=self.model_name,
            prompt_token_ids=self.prompt,
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            runtime_load_id=self.load.id,
        )


def _lpad(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """Left-pad ``t`` with zeros along ``dim`` to length ``n``."""
    missing = n - t.shape[dim]
    if not missing:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class _Batch:
    """The decoding sequences of one model (one load, or the loads of LoRA adapters on one base): KV caches
    left-padded into one cache, one forward per step."""

    def __init__(self, load: Load) -> None:
        self.load = load
        self.seqs: list[_Seq] = []
        self.cache: Any = None
        self.mask: torch.Tensor | None = None  # [rows, cache length]: 1 real, 0 padding

    def add(self, seq: _Seq, cache: Any) -> None:
        mask = torch.ones(1, cache.get_seq_length(), dtype=torch.long, device=self.load.device)
        if self.seqs:
            n = max(self.mask.shape[1], mask.shape[1])
            for mine, new in zip(self.cache.layers, cache.layers, strict=True):
                mine.keys = torch.cat([_lpad(mine.keys, n, 2), _lpad(new.keys, n, 2)])
                mine.values = torch.cat([_lpad(mine.values, n, 2), _lpad(new.values, n, 2)])
            mask = torch.cat([_lpad(self.mask, n, 1), _lpad(mask, n, 1)])
        else:
            self.cache = cache
        self.mask = mask
        self.seqs.append(seq)

    def keep(self, keep: list[bool]) -> None:
        """Drop the rows not kept, then the padding columns that no row needs any more."""
        if all(keep):
            return
        rows = [i for i, k in enumerate(keep) if k]
        self.seqs = [self.seqs[i] for i in rows]
        if not rows:
            self.cache = self.mask = None
            return
        self.load = self.seqs[0].load  # rows may be of several adapter loads: hold a live one, not a finished one
        index = torch.tensor(rows, device=self.load.device)
        mask = self.mask[index]
        pad = int(mask.argmax(dim=1).min())  # first real column of the least padded row
        for layer in self.cache.layers:
            layer.keys = layer.keys[index, :, pad:]
            layer.values = layer.values[index, :, pad:]
        self.mask = mask[:, pad:]

    def row(self, i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Row ``i``'s keys and values without its padding, copied out of the batch (for the prefix cache)."""
        n = self.seqs[i].position  # the row's real columns: the last n (rows are left-padded)
        return [(layer.keys[i : i + 1, :, -n:].clone(), layer.values[i : i + 1, :, -n:].clone())
                for layer in self.cache.layers]

    def step(self) -> torch.Tensor:
        """One decode step for every row; returns the next-token logits, [rows, vocab]."""
        device = self.load.device
        ids = torch.tensor([[s.token_ids[-1]] for s in self.seqs], device=device)
        positions = torch.tensor([[s.position] for s in self.seqs], device=device)
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.seqs), 1)], dim=1)
        return self.load.forward(ids, self.cache, [s.load.adapter for s in self.seqs], attention_mask=self.mask,
                                 position_ids=positions)


def _choose(logits: torch.Tensor, seqs: list[_Seq]) -> list[tuple[int, float]]:
    """Sample one token per row; pair it with its log-prob under the raw model distribution."""
    logits = logits.float().cpu()
    logprobs = torch.log_softmax(logits, dim=-1)
    picks = []
    for row, lp, seq in zip(logits, logprobs, seqs, strict=True):
        token = _sample(row, seq.params, seq.generator)
        picks.append((token, float(lp[token])))
    return picks


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
        self._pending: deque[_Seq] = deque()
        self._calls: deque[Callable[[], None]] = deque()  # model changes the generation thread makes between steps
        self._closing = False
        self._thread: threading.Thread | None = None
        self._keep: frozenset[str] | None = None  # the releases serving new requests (``retain``); None: not told
        self.prefix_cache = PrefixCache(budget_bytes=entry.prefix_cache_mb * 2**20)

    @property
    def runtime_load_id(self) -> str | None:
        return self._current.id if self._current else None

    async def start(self) -> None:
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
        return await asyncio.to_thread(Load.open, path, load_id, self._device)

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
            task.add_done_callback(lambda t, k=key: self._loaded(k, t))  # type: ignore[misc]
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
        post = functools.partial(loop.call_soon_threadsafe, queue.put_nowait)
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

    def _prefill(self, seq: _Seq, batches: list[_Batch]) -> None:
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

    def _reuse_prefix(self, seq: _Seq, cache: Any) -> int:
        """Fill a new ``cache`` with the longest cached prefix of the prompt (same load); returns its length."""
        if not seq.load.batchable:  # sliding-window caches cannot be cut at any length
            return 0
        n, layers = self.prefix_cache.lookup(seq.load.id, seq.prompt)
        for layer, (keys, values) in zip(cache.layers, layers, strict=bool(layers)):
            layer.update(keys, values)  # concatenates onto an empty layer: a copy, the entry stays as it was
        seq.cached = n
        return n

    def _remember(self, seq: _Seq, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
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
