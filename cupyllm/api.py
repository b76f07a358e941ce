"""The Python face of cupyllm:

    import cupyllm
    model = cupyllm.load()                       # the default model (Gemma 3 270M), CPU or GPU
    print(model.generate("Why is the sky blue?", max_tokens=64))
    logits = model.logits(model.tokenize("Hello"))
"""
from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from .ops.attention.dca import DCAConfig
from .backend import select_backend
from .files.chat import encode_chat
from .files.config import ModelConfig, config_from_gguf
from .errors import BudgetError, ContextPastTrainingWarning, CupyllmError
from .generate import GenerationStats, generate_stream, prefill
from .files.gguf import GGUFFile, read_gguf
from .kv.cache import KVCache, KVSpec, host_bytes_available
from .ops.kv_formats.formats import get_format
from .kv.plan import TIERS, KVPlan, SpillPlan, check_budget, parse_bytes, plan_kv, plan_spill
from .files.model_store import default_model_path
from .models.build import Transformer
from .models.layers import dca_attention
from .kv.prompt_cache import PromptCache
from .sampling import Sampler, SamplingParams
from .files.tokenizer import Tokenizer

DEFAULT_CTX = 4096


@dataclass
class Model:
    path: Path
    gguf: GGUFFile
    cfg: ModelConfig
    tokenizer: Tokenizer
    transformer: Transformer
    kv_spec: KVSpec
    device: str
    kv_plan: KVPlan | None = None  # how kv_type_k/v="auto" chose the cache formats
    spill_plan: SpillPlan | None = None  # kv_spill: which positions live on the host
    dca: DCAConfig | None = None  # Dual Chunk Attention, when on
    threads: int | None = None  # CPU threads of the parallel work (None: every core)
    last_stats: GenerationStats = field(default_factory=GenerationStats)
    last_prompt_cache: PromptCache | None = None  # generate(keep_cache=True): the prompt's and reply's cache
    _cache: KVCache | None = field(default=None, repr=False)
    _cache_holds: PromptCache | None = field(default=None, repr=False)  # the working cache holds exactly this one

    # --- text <-> ids -----------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool | None = None) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_bos)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def chat_ids(self, messages: Sequence[dict] | str, chat_template_kwargs: dict | None = None) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template, ready for generation;
        chat_template_kwargs: variables the template reads (e.g. {"enable_thinking": False} for Qwen3 / Gemma 4)."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return encode_chat(self.tokenizer, self.gguf.metadata, list(messages), **(chat_template_kwargs or {}))

    # --- compute ----------------------------------------------------------------------------------
    def new_cache(self) -> KVCache:
        """An empty KV cache for this model (reused between calls: allocated once per model)."""
        if self._cache is None:
            self._cache = self.transformer.ops.new_cache(self.cfg, self.kv_spec)
        self._cache.clear()
        self._cache_holds = None
        return self._cache

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """float32 [len(ids), n_vocab]: the logits at every position of one fresh sequence."""
        if len(ids) == 0:
            raise CupyllmError("logits() needs at least one token id")
        cache = self.new_cache()
        return prefill(self._forward_numpy, ids, cache, self.kv_spec.max_chunk, all_logits=True)

    def generate(self, prompt: str | Sequence[int] | Sequence[dict], max_tokens: int = 256, temperature: float = 0.8,
                 top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0,
                 seed: int | None = None, stop: Sequence[str] | str | None = None, stream: bool = False,
                 chat: bool = False, chat_template_kwargs: dict | None = None,
                 progress: bool | None = None, prompt_cache: PromptCache | None = None,
                 keep_cache: bool = False) -> str | Iterator[str]:
        """Continue `prompt` (text, token ids, or with chat=True a message or list of messages, rendered with
        `chat_template_kwargs`). Returns the text, or with stream=True an iterator of text pieces. Stats land
        in `last_stats`. max_tokens=-1 generates until end of generation, a stop string or a full context.
        prompt_cache: a cache_prompt() result; the tokens `prompt` shares with its prompt are not prefilled again.
        keep_cache: when the text is done (or the stream closed), `last_prompt_cache` holds the cache of the
        prompt and the reply: the next turn of a conversation prefills only what follows the reply."""
        ids = self._prompt_ids(prompt, chat, chat_template_kwargs)
        self.last_prompt_cache = None
        sampler = Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                         repeat_penalty=repeat_penalty, seed=seed))
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        self.last_stats = GenerationStats()
        cache, reused, logits = self._cache_holding_prefix(ids, prompt_cache)
        self.last_stats.cached_tokens = reused
        def keep(held_ids: list[int], held_logits) -> None:
            self.last_prompt_cache = self._snapshot(cache, held_ids, held_logits, reused)

        pieces = generate_stream(self._forward_numpy_graphed, self.tokenizer, ids[reused:], cache, sampler,
                                 max_tokens=max_tokens, stop=stops, chunk=self.kv_spec.max_chunk,
                                 stats=self.last_stats, progress=progress, history=ids[:reused], logits=logits,
                                 on_done=keep if keep_cache else None)
        return pieces if stream else "".join(pieces)

    # --- prompt caching (kv/prompt_cache.py) ---------------------------------------------------------
    def cache_prompt(self, prompt: str | Sequence[int] | Sequence[dict], *, chat: bool = False,
                     chat_template_kwargs: dict | None = None, reuse: PromptCache | None = None,
                     progress: bool | None = None) -> PromptCache:
        """Prefill `prompt` once and keep its KV cache (host copies): generate(..., prompt_cache=it), or
        cache_prompt(..., reuse=it), then prefill only what follows the tokens they share. `reuse` may hold a
        cache of an earlier, related prompt (its shared beginning is not prefilled again)."""
        ids = self._prompt_ids(prompt, chat, chat_template_kwargs)
        if reuse is not None and tuple(ids) == reuse.ids:  # the very same prompt: nothing to run or copy
            self._check_prompt_cache(reuse)
            same = dataclasses.replace(reuse, reused=len(ids))
            if self._cache_holds is reuse:
                self._cache_holds = same
            return same
        cache, reused, _ = self._cache_holding_prefix(ids, reuse)
        logits = prefill(self._forward_numpy, ids[reused:], cache, self.kv_spec.max_chunk, progress=progress)
        return self._snapshot(cache, ids, logits, reused)

    def _snapshot(self, cache: KVCache, ids: Sequence[int], logits, reused: int) -> PromptCache:
        """The PromptCache of what the working cache holds now (`ids`, the logits after them), marked as held."""
        self._cache_holds = PromptCache(ids=tuple(ids), layer_states=cache.state(),
                                        logits=np.asarray(logits, np.float32).reshape(-1),
                                        key=self.prompt_cache_key(), reused=reused)
        return self._cache_holds

    def prompt_cache_key(self) -> dict:
        """What a PromptCache of this model is valid for: the model file, the device, the KV spec and DCA."""
        return {"model": self.path.name, "model_bytes": self.path.stat().st_size, "device": self.device,
                "kv_spec": dataclasses.asdict(self.kv_spec), "dca": dataclasses.asdict(self.dca) if self.dca else None}

    def _cache_holding_prefix(self, ids: list[int], prompt_cache: PromptCache | None):
        """The working cache holding the first `reused` of `ids` from prompt_cache, and the logits after all of
        ids when it holds every one (else None). The caller changes the working cache from here on."""
        held = prompt_cache is not None and prompt_cache is self._cache_holds  # (cache_prompt, keep_cache)
        if held:
            cache, self._cache_holds = self._cache, None
        else:
            cache = self.new_cache()
        if prompt_cache is None:
            return cache, 0, None
        self._check_prompt_cache(prompt_cache)
        shared = prompt_cache.shared_prefix(ids)
        if shared == 0:
            if held:  # (new_cache cleared it otherwise)
                cache.clear()
            return cache, 0, None
        if not held:  # (held: the working cache is that very cache already, nothing to copy)
            cache.restore(prompt_cache.layer_states, len(prompt_cache.ids))
        if shared == len(ids) == len(prompt_cache.ids):
            return cache, shared, prompt_cache.logits
        keep = min(shared, len(ids) - 1)  # at least one token runs: its logits start the generation
        if not cache.truncate(keep):  # a sliding window's keys before `keep` are gone: start afresh
            cache.clear()
            return cache, 0, None
        return cache, keep, None

    def _check_prompt_cache(self, prompt_cache: PromptCache) -> None:
        if prompt_cache.key != self.prompt_cache_key():
            raise CupyllmError("this prompt cache was made by another model or with other settings (KV types, ctx, "
                               "chunk, DCA, device); make it again with cache_prompt()")

    def _prompt_ids(self, prompt, chat: bool, chat_template_kwargs: dict | None) -> list[int]:
        if chat:
            ids = self.chat_ids(prompt, chat_template_kwargs)
        elif isinstance(prompt, str):
            ids = self.tokenize(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise CupyllmError("the prompt is empty and the model adds no BOS token; give some prompt text")
        return ids

    def _forward_numpy(self, tokens, positions, cache, all_logits=False):
        with self.transformer.ops.running_on(self.threads):
            out = self.transformer.forward(tokens, positions, cache, all_logits)
            return np.asarray(self.transformer.ops.to_numpy(out), dtype=np.float32)

    @functools.cached_property
    def _decode_forward(self):
        """The forward pass with one-token steps replayed as CUDA graphs on the GPU (unchanged on the CPU, and where
        a step needs the host: a mixture of experts routes there, a spilled cache copies rows both ways)."""
        if self.kv_spec.spilled or any(layer.moe is not None for layer in self.transformer.layers):
            return self.transformer.forward
        return self.transformer.ops.decode_forward(self.transformer.forward)

    def _forward_numpy_graphed(self, tokens, positions, cache, all_logits=False):
        with self.transformer.ops.running_on(self.threads):
            out = self._decode_forward(tokens, positions, cache, all_logits)
            return np.asarray(self.transformer.ops.to_numpy(out), dtype=np.float32)


def load(model: str | os.PathLike | None = None, *, device: str = "auto", ctx: int | None = None,
         kv_type_k: str = "f16", kv_type_v: str = "f16", max_chunk: int = 512, dca: bool | dict | None = None,
         kv_normalize_k: bool | None = None, kv_budget: int | str | None = None, kv_spill: bool = False,
         kv_mirror: bool | None = None, threads: int | None = None, progress: bool = True, **options) -> Model:
    """Load a GGUF model (None: the default model, Gemma 3 270M Q4_K_M from its PyPI package).

    device: "auto" (GPU when CuPy sees one, else CPU), "cpu" or "gpu". ctx: KV positions to hold (default 4096, or
         the trained context when that is shorter; past the trained context, without dca, load warns).
    kv_type_k / kv_type_v: KV-cache formats (f16, q8_0, ..., turbo3, turbo3_tcq; see cupyllm.kv.list_formats()),
         or both "auto": the best tier of the measured quality ladder (kv/plan.py) whose cache fits `kv_budget`
         (default: the memory free after the weights load, less 10%).
    kv_budget: bytes the KV cache may take (a number or text such as "6GiB"); with explicit types, a cache that
         would exceed it is a BudgetError before anything is allocated.
    kv_spill: (GPU) a cache over the budget keeps only its newest positions on the device and the rest in pinned
         host memory, attention streaming over both (kv/plan.py plan_spill, kv/gpu_spill.py); with "auto"
         types, the smallest tier spills when no tier fits whole.
    kv_mirror: (CPU) also keep a float32 copy of the decoded cache, which kv_budget and the "auto" types then
         count: 4 more bytes per value whatever the KV type, so that decode steps read it instead of decoding
         the rows: faster with the rotated formats, not with f16 or q8_0 (docs/kv-formats.md). Default: no copy, the cache
         takes its format's bytes and decode steps read the encoded rows (ops/attention/cpu.py). The GPU keeps
         no copy (True there is an error).
    threads: CPU threads for the CPU backend's matmuls, attention and BLAS (llama.cpp's -t; default: every core).
    dca: Dual Chunk Attention for contexts past the trained length: True (chunk_size = trained context,
         local_size = chunk_size / 32) or {"chunk_size": S, "local_size": W, "yarn_factor": f}.
    kv_normalize_k: store K normalised per channel, (K - mean) / sqrt(RMS of K / RMS of Q) from the first
         prompt chunk (KVSpec.normalize_k, kv.cache.key_normalization). None (default): on for quantized K
         formats, off for f16/bf16/f32. Much better quantized K where some channels of K have large offsets
         or spreads (bench/results/kv_quality.md).
    """
    if options:
        raise TypeError(f"unknown option(s) for cupyllm.load: {', '.join(sorted(options))}")
    if ctx is not None and ctx <= 0:
        raise CupyllmError(f"ctx must be a positive number of tokens, got {ctx}")
    if threads is not None:
        import numba
        if not 1 <= threads <= numba.config.NUMBA_NUM_THREADS:
            raise CupyllmError(f"threads={threads}: choose 1 .. {numba.config.NUMBA_NUM_THREADS} (the CPU threads "
                               "this machine offers)")
    path = Path(model) if model is not None else default_model_path()
    gguf = read_gguf(path)
    cfg = config_from_gguf(gguf)
    ctx = min(DEFAULT_CTX, cfg.ctx_train) if ctx is None else ctx
    auto = "auto" in (kv_type_k, kv_type_v)
    if auto and kv_type_k != kv_type_v:
        raise CupyllmError("kv_type_k='auto' picks K and V together: pass kv_type_v='auto' too (-ctk auto -ctv auto)")
    for head_dim in sorted(cfg.head_dims()) if not auto else ():  # an unknown or unfit type fails before loading
        get_format(kv_type_k, head_dim=head_dim)
        get_format(kv_type_v, head_dim=head_dim)
    budget = parse_bytes(kv_budget) if kv_budget is not None else None
    backend = select_backend(device, threads=threads)
    if kv_mirror and not backend.can_mirror_kv:
        raise CupyllmError(f"kv_mirror=True (--kv-mirror) keeps a float32 copy of the KV cache for the CPU backend; "
                           f"on the {backend.name} the kernels read the encoded cache and keep none: drop it")
    mirror = bool(kv_mirror)
    tokenizer = Tokenizer.from_metadata(gguf.metadata)
    dca_cfg = _dca_config(dca, cfg)
    if dca_cfg is None and ctx > cfg.ctx_train:
        warnings.warn(f"ctx {ctx} is past the {cfg.ctx_train} positions this model was trained on; beyond them "
                      "attention meets distances it never saw and retrieval fails (bench/results/niah.md); pass "
                      "dca=True (--dca) to keep every query-key distance in the trained range",
                      ContextPastTrainingWarning, stacklevel=2)
    transformer = Transformer.from_gguf(gguf, backend, progress=progress)
    if dca_cfg is not None:
        transformer.attention = dca_attention(dca_cfg)
    if kv_spill and backend.name != "gpu":
        raise CupyllmError("kv_spill (--kv-spill) moves KV rows from GPU memory to the host; on the CPU the whole "
                           "cache is in host memory already")
    if auto or kv_spill:
        budget = budget if budget is not None else int(0.9 * backend.memory_available())
    kv_type_k, kv_type_v, kv_plan, spill_plan, spec = _fit_cache(
        cfg, ctx, kv_type_k, kv_type_v, budget, auto=auto, spill=kv_spill, mirror=mirror, max_chunk=max_chunk,
        normalize_k=kv_normalize_k, float_mirror=mirror)
    return Model(path=path, gguf=gguf, cfg=transformer.cfg, tokenizer=tokenizer, transformer=transformer,
                 kv_spec=spec, device=backend.name, kv_plan=kv_plan, spill_plan=spill_plan, dca=dca_cfg,
                 threads=threads)


def _fit_cache(cfg: ModelConfig, ctx: int, kv_type_k: str, kv_type_v: str, budget: int | None, *, auto: bool,
               spill: bool, mirror: bool, max_chunk: int, normalize_k: bool | None, float_mirror: bool | None):
    """(kv_type_k, kv_type_v, kv_plan, spill_plan, spec) of a cache within `budget` (None: no budget): "auto"
    types planned (kv/plan.py), given ones checked, spilled to the host when asked and needed. BudgetError when
    it cannot fit."""
    kv_plan = spill_plan = None
    if auto:
        try:
            kv_plan = plan_kv(cfg, ctx, budget, mirror=mirror, max_chunk=max_chunk, normalize_k=normalize_k)
            kv_type_k, kv_type_v = kv_plan.tier.kv_type_k, kv_plan.tier.kv_type_v
        except BudgetError:
            if not spill:
                raise
            kv_type_k, kv_type_v = TIERS[-1].kv_type_k, TIERS[-1].kv_type_v  # keeps the most positions on the device
    spec = KVSpec(ctx=ctx, kv_type_k=kv_type_k, kv_type_v=kv_type_v, max_chunk=max_chunk, normalize_k=normalize_k,
                  float_mirror=float_mirror)
    if budget is not None and kv_plan is None:
        try:
            check_budget(cfg, spec, budget, mirror=mirror)
        except BudgetError:
            if not spill:
                raise
            spill_plan = plan_spill(cfg, spec, budget, host_available=host_bytes_available())
            spec = spill_plan.spec
    return kv_type_k, kv_type_v, kv_plan, spill_plan, spec


def _dca_config(dca, cfg: ModelConfig) -> DCAConfig | None:
    if dca is None or dca is False:
        return None
    if dca is True:
        return DCAConfig.for_model(cfg.ctx_train)
    if isinstance(dca, DCAConfig):
        return dca
    unknown = set(dca) - {"chunk_size", "local_size", "yarn_factor"}
    if unknown:
        raise CupyllmError(f"unknown DCA option(s) {sorted(unknown)}; use chunk_size, local_size, yarn_factor")
    return DCAConfig.for_model(cfg.ctx_train, dca.get("chunk_size"), dca.get("local_size"), dca.get("yarn_factor", 1.0))
