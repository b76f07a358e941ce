"""The server's scheduler: N slots, each with its own KV cache and token loop, and one batcher that runs the
model for all of them.

Each slot has a thread that runs the engine's own token loop, generate.generate_stream (stop strings,
end-of-generation, max_tokens, speculative decoding: the same code, so a request's text is the text
Model.generate gives), with a `forward` that does not run the model itself: it hands its tokens to the
batcher and waits. The batcher runs when every busy slot is waiting on it: the waiting one-token steps (and
drafted runs being verified) of all slots go through ONE forward (models/batch.py: each weight read once for
all of them, attention per sequence over its own cache); the prompt chunks waiting then run after them, so a
new request's prefill joins between decode steps and the running streams keep flowing: several prompts in one
forward of their own (never with decode steps) where the backend computes each one's rows as it would alone
(`rows_independent_from`: on the CPU, prompts longer than the GEMV's few tokens; not for a mixture of experts,
whose experts would see other prompts' rows), else one by one. All model work happens on the batcher's thread
(the numba kernels and the device are not shared between threads).

A slot keeps what its cache holds (the token ids, in `Slot.cached`); a request goes to the free slot whose
cache shares the longest prefix with its prompt, and only the rest is prefilled (KVCache.truncate, as
Model._cache_holding_prefix does for one cache). An idle slot's cache can be saved to a file and restored
(llama-server's /slots actions): the file is a prompt cache (kv/prompt_cache.py), which `cupyllm generate
--prompt-cache` and Model.generate(prompt_cache=) read as well.
"""
from __future__ import annotations

import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ..backend.precompile import zero_weight
from ..generate import GenerationStats, generate_stream
from ..errors import ContextOverflowError, InputError
from ..kv.prompt_cache import PromptCache, shared_prefix
from ..models.batch import Segment, forward_batch
from ..ops.matmul.cpu import matmul_many
from ..sampling import Sampler, SamplingParams
from ..speculative import DraftLength
from ..speculative.factory import drafter_for


def start_cpu_threads() -> None:
    """Run one parallel numba region on the calling thread (the batcher's, first thing). With numba's OpenMP layer
    every thread that starts parallel regions gets a libgomp team of its own, and once their threads outnumber the
    cores libgomp throttles their spinning between regions: a third slower decode (docs/server.md, Limits). So in
    a serving process only the batcher runs model work. (The region is the decode GEMV's on a tiny weight of
    zero blocks: a kernel the precompile has put in numba's cache, so that starting a server compiles nothing.)"""
    data, fmt = zero_weight(2, 256)
    matmul_many(np.ones((1, 256), np.float32), [(data, fmt)], 256)


def warm_up(model, cache) -> None:
    """One token through the model on an empty slot's cache, which is emptied again: the CPU backend interleaves
    the weights' rows on their first matmul (seconds for a model of gigabytes, cupyllm/ops/matmul/cpu_interleaved.py),
    so this happens when the server starts, not in its first request (llama-server warms up too)."""
    model._forward_numpy(np.zeros(1, np.int64), np.zeros(1, np.int64), cache)
    cache.clear()


STALL_SECONDS = 0.05  # the batcher waits this long for a busy slot's next step before running without it
FINISH_REASONS = {"max_tokens": "length", "context full": "length", "end of generation token": "stop",
                  "stop string": "stop", "cancelled": "cancelled", "time limit": "length"}


class QueueFull(Exception):
    """Every slot is busy and the queue of waiting requests is full (HTTP 503 with Retry-After)."""


class SlotBusy(Exception):
    """A slot action asked of a slot that is serving a request."""


class Cancelled(Exception):
    """The client went away, or the server is shutting down: the slot stops before its next forward."""


class TimeLimit(Exception):
    """The request ran past the server's per-request time limit."""


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens and their log-probabilities


class RecordingSampler(Sampler):
    """A Sampler that keeps, for each token it hands out, its log-probability under the model (the
    log-softmax of the raw logits, as OpenAI reports) and the `top_n` most likely tokens'."""

    def __init__(self, params: SamplingParams, top_n: int | None):
        super().__init__(params)
        self.top_n = top_n
        self.records: list[TokenLogprob] = []

    def _record(self, logits, token: int) -> None:
        if self.top_n is None:
            return
        logits = np.asarray(logits, np.float64).reshape(-1)
        shifted = logits - logits.max()
        logprobs = shifted - np.log(np.exp(shifted).sum())
        top = np.argsort(-logprobs, kind="stable")[:self.top_n] if self.top_n else []
        self.records.append(TokenLogprob(int(token), float(logprobs[token]),
                                         [(int(t), float(logprobs[t])) for t in top]))

    def __call__(self, logits, history=()):
        token = super().__call__(logits, history)
        self._record(logits, token)
        return token

    def verify(self, logits, history, draft, draft_probs=None):
        token, kept = super().verify(logits, history, draft, draft_probs)
        self._record(logits, token)
        return token, kept


@dataclass
class Request:
    """One generation: its prompt ids and settings, and where its events go. `emit(kind, payload)` is called on
    the slot's thread: ("text", (piece, [TokenLogprob, ...])) while it runs, then once ("done", Result)."""

    ids: list[int]
    params: SamplingParams
    max_tokens: int
    stop: list[str]
    emit: Callable[[str, object], None]
    logprobs: int | None = None  # None: none; n: each token's and the n most likely
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass
class Result:
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    error: str | None = None


@dataclass
class Slot:
    id: int
    cache: object  # KVCache
    cached: list[int] = field(default_factory=list)  # the ids the cache holds: cached[:cache.n_past]
    request: Request | None = None
    n_prompt: int = 0
    n_decoded: int = 0
    last_used: float = 0.0  # when its last request ended (time.monotonic)
    drafter: object = None  # the slot's drafter, kept between requests (none for n-gram lookup)
    settled: tuple | None = None  # (ids, logits after them) where the cache was when its last stream ended
    wake: threading.Condition = field(default_factory=threading.Condition)

    @property
    def state(self) -> str:
        return "idle" if self.request is None else "processing"

    def held(self) -> list[int]:
        return self.cached[:self.cache.n_past]


@dataclass
class _Job:
    """A forward a slot waits on: a Segment for the batched decode (or, `prompt`, a prompt chunk's for a forward of
    the prompts waiting together), or `run` (a prompt chunk, a draft model's step) to run alone."""

    segment: Segment | None = None
    run: Callable | None = None
    prompt: bool = False
    result: object = None
    error: BaseException | None = None
    done: bool = False


@dataclass
class Counters:
    """Totals since start (the /metrics counters)."""

    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    tokens_predicted: int = 0
    predicted_seconds: float = 0.0
    decode_steps: int = 0  # batched forwards of the decode
    busy_slots_in_decode: int = 0  # summed over decode_steps: their mean is the batch size
    prompts_together: int = 0  # prompt chunks prefilled in a forward beside other prompts
    requests: int = 0
    requests_rejected: int = 0
    requests_cancelled: int = 0  # stopped early: the client went away, or shutdown
    cached_tokens: int = 0
    drafted: int = 0
    draft_accepted: int = 0


class Engine:
    def __init__(self, model, parallel: int = 1, queue_size: int = 16, time_limit: float | None = None):
        if parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {parallel}")
        self.model = model
        self.queue_size = queue_size
        self.time_limit = time_limit
        self.slots = [Slot(i, model.transformer.ops.new_cache(model.cfg, model.kv_spec)) for i in range(parallel)]
        rows = getattr(model.transformer.ops, "rows_independent_from", None)
        # prompt chunks of at least this many tokens prefill together (None: one by one)
        self._prompt_rows = None if rows is None or model.cfg.n_expert else rows
        self.counters = Counters()
        self.warm = threading.Event()  # set once the batcher has warmed the model up (warm_up)
        self._pending: list[Request] = []  # waiting for a slot
        self._lock = threading.Condition()  # guards slots' requests, _pending, _jobs, _busy
        self._jobs: list[_Job] = []
        self._busy = 0  # slot threads inside a request (each either computing briefly or waiting on a job)
        self._closing = False
        self._threads = [threading.Thread(target=self._slot_loop, args=(slot,), name=f"cupyllm-slot-{slot.id}",
                                          daemon=True) for slot in self.slots]
        self._threads.append(threading.Thread(target=self._batch_loop, name="cupyllm-batcher", daemon=True))
        for thread in self._threads:
            thread.start()
        self.warm.wait()  # (the batcher's warm_up: the weights ready before the first request)

    # --- requests ---------------------------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        """Queue `request` (QueueFull when every slot is busy and queue_size requests wait already)."""
        with self._lock:
            if self._closing:
                raise QueueFull("the server is shutting down")
            idle = any(slot.request is None for slot in self.slots)
            if not idle and len(self._pending) >= self.queue_size:
                self.counters.requests_rejected += 1
                raise QueueFull(f"all {len(self.slots)} slots are busy and {len(self._pending)} requests wait")
            self._pending.append(request)
            self.counters.requests += 1
            self._dispatch()

    @property
    def processing(self) -> int:
        return sum(slot.request is not None for slot in self.slots)

    @property
    def deferred(self) -> int:
        return len(self._pending)

    def _dispatch(self) -> None:
        """Give waiting requests to free slots, each to the one sharing the longest prefix, else the one used
        longest ago (keeping the caches of recent conversations for their next turn). Holds _lock."""
        while self._pending:
            free = [slot for slot in self.slots if slot.request is None]
            if not free:
                return
            request = self._pending.pop(0)
            if request.cancelled.is_set():
                request.emit("done", Result("cancelled", len(request.ids), 0, 0))
                continue
            slot = max(free, key=lambda s: (shared_prefix(s.held(), request.ids), -s.last_used, -s.id))
            slot.request = request
            self._busy += 1
            with slot.wake:
                slot.wake.notify()

    def close(self) -> None:
        """Cancel what runs and waits, and stop the threads."""
        with self._lock:
            self._closing = True
            for request in self._pending:
                request.emit("done", Result("cancelled", len(request.ids), 0, 0))
            self._pending.clear()
            for slot in self.slots:
                if slot.request is not None:
                    slot.request.cancel()
            self._lock.notify_all()
        for slot in self.slots:
            with slot.wake:
                slot.wake.notify()
        for thread in self._threads:
            thread.join(timeout=30)

    # --- a slot's thread --------------------------------------------------------------------------------
    def _slot_loop(self, slot: Slot) -> None:
        while True:
            with slot.wake:
                while slot.request is None and not self._closing:
                    slot.wake.wait()
            if slot.request is None:  # closing
                return
            request = slot.request
            try:
                result = self._serve(slot, request)
            except BaseException as exc:  # (a model error must not take the slot down with it)
                result = Result("error", len(request.ids), 0, slot.n_decoded, error=f"{type(exc).__name__}: {exc}")
            with self._lock:
                slot.request = None
                slot.last_used = time.monotonic()
                self._busy -= 1
                self._dispatch()
                self._lock.notify_all()
            request.emit("done", result)

    def _serve(self, slot: Slot, request: Request) -> Result:
        model, cache, ids = self.model, slot.cache, request.ids
        reused = self._reuse(slot, ids)
        slot.n_prompt, slot.n_decoded = len(ids), 0
        sampler = RecordingSampler(request.params, request.logprobs)
        stats = GenerationStats()
        spec = model.spec
        deadline = None if self.time_limit is None else request.submitted + self.time_limit

        def forward(tokens, positions, seq_cache, all_logits=False):
            if request.cancelled.is_set() or self._closing:
                raise Cancelled()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeLimit()
            tokens = np.asarray(tokens, np.int64)
            start = int(positions[0])
            slot.cached[start:] = tokens.tolist()  # what the cache holds from here on (n_past says how far)
            small = len(tokens) <= seq_cache.spec.max_chunk and (len(tokens) == 1 or all_logits)
            # (an MTP head reads the target's hidden rows: its slot's forwards run alone, through its drafter)
            target = getattr(drafter, "target_forward", None)
            if small and target is None:
                logits = self._wait(_Job(segment=Segment(tokens, seq_cache, all_logits)))
                return logits if all_logits else logits[-1:]
            rows = self._prompt_rows
            if (target is None and not all_logits and rows is not None and rows <= len(tokens)
                    <= seq_cache.spec.max_chunk and start == seq_cache.n_past):
                return self._wait(_Job(segment=Segment(tokens, seq_cache), prompt=True))
            return self._wait(_Job(run=lambda: (target or model._forward_numpy_graphed)(tokens, positions, seq_cache,
                                                                                         all_logits)))

        drafter = self._drafter(slot, spec)
        slot.settled = None

        def settled(held_ids, logits):  # (what a slot save writes; absent after an error inside the model)
            slot.settled = (list(held_ids), np.asarray(logits, np.float32).reshape(-1))

        pieces = generate_stream(forward, model.tokenizer, ids[reused:], cache, sampler, on_done=settled,
                                 max_tokens=request.max_tokens, stop=request.stop, chunk=model.kv_spec.max_chunk,
                                 stats=stats, progress=False, history=ids[:reused], drafter=drafter,
                                 draft_length=None if spec is None else DraftLength(spec.draft_max, spec.draft_min,
                                                                                    spec.adaptive))
        taken = 0
        reason = None
        t_decode = None
        try:
            for piece in pieces:
                if t_decode is None:
                    t_decode = time.perf_counter()
                records = sampler.records[taken:stats.generated_tokens]
                taken += len(records)
                slot.n_decoded = stats.generated_tokens
                request.emit("text", (piece, records))
                if request.cancelled.is_set():
                    reason = "cancelled"
                    break
        except Cancelled:
            reason = "cancelled"
        except TimeLimit:
            reason = "time limit"
        finally:
            pieces.close()
        eog = stats.stop_reason == "end of generation token"
        completion = stats.generated_tokens - (1 if eog and reason is None else 0)
        if reason is None:
            records = sampler.records[taken:completion]
            if records:  # (tokens whose text the stop matcher held back, then dropped)
                request.emit("text", ("", records))
        with self._lock:
            c = self.counters
            c.prompt_tokens += stats.prompt_tokens
            c.cached_tokens += reused
            c.prompt_seconds += stats.prefill_seconds
            c.tokens_predicted += stats.generated_tokens
            c.predicted_seconds += stats.decode_seconds
            c.requests_cancelled += reason == "cancelled"
            if stats.draft is not None:
                c.drafted += stats.draft.drafted
                c.draft_accepted += stats.draft.accepted
        return Result(FINISH_REASONS[reason or stats.stop_reason], len(ids), reused, max(completion, 0))

    # --- saved slots (llama-server's POST /slots/{id}?action=save|restore|erase) ---------------------------
    # Each runs as a job on the batcher's thread (the one that touches caches on the device), holding _lock so
    # that no request is given to the slot meanwhile.
    def save_slot(self, slot_id: int, path) -> int:
        """Write what the idle slot's cache holds to `path` as a prompt cache; the tokens written."""
        def copy() -> PromptCache:
            with self._lock:
                slot = self._idle_slot(slot_id)
                held = slot.held()
                if not held or slot.settled is None or slot.settled[0] != held:
                    raise InputError(f"slot {slot_id} holds no finished generation to save")
                return PromptCache(ids=tuple(held), layer_states=slot.cache.state(), logits=slot.settled[1],
                                   key=self.model.prompt_cache_key())

        saved = self._slot_job(copy)
        saved.save(path)  # (state() copied the arrays: the slot may serve again meanwhile)
        return len(saved.ids)

    def restore_slot(self, slot_id: int, path) -> int:
        """Fill the idle slot's cache from a prompt-cache file of this model and settings; the tokens read."""
        saved = PromptCache.load(path)
        self.model.check_prompt_cache(saved)

        def restore() -> int:
            with self._lock:
                slot = self._idle_slot(slot_id)
                slot.cache.restore(saved.layer_states, len(saved.ids))
                slot.cached = list(saved.ids)
                slot.settled = (list(saved.ids), saved.logits)
                slot.last_used = time.monotonic()
            return len(saved.ids)

        return self._slot_job(restore)

    def erase_slot(self, slot_id: int) -> int:
        """Empty the idle slot's cache; the tokens it held."""
        def erase() -> int:
            with self._lock:
                slot = self._idle_slot(slot_id)
                n = len(slot.held())
                slot.cache.clear()
                slot.cached, slot.settled = [], None
            return n

        return self._slot_job(erase)

    def _slot_job(self, action: Callable):
        with self._lock:
            if self._closing:
                raise SlotBusy("the server is shutting down")
        return self._wait(_Job(run=action))

    def _idle_slot(self, slot_id: int) -> Slot:
        """The slot `slot_id`, which must be idle (holds _lock)."""
        if not 0 <= slot_id < len(self.slots):
            raise InputError(f"no slot {slot_id}: this server has slots 0 .. {len(self.slots) - 1}")
        slot = self.slots[slot_id]
        if slot.request is not None:
            raise SlotBusy(f"slot {slot_id} is serving a request; retry when it is idle")
        return slot

    def _reuse(self, slot: Slot, ids: Sequence[int]) -> int:
        """Keep the part of the slot's cache that `ids` starts with (at least one prompt token is left to run:
        its logits start the generation); the number of prompt tokens not prefilled again."""
        cache = slot.cache
        keep = min(shared_prefix(slot.held(), ids), len(ids) - 1)
        if keep <= 0 or not cache.truncate(keep):  # (a sliding window's ring may have lost keys before keep)
            cache.clear()
            keep = 0
        del slot.cached[keep:]
        return keep

    def _drafter(self, slot: Slot, spec):
        """The slot's drafter of `spec` (speculative/factory.py): kept in the slot between requests (a draft
        cache or head cache per slot), its own forwards run on the batcher's thread, one by one."""
        if spec is None or spec.type == "ngram":
            return drafter_for(spec, self.model)
        slot.drafter = drafter_for(spec, self.model, kept=slot.drafter,
                                   execute=lambda work: self._wait(_Job(run=work)))
        return slot.drafter

    # --- the batcher ------------------------------------------------------------------------------------
    def _wait(self, job: _Job):
        with self._lock:
            self._jobs.append(job)
            self._lock.notify_all()
            while not job.done:
                self._lock.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def _batch_loop(self) -> None:
        try:
            if self.model.device == "cpu":
                start_cpu_threads()  # (before anything else runs here: see its docstring)
                try:  # (the constructor waits for this: no request can reach slot 0's cache meanwhile)
                    warm_up(self.model, self.slots[0].cache)
                except Exception as exc:  # noqa: BLE001 - a request then fails with the model's own error
                    print(f"cupyllm serve: the warm-up forward failed ({type(exc).__name__}: {exc})",
                          file=sys.stderr, flush=True)
                    self.slots[0].cache.clear()
        finally:
            self.warm.set()
        while True:
            with self._lock:
                # run when every busy slot waits on a job (a slot between jobs samples its next token: briefly);
                # after STALL_SECONDS with some waiting, run those rather than idle
                while True:
                    if self._jobs and len(self._jobs) >= self._busy:
                        break
                    if self._closing and not self._jobs and self._busy == 0:
                        return
                    if self._jobs:
                        if not self._lock.wait(timeout=STALL_SECONDS):
                            break
                    else:
                        self._lock.wait(timeout=1.0 if self._closing else None)
                jobs, self._jobs = self._jobs, []
            self._run(jobs)
            with self._lock:
                for job in jobs:
                    job.done = True
                self._lock.notify_all()

    def _run(self, jobs: list[_Job]) -> None:
        segments = [job for job in jobs if job.segment is not None and not job.prompt]
        model = self.model
        with model.transformer.ops.running_on(model.threads):
            self._forward_together(segments)
            if segments:
                self.counters.decode_steps += 1
                self.counters.busy_slots_in_decode += len(segments)
            prompts = [job for job in jobs if job.prompt]
            self._forward_together(prompts)
            if len(prompts) > 1:
                self.counters.prompts_together += len(prompts)
            for job in jobs:
                if job.run is not None:
                    self._call(job, job.run)

    def _forward_together(self, jobs: list[_Job]) -> None:
        """One forward for the jobs' segments: one alone as the model's own forward runs it, several through
        forward_batch (each segment's values as alone). A segment its cache has no room for fails alone, before
        anything runs, not the forward of the others."""
        model = self.model
        room = []
        for job in jobs:
            try:
                job.segment.cache.check_room(len(job.segment.tokens))
                room.append(job)
            except ContextOverflowError as exc:
                job.error = exc
        jobs = room
        if len(jobs) == 1:
            job = jobs[0]
            s = job.segment
            self._call(job, lambda: model._forward_numpy_graphed(
                s.tokens, np.arange(s.cache.n_past, s.cache.n_past + len(s.tokens)), s.cache, all_logits=s.all_logits))
        elif jobs:
            try:
                for job, logits in zip(jobs, forward_batch(model.transformer, [job.segment for job in jobs])):
                    job.result = logits
            except BaseException as exc:
                for job in jobs:
                    job.error = exc

    @staticmethod
    def _call(job: _Job, fn) -> None:
        try:
            job.result = fn()
        except BaseException as exc:
            job.error = exc
