"""The embedded engine's rows (``daemon/engines/transformers.py`` holds the engine): a ``Load`` (one concrete load
of weights: model, tokenizer, adapter, the fast path's forward), a ``_Seq`` (one request's sequence: its sampling,
stops, detokenising and log-probs), the decode batch ``_Batch`` (left-padded caches with a mask and per-row
positions) and how a step's logits become tokens (``_choose``). The engine's step loop and the bulk jobs
(``daemon/engines/bulk.py``) both build on them; the design notes are the engine's."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import torch

from daemon.engines.lora import Adapters
from daemon.engines.prompts import (
    SamplingParams,
    render_chat,
)
from daemon.errors import (
    EngineError,
    ModelUnavailable,
    ReefError,
)
from daemon.exchange import Completion, EngineEvent, Exchange, Finish, StopReason, TextDelta, Usage
from daemon.hf import no_progress_bars

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from daemon.engines.decode import FastLlama


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
    tokenizer: PreTrainedTokenizerFast
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
    # the Llama fast path (``daemon/engines/decode.py``): its forward and cache instead of transformers' (None: theirs)
    fast: FastLlama | None = None

    def forward(self, ids: torch.Tensor, cache: Any, adapters: list[str | None] | None = None,
                **kwargs: Any) -> torch.Tensor:
        """Run the model over ``ids`` [rows, n], extending ``cache`` in place; returns the last logits [rows, vocab].
        ``adapters`` names each row's LoRA adapter (rows of several loads of one base decode together); default:
        this load's, for every row."""
        with self.lora.select(adapters or [self.adapter] * ids.shape[0], self.device):
            if self.fast is not None:
                return self.fast(ids, cache, **kwargs)
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self.cache_arg: cache}, **kwargs)
        logits: torch.Tensor = out.logits[:, -1]  # transformers' output object is untyped here (model: Any)
        return logits

    def new_cache(self) -> Any:
        if self.fast is not None:
            return self.fast.new_cache()
        return self.reference_cache()

    def reference_cache(self) -> Any:
        """transformers' own cache, which ``model`` itself takes (a forward that keeps the logits of several
        positions: the bulk jobs' prefill); the fast path decodes on it as on its own."""
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @classmethod
    def open(cls, path: Path, load_id: str, device: torch.device, *, fast: bool = True, pack: bool = True) -> Load:
        """Load the model directory at ``path``; ``fast`` / ``pack``: the entry's ``fast_path`` / ``pack_int4``."""
        from daemon.engines.decode import prepare
        from daemon.hf import LOAD_LOCK
        from daemon.model_dirs import check_model_dir

        check_model_dir(Path(path))
        try:
            with LOAD_LOCK, no_progress_bars():  # one transformers load at a time in the process (daemon/hf.py)
                from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedTokenizerFast
                from transformers.cache_utils import DynamicLayer

                tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
                model = AutoModelForCausalLM.from_pretrained(path, dtype="auto", local_files_only=True)
                # transformers wraps PreTrainedModel.to in a decorator whose type hides the signature
                model = model.to(device).eval()  # type: ignore[arg-type]
                fast_path = prepare(model, fast=fast, pack=pack)
        except ReefError:
            raise
        except Exception as e:  # whatever the loaders raise for a broken directory: name the path, no traceback
            raise ModelUnavailable(f"cannot load the model at {path}: {type(e).__name__}: {e}", path=path) from None
        if (not isinstance(tokenizer, PreTrainedTokenizerFast)
                or getattr(tokenizer, "backend_tokenizer", None) is None):
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
            nbytes=sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())),
            fast=fast_path,
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


def _sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
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


class SeqLoad(Protocol):
    """What a sequence needs of the weights it runs on: a ``Load`` here, an inference server's view of its load
    (``daemon/engines/server.py``, which samples on the server)."""

    @property
    def id(self) -> str: ...

    @property
    def eos_ids(self) -> frozenset[int]: ...

    def decode(self, ids: list[int]) -> str: ...


L = TypeVar("L", bound=SeqLoad)


@dataclass(eq=False)
class _Seq(Generic[L]):
    """One request in the generation thread: its load, tokens, text and where its events go."""

    load: L
    model_name: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None  # None: sampled elsewhere (an inference server)
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
        self.seqs: list[_Seq[Load]] = []
        self.cache: Any = None
        self.mask: torch.Tensor | None = None  # [rows, cache length]: 1 real, 0 padding

    def add(self, seq: _Seq[Load], cache: Any) -> None:
        self.merge(cache, torch.ones(1, cache.get_seq_length(), dtype=torch.long, device=self.load.device), [seq])

    def merge(self, cache: Any, mask: torch.Tensor, seqs: list[_Seq[Load]]) -> None:
        """Add prefilled rows (their cache and its mask), both sides left-padded to the wider of the two."""
        if self.seqs:
            assert self.mask is not None  # rows have a mask
            n = max(self.mask.shape[1], mask.shape[1])
            for mine, new in zip(self.cache.layers, cache.layers, strict=True):
                mine.keys = torch.cat([_lpad(mine.keys, n, 2), _lpad(new.keys, n, 2)])
                mine.values = torch.cat([_lpad(mine.values, n, 2), _lpad(new.values, n, 2)])
            mask = torch.cat([_lpad(self.mask, n, 1), _lpad(mask, n, 1)])
        else:
            self.cache = cache
        self.mask = mask
        self.seqs.extend(seqs)

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
        assert self.mask is not None  # rows have a mask
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
        assert self.mask is not None  # rows have a mask
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.seqs), 1)], dim=1)
        return self.load.forward(ids, self.cache, [s.load.adapter for s in self.seqs], attention_mask=self.mask,
                                 position_ids=positions)


def _choose(logits: torch.Tensor, seqs: list[_Seq[Load]]) -> list[tuple[int, float]]:
    """Sample one token per row; pair it with its log-prob under the raw model distribution."""
    logits = logits.float().cpu()
    logprobs = torch.log_softmax(logits, dim=-1)
    picks = []
    for row, lp, seq in zip(logits, logprobs, seqs, strict=True):
        token = _sample(row, seq.params, seq.generator)
        picks.append((token, float(lp[token])))
    return picks
