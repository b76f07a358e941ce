"""The Python face of cupyllm:

    import cupyllm
    model = cupyllm.load()                       # the default model (Gemma 3 270M), CPU or GPU
    print(model.generate("Why is the sky blue?", max_tokens=64))
    logits = model.logits(model.tokenize("Hello"))
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from .ops.attention.dca import DCAConfig
from .backend import select_backend
from .files.chat import base_model_note, encode_chat
from .files.config import ModelConfig, config_from_gguf
from .errors import BudgetError, ContextOverflowError, ContextPastTrainingWarning, CupyllmError, InputError
from .generate import GenerationStats, check_max_tokens, generate_stream, prefill
from .files.gguf import GGUFFile, read_gguf
from .kv.cache import KVCache, KVSpec, RecurrentState, host_bytes_available
from .ops.kv_formats.formats import get_format
from .kv.plan import (TIERS, KVPlan, SpillPlan, check_budget, check_memory, floor_tail, parse_bytes, plan_kv,
                      plan_spill)
from .files.model_store import default_model_path
from .models.build import Transformer
from .models.layer_plan import LayerBlocks, boundary_warning, describe, parse_repeat_layers, planned_config
from .models.layers import dca_attention
from .kv.prompt_cache import PromptCache, layer_state_problem, shared_prefix
from .kv.shift import ContextShift
from .kv.spill_cost import best_tier_fits_whole, check_max_slowdown, measure_spill_rates, plan_spill_tier
from .sampling import Sampler, SamplingParams
from .files.tokenizer import Tokenizer
from .speculative import DraftLength, SpecConfig, check_same_vocabulary, spec_config
from .speculative.factory import drafter_for
from .speculative.gemma4_assistant import Gemma4Assistant, is_assistant
from .speculative.mtp import check_mtp_file

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
    spec: SpecConfig | None = None  # speculative decoding of every generate() (None: off)
    draft: "Model | Gemma4Assistant | None" = None  # the draft model of spec type "draft" (or "assistant")
    repeat_layers: LayerBlocks = ()  # blocks of stored layers the stack runs twice (models/layer_plan.py)
    last_stats: GenerationStats = field(default_factory=GenerationStats)
    last_prompt_cache: PromptCache | None = None  # generate(keep_cache=True): the prompt's and reply's cache
    _cache: KVCache | None = field(default=None, repr=False)
    _cache_holds: PromptCache | None = field(default=None, repr=False)  # the working cache holds exactly this one
    _warned_base_chat: bool = field(default=False, repr=False)  # chat on a base model: said once
    _model_drafters: dict = field(default_factory=dict, repr=False)  # spec type -> its drafter (cache kept)

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
        ids = encode_chat(self.tokenizer, self.gguf.metadata, list(messages), **(chat_template_kwargs or {}))
        note = None if self._warned_base_chat else base_model_note(self.gguf.metadata, self.path.name)
        if note is not None:
            self._warned_base_chat = True
            warnings.warn(note, UserWarning, stacklevel=3)
        return ids

    # --- compute ----------------------------------------------------------------------------------
    def new_cache(self) -> KVCache:
        """An empty KV cache for this model (reused between calls: allocated once per model)."""
        self._working_cache().clear()
        self._cache_holds = None
        return self._cache

    def _working_cache(self) -> KVCache:
        """The cache generation works in, allocated on first use, as it is."""
        if self._cache is None:
            self._cache = self.transformer.ops.new_cache(self.cfg, self.kv_spec)
        return self._cache

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """float32 [len(ids), n_vocab]: the logits at every position of one fresh sequence."""
        if len(ids) == 0:
            raise InputError("logits() needs at least one token id")
        ids = self._prompt_ids(ids, chat=False, chat_template_kwargs=None)  # (checks each id)
        cache = self.new_cache()
        return prefill(self._forward_numpy, ids, cache, self.kv_spec.max_chunk, all_logits=True)

    def token_nll(self, ids: Sequence[int], chunk: int | None = None) -> np.ndarray:
        """float64 [len(ids) - 1]: -log p(ids[t + 1] | ids[:t + 1]) of one fresh sequence (perplexity: the exp of
        its mean), run in chunks of `chunk` tokens (default: the prefill chunk, at most 64) so that no more than one
        chunk's logits are held (64 rows of a 262k vocabulary: 67 MB)."""
        if len(ids) < 2:
            raise InputError("token_nll() needs at least two token ids")
        ids = self._prompt_ids(ids, chat=False, chat_template_kwargs=None)
        chunk = chunk or min(self.kv_spec.max_chunk, 64)
        cache, nll = self.new_cache(), []
        for start in range(0, len(ids) - 1, chunk):
            part = ids[start:start + chunk]
            logits = prefill(self._forward_numpy, part, cache, chunk, all_logits=True)
            targets = np.asarray(ids[start + 1:start + 1 + len(part)])
            logits = logits[:len(targets)]
            top = logits.max(axis=-1, keepdims=True)
            log_z = np.log(np.exp(logits - top).sum(axis=-1, dtype=np.float64)) + top[:, 0]
            nll.append(log_z - logits[np.arange(len(targets)), targets])
        return np.concatenate(nll)

    def generate(self, prompt: str | Sequence[int] | Sequence[dict], max_tokens: int = 256, temperature: float = 0.8,
                 top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0,
                 seed: int | None = None, stop: Sequence[str] | str | None = None, stream: bool = False,
                 chat: bool = False, chat_template_kwargs: dict | None = None,
                 progress: bool | None = None, prompt_cache: PromptCache | None = None,
                 keep_cache: bool = False, spec: SpecConfig | dict | str | bool | None = None,
                 context_shift: bool = False, keep: int = 0, discard: int = 0) -> str | Iterator[str]:
        """Continue `prompt` (text, token ids, or with chat=True a message or list of messages, rendered with
        `chat_template_kwargs`). Returns the text, or with stream=True an iterator of text pieces. Stats land
        in `last_stats`. max_tokens=-1 generates until end of generation, a stop string or a full context.
        prompt_cache: a cache_prompt() result; the tokens `prompt` shares with its prompt are not prefilled again.
        keep_cache: when the text is done (or the stream closed), `last_prompt_cache` holds the cache of the
        prompt and the reply: the next turn of a conversation prefills only what follows the reply.
        spec: speculative decoding for this call (cupyllm.speculative.SpecConfig, a dict of its fields, or a type:
        "ngram", "draft", "self"); None: load()'s; False: none. The text is the one plain decoding gives (the same
        tokens when greedy, the same distribution when sampling), sooner where drafts are kept; the counts land
        in last_stats.draft.
        context_shift: when the reply fills the context, forget `discard` positions after the first `keep` prompt
        tokens (the first token is kept besides: BOS as llama.cpp keeps it; keep=-1: the whole prompt; discard=0: half
        of what is not kept), re-rope the rest and go on (kv/shift.py; docs/context-shift.md): max_tokens alone
        ends the reply. last_stats.context_shifts counts the shifts. Off by default: a full context ends the
        reply ("context full"). Not for hybrid models (Qwen3.5's recurrent states cannot forget a span)."""
        # every argument is checked before anything runs or changes (the CLI echoes the prompt after this returns)
        max_tokens = check_max_tokens(max_tokens)
        sampler = Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                         repeat_penalty=repeat_penalty, seed=seed))
        spec = self.spec if spec is None else (None if spec is False else spec_config(spec))
        self._check_spec(spec)
        ids = self._prompt_ids(prompt, chat, chat_template_kwargs)
        shift = self._context_shift(ids, keep, discard) if context_shift else None
        need = len(ids) + (1 if max_tokens != 0 else 0)  # the first generated token needs its position
        if need > self.kv_spec.ctx:
            raise ContextOverflowError(f"the prompt's {len(ids)} tokens{' and one generated' * (max_tokens != 0)} "
                                       f"exceed the context of {self.kv_spec.ctx} tokens; raise -c/--ctx (ctx=...) "
                                       "or shorten the prompt")
        if prompt_cache is not None:
            self.check_prompt_cache(prompt_cache)
        self.last_prompt_cache = None
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        self.last_stats = GenerationStats()
        cache, reused, logits = self._cache_holding_prefix(ids, prompt_cache)
        self.last_stats.cached_tokens = reused
        def keep_reply(held_ids: list[int], held_logits) -> None:  # (keep_cache; `keep` is context shift's)
            self.last_prompt_cache = self._snapshot(cache, held_ids, held_logits, reused)

        drafter = self._drafter(spec)
        # (a drafter reading the target's hidden states runs the target's forward, keeping them: the same logits)
        forward = getattr(drafter, "target_forward", None) or self._forward_numpy_graphed
        pieces = generate_stream(forward, self.tokenizer, ids[reused:], cache, sampler,
                                 max_tokens=max_tokens, stop=stops, chunk=self.kv_spec.max_chunk,
                                 stats=self.last_stats, progress=progress, history=ids[:reused], logits=logits,
                                 on_done=keep_reply if keep_cache else None, drafter=drafter,
                                 draft_length=None if spec is None else DraftLength(spec.draft_max, spec.draft_min,
                                                                                    spec.adaptive),
                                 checkpoint_at=self._turn_start(prompt, ids, chat, chat_template_kwargs),
                                 context_shift=shift)
        return pieces if stream else "".join(pieces)

    def _context_shift(self, ids: list[int], keep: int, discard: int) -> ContextShift:
        """generate()'s context-shift policy for the prompt `ids`: `keep` tokens after the first, which always
        stays (llama.cpp keeps n_keep + its BOS; a model without BOS, Qwen, needs its first token kept as well:
        it is the attention sink, and text collapses once it is dropped); -1: the whole prompt."""
        for name, value, low in (("keep", keep, -1), ("discard", discard, 0)):
            if not (_is_count(value) and value >= low):
                raise InputError(f"{name} (--{name}) must be a count >= {low}, got {value!r}")
        keep = len(ids) if keep < 0 else min(keep + 1, len(ids))
        return ContextShift(self.cfg, keep=keep, discard=int(discard), dca=self.dca)

    def _turn_start(self, prompt, ids: list[int], chat: bool, chat_template_kwargs: dict | None) -> list[int]:
        """Where a hybrid model's chat prompt leaves the conversation for the generation prompt, as a checkpoint
        position (the next turn renders this reply back after it, without its thought, so its prompt departs from
        this one there: the recurrent states go back to here, not to the start). [] for other models."""
        if not chat or self.cfg.ssm is None:
            return []
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        closed = encode_chat(self.tokenizer, self.gguf.metadata, messages, add_generation_prompt=False,
                             **(chat_template_kwargs or {}))
        return [shared_prefix(closed, ids)]

    # --- speculative decoding (cupyllm/speculative) ---------------------------------------------------
    def _check_spec(self, spec: SpecConfig | None) -> None:
        if spec is not None and spec.type == "draft" and self.draft is None:
            raise InputError("spec type 'draft' needs a draft model: load(..., draft_model=PATH) "
                             "(-md/--model-draft FILE)")
        if spec is not None and spec.type in ("assistant", "draft") and \
                (spec.type == "assistant") != isinstance(self.draft, Gemma4Assistant):
            wanted = "a Gemma 4 assistant" if spec.type == "assistant" else "a draft model"
            raise InputError(f"spec type '{spec.type}' needs {wanted} as load()'s draft_model (-md FILE); this model "
                             f"was loaded with {'none' if self.draft is None else 'the other kind'}")
        if spec is not None and spec.type == "mtp":
            check_mtp_file(self.gguf, self.transformer.stored.cfg)

    def _drafter(self, spec: SpecConfig | None):
        """The drafter of `spec` (speculative/factory.py): a fresh n-gram index; the others made once and kept
        between calls (a draft model's or this model's second cache: a conversation's next turn drafts after
        running only what is new)."""
        if spec is None or spec.type == "ngram":
            return drafter_for(spec, self)
        self._model_drafters[spec.type] = drafter_for(spec, self, kept=self._model_drafters.get(spec.type))
        return self._model_drafters[spec.type]

    def _without_layer_plan(self) -> "Model":
        """This model as its file stores it, sharing the weights (a drafter never runs the layer plan: with one,
        self-drafting drafts with the stored layers alone, fewer than the stack's)."""
        return dataclasses.replace(self.with_layer_plan(None), spec=None, draft=None) if self.repeat_layers else self

    def with_layer_plan(self, repeat_layers: str | Sequence[Sequence[int]] | None) -> "Model":
        """This model running another layer plan (load()'s repeat_layers; None or "": each stored layer once),
        its weights shared: no reload. The new plan's cache must fit the memory there is (BudgetError)."""
        stored = self.transformer.stored
        blocks = parse_repeat_layers(repeat_layers, stored.cfg.n_layer)
        transformer = stored.with_layer_plan(blocks)
        if blocks != self.repeat_layers:
            check_memory(transformer.cfg, self.kv_spec, transformer.ops.memory_available(), transformer.ops.name,
                         mirror=bool(self.kv_spec.float_mirror))
        return dataclasses.replace(self, cfg=transformer.cfg, transformer=transformer, repeat_layers=blocks,
                                   last_stats=GenerationStats(), last_prompt_cache=None, _cache=None,
                                   _cache_holds=None, _model_drafters={})

    # --- prompt caching (kv/prompt_cache.py) ---------------------------------------------------------
    def cache_prompt(self, prompt: str | Sequence[int] | Sequence[dict], *, chat: bool = False,
                     chat_template_kwargs: dict | None = None, reuse: PromptCache | None = None,
                     progress: bool | None = None) -> PromptCache:
        """Prefill `prompt` once and keep its KV cache (host copies): generate(..., prompt_cache=it), or
        cache_prompt(..., reuse=it), then prefill only what follows the tokens they share. `reuse` may hold a
        cache of an earlier, related prompt (its shared beginning is not prefilled again)."""
        ids = self._prompt_ids(prompt, chat, chat_template_kwargs)
        if reuse is not None:
            self.check_prompt_cache(reuse)
        if reuse is not None and tuple(ids) == reuse.ids:  # the very same prompt: nothing to run or copy
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
        spec = {name: value for name, value in dataclasses.asdict(self.kv_spec).items()
                if value or name not in _TAIL_FIELDS}  # (unset: the key of the caches saved before tails existed)
        key = {"model": self.path.name, "model_bytes": self.path.stat().st_size, "device": self.device,
               "kv_spec": spec, "dca": dataclasses.asdict(self.dca) if self.dca else None}
        if self.repeat_layers:  # (absent without a plan: the caches saved before plans existed stay valid)
            key["repeat_layers"] = describe(self.repeat_layers)
        return key

    def _cache_holding_prefix(self, ids: list[int], prompt_cache: PromptCache | None):
        """The working cache holding the first `reused` of `ids` from prompt_cache, and the logits after all of
        ids when it holds every one (else None). The caller has checked prompt_cache (check_prompt_cache) and changes
        the working cache from here on."""
        held = prompt_cache is not None and prompt_cache is self._cache_holds  # (cache_prompt, keep_cache)
        if held:
            cache, self._cache_holds = self._cache, None
        else:
            cache = self.new_cache()
        if prompt_cache is None:
            return cache, 0, None
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
        # K/V rows are cut at `keep`; a hybrid's recurrent states go back to their last checkpoint before it; a
        # sliding window whose keys before `keep` are gone starts afresh (0)
        return cache, cache.cut_to(keep), None

    def check_prompt_cache(self, prompt_cache: PromptCache) -> None:
        """InputError unless `prompt_cache` (from cache_prompt() or PromptCache.load()) was made by this model with
        these settings and holds what this model's cache holds: ids of its vocabulary within the context, logits
        over the vocabulary, and every layer's arrays in the working cache's shapes (a file damaged or written
        by hand would otherwise fail inside restore, or sample from a cut logits row)."""
        problem = self.prompt_cache_problem(prompt_cache)
        if problem is not None:
            raise InputError(f"this prompt cache {problem}; make it again with cache_prompt()")

    def prompt_cache_problem(self, prompt_cache: PromptCache) -> str | None:
        """Why `prompt_cache` cannot serve this model (a phrase: "was made by ...", "does not fit ..."), or None."""
        if prompt_cache.key != self.prompt_cache_key():
            return "was made by another model or with other settings (KV types, ctx, chunk, DCA, device, layer plan)"
        problem = self._layout_problem(prompt_cache)
        return None if problem is None else f"does not fit the model: {problem}"

    def _layout_problem(self, prompt_cache: PromptCache) -> str | None:
        n_vocab, ctx = self.cfg.n_vocab, self.kv_spec.ctx
        ids = np.asarray(prompt_cache.ids, dtype=np.int64)
        if not 0 < len(ids) <= ctx or not ((ids >= 0) & (ids < n_vocab)).all():
            return f"its {len(ids)} ids are not 1 .. {ctx} token ids below {n_vocab}"
        logits = np.asarray(prompt_cache.logits)
        if logits.shape != (n_vocab,) or not np.issubdtype(logits.dtype, np.floating) or np.isnan(logits).any():
            return f"its logits are {logits.dtype} {logits.shape}, expected {n_vocab} numbers"
        layers = self._working_cache().own_layers()
        if len(prompt_cache.layer_states) != len(layers):
            return f"it holds {len(prompt_cache.layer_states)} layer caches, the model has {len(layers)}"
        for i, (layer, state) in enumerate(zip(layers, prompt_cache.layer_states)):
            problem = (layer.state_problem(state, len(ids)) if isinstance(layer, RecurrentState)
                       else layer_state_problem(layer, state, len(ids)))
            if problem is not None:
                return f"layer {i}: {problem}"
        return None

    def _prompt_ids(self, prompt, chat: bool, chat_template_kwargs: dict | None) -> list[int]:
        if chat:
            ids = self.chat_ids(prompt, chat_template_kwargs)
        elif isinstance(prompt, str):
            ids = self.tokenize(prompt)
        else:
            ids = [int(t) for t in prompt]
            outside = [t for t in ids if not 0 <= t < self.cfg.n_vocab]
            if outside:  # (the embedding lookup would fail deep inside, or read another row)
                raise InputError(f"token id {outside[0]} of the prompt is not in the vocabulary (0 .. "
                                 f"{self.cfg.n_vocab - 1})")
        if not ids:
            raise InputError("the prompt is empty and the model adds no BOS token; give some prompt text")
        return ids

    def _forward_numpy(self, tokens, positions, cache, all_logits=False):
        with self.transformer.ops.running_on(self.threads):
            out = self.transformer.forward(tokens, positions, cache, all_logits)
            return np.asarray(self.transformer.ops.to_numpy(out), dtype=np.float32)

    @functools.cached_property
    def _decode_forward(self):
        """The forward pass with one-token steps replayed as CUDA graphs on the GPU (unchanged on the CPU, and where
        a step needs the host: a mixture of experts routes there, a spilled cache copies rows both ways, a
        linear-attention layer counts its positions there; graphs of the hybrids are not tried yet)."""
        if (self.kv_spec.spilled or self.kv_spec.has_tail or self.transformer.cfg.ssm is not None
                or any(layer.moe is not None for layer in self.transformer.layers)):
            return self.transformer.forward
        return self.transformer.ops.decode_forward(self.transformer.forward)

    def _forward_numpy_graphed(self, tokens, positions, cache, all_logits=False):
        with self.transformer.ops.running_on(self.threads):
            out = self._decode_forward(tokens, positions, cache, all_logits)
            return np.asarray(self.transformer.ops.to_numpy(out), dtype=np.float32)


def load(model: str | os.PathLike | GGUFFile | None = None, *, device: str = "auto", ctx: int | None = None,
         kv_type_k: str = "f16", kv_type_v: str = "f16", max_chunk: int = 512, dca: bool | dict | None = None,
         kv_normalize_k: bool | None = None, kv_budget: int | str | None = None, kv_spill: bool = False,
         kv_spill_max_slowdown: float | None = None,
         kv_mirror: bool | None = None, kv_window: int = 0, kv_type_k_tail: str | None = None,
         kv_type_v_tail: str | None = None, threads: int | None = None, progress: bool = True,
         draft_model: "str | os.PathLike | Model | None" = None, spec: SpecConfig | dict | str | None = None,
         draft_kv_type_k: str = "f16", draft_kv_type_v: str = "f16",
         repeat_layers: str | Sequence[Sequence[int]] | None = None, **options) -> Model:
    """Load a GGUF model: its path, the GGUFFile read_gguf opened from it, or None (the default model, Gemma 3 270M
    Q4_K_M from its PyPI package).

    device: "auto" (GPU when CuPy sees one, else CPU), "cpu" or "gpu". ctx: KV positions to hold (default 4096, or
         the trained context when that is shorter; past the trained context, without dca, load warns).
    kv_type_k / kv_type_v: KV-cache formats (f16, q8_0, ..., turbo3, turbo3_tcq; see cupyllm.kv.list_formats()),
         or both "auto": the best tier of the measured quality ladder (kv/plan.py) whose cache fits `kv_budget`
         (default: the memory free after the weights load, less 10%).
    kv_budget: bytes the KV cache may take (a number or text such as "6GiB"); with explicit types, a cache that
         would exceed it is a BudgetError before anything is allocated.
    kv_spill: (GPU) a cache over the budget keeps only its newest positions on the device and the rest in pinned
         host memory, attention streaming over both (kv/plan.py plan_spill, kv/gpu_spill.py); with "auto"
         types, when the best tier does not fit whole, the spill's cost is timed on the device at load and the
         best tier whose predicted decode slowdown is at most kv_spill_max_slowdown (default 0.20: 20%) is kept,
         spilled, else the first that fits whole (kv/spill_cost.py; the decision: model.kv_plan.spill_choice).
    kv_mirror: (CPU) also keep a float32 copy of the decoded cache, which kv_budget and the "auto" types then
         count: 4 more bytes per value whatever the KV type, so that decode steps read it instead of decoding
         the rows: faster with the rotated formats, not with f16 or q8_0 (docs/kv-formats.md). Default: no copy, the cache
         takes its format's bytes and decode steps read the encoded rows (ops/attention/cpu.py). The GPU keeps
         no copy (True there is an error).
    kv_window / kv_type_k_tail / kv_type_v_tail: mixed types by position (kv/window.py, docs/kv-formats.md):
         each global layer keeps its newest kv_window positions in kv_type_k / kv_type_v and older ones in the
         tail types (an unset one: its main type). Spilled (kv_spill), the host part takes the tail types and
         kv_window is not given. No tail type: one type for every position.
    threads: CPU threads for the CPU backend's matmuls, attention and BLAS (llama.cpp's -t; default: every core).
    dca: Dual Chunk Attention for contexts past the trained length: True (chunk_size = trained context,
         local_size = chunk_size / 32) or {"chunk_size": S, "local_size": W, "yarn_factor": f}.
    kv_normalize_k: store K normalised per channel, (K - mean) / sqrt(RMS of K / RMS of Q) from the first
         prompt chunk (KVSpec.normalize_k, kv.cache.key_normalization). None (default): on for quantized K
         formats, off for f16/bf16/f32. Much better quantized K where some channels of K have large offsets
         or spreads (bench/results/kv_quality.md).
    draft_model: a GGUF path (or a loaded Model) of the same vocabulary that drafts tokens for speculative
         decoding, with its own cache of draft_kv_type_k / draft_kv_type_v and this model's ctx; spec then
         defaults to "draft".
    spec: speculative decoding for every generate() (cupyllm.speculative.SpecConfig, a dict of its fields, or a
         type: "ngram" (prompt lookup), "draft", "self"); None: off (or "draft" with a draft_model).
    repeat_layers: a layer plan, "i,j;k,l" or [(i, j), ...]: each block [i, j) of layers runs again right after
         its first run (RYS; models/layer_plan.py, docs/layer-plans.md), its weights shared and each run with its
         own cache slot. Blocks near the first or last layers warn. Drafters never run the plan.
    """
    if options:
        raise TypeError(f"unknown option(s) for cupyllm.load: {', '.join(sorted(options))}")
    check_load_options(ctx=ctx, threads=threads, max_chunk=max_chunk, dca=dca)
    spec = spec_config(spec) if spec is not None else (SpecConfig(type="draft") if draft_model is not None else None)
    if spec is not None and spec.type == "draft" and draft_model is None:
        raise InputError("spec type 'draft' needs a draft model: load(..., draft_model=PATH) (-md/--model-draft FILE)")
    if spec is not None and spec.type == "assistant" and draft_model is None:
        raise InputError("spec type 'assistant' needs a Gemma 4 assistant: load(..., draft_model=ASSISTANT.gguf) "
                         "(-md ASSISTANT.gguf)")
    gguf = model if isinstance(model, GGUFFile) else read_gguf(model if model is not None else default_model_path())
    path = gguf.path
    cfg = config_from_gguf(gguf)
    if spec is not None and spec.type == "mtp":  # (before the weights load)
        check_mtp_file(gguf, cfg)
    blocks = parse_repeat_layers(repeat_layers, cfg.n_layer)
    cfg = planned_config(cfg, blocks)  # the stack's layers: the cache, budgets and tiers count every run
    ctx = min(DEFAULT_CTX, cfg.ctx_train) if ctx is None else ctx
    auto = "auto" in (kv_type_k, kv_type_v)
    if auto and kv_type_k != kv_type_v:
        raise CupyllmError("kv_type_k='auto' picks K and V together: pass kv_type_v='auto' too (-ctk auto -ctv auto)")
    max_slowdown = check_max_slowdown(kv_spill_max_slowdown)
    if kv_spill_max_slowdown is not None and not (auto and kv_spill):
        raise InputError("kv_spill_max_slowdown (--kv-spill-max-slowdown) weighs the spill cost of the auto KV tiers: "
                         "it needs kv_type_k='auto', kv_type_v='auto' and kv_spill=True "
                         "(-ctk auto -ctv auto --kv-spill)")
    for head_dim in sorted(cfg.head_dims()) if not auto else ():  # an unknown or unfit type fails before loading
        get_format(kv_type_k, head_dim=head_dim)
        get_format(kv_type_v, head_dim=head_dim)
    check_kv_window(cfg, ctx, kv_window, kv_type_k_tail, kv_type_v_tail, spill=kv_spill, mirror=bool(kv_mirror))
    budget = parse_bytes(kv_budget) if kv_budget is not None else None
    from .backend.gpu import deltanet_problem  # imports no CuPy
    if device == "auto" and deltanet_problem(cfg) is not None:  # DeltaNet shapes the GPU kernels do not take
        device = "cpu"
    backend = select_backend(device, threads=threads)
    if kv_mirror and not backend.can_mirror_kv:
        raise CupyllmError(f"kv_mirror=True (--kv-mirror) keeps a float32 copy of the KV cache for the CPU backend; "
                           f"on the {backend.name} the kernels read the encoded cache and keep none: drop it")
    mirror = bool(kv_mirror)
    tokenizer = Tokenizer.from_metadata(gguf.metadata)
    draft_gguf = None if draft_model is None or isinstance(draft_model, Model) else read_gguf(draft_model)
    if draft_model is not None:  # a draft model of another vocabulary fails before either model loads
        tokens, name = ((draft_model.tokenizer.tokens, draft_model.path.name) if draft_gguf is None else
                        (Tokenizer.from_metadata(draft_gguf.metadata).tokens, Path(draft_gguf.path).name))
        check_same_vocabulary(tokenizer.tokens, tokens, name)
    dca_cfg = _dca_config(dca, cfg)
    warning = boundary_warning(blocks, cfg.n_stored_layer)
    if warning is not None:
        warnings.warn(warning, UserWarning, stacklevel=2)
    transformer = Transformer.from_gguf(gguf, backend, progress=progress)
    if dca_cfg is not None:
        transformer.attention = dca_attention(dca_cfg)
    transformer = transformer.with_layer_plan(blocks)
    if kv_spill and backend.name != "gpu":
        raise CupyllmError("kv_spill (--kv-spill) moves KV rows from GPU memory to the host; on the CPU the whole "
                           "cache is in host memory already")
    if auto or kv_spill:
        budget = budget if budget is not None else int(0.9 * backend.memory_available())
    kv_type_k, kv_type_v, kv_plan, spill_plan, cache_spec = _fit_cache(
        cfg, ctx, kv_type_k, kv_type_v, budget, auto=auto, spill=kv_spill, mirror=mirror, max_chunk=max_chunk,
        normalize_k=kv_normalize_k, float_mirror=mirror, max_slowdown=max_slowdown,
        spill_rates=lambda: measure_spill_rates(transformer),
        tail=dict(kv_window=kv_window, kv_type_k_tail=kv_type_k_tail, kv_type_v_tail=kv_type_v_tail))
    if budget is None:  # no budget given: the cache must still fit the memory there is, checked before allocating
        check_memory(cfg, cache_spec, backend.memory_available(), backend.name, mirror=mirror)
    if dca_cfg is None and ctx > cfg.ctx_train:  # (warned only for a context that loads)
        warnings.warn(f"ctx {ctx} is past the {cfg.ctx_train} positions this model was trained on; beyond them "
                      "attention meets distances it never saw and retrieval fails (bench/results/niah.md); pass "
                      "dca=True (--dca) to keep every query-key distance in the trained range",
                      ContextPastTrainingWarning, stacklevel=2)
    draft = None
    if draft_gguf is not None and is_assistant(draft_gguf):  # a Gemma 4 assistant: drafts from this model's state
        draft = Gemma4Assistant.from_gguf(draft_gguf, backend).bind(transformer.cfg)
        spec = dataclasses.replace(spec, type="assistant") if spec.type == "draft" else spec
    elif draft_model is not None:
        draft = draft_model if isinstance(draft_model, Model) else load(  # (its file read once: draft_gguf)
            draft_gguf, device=backend.name, ctx=ctx, kv_type_k=draft_kv_type_k, kv_type_v=draft_kv_type_v,
            max_chunk=max_chunk, threads=threads, progress=progress)
    return Model(path=path, gguf=gguf, cfg=transformer.cfg, tokenizer=tokenizer, transformer=transformer,
                 kv_spec=cache_spec, device=backend.name, kv_plan=kv_plan, spill_plan=spill_plan, dca=dca_cfg,
                 threads=threads, spec=spec, draft=draft, repeat_layers=blocks)


_TAIL_FIELDS = ("kv_window", "kv_type_k_tail", "kv_type_v_tail")  # KVSpec's mixed-type fields (kv/window.py)


def _is_count(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_load_options(*, ctx: int | None = None, threads: int | None = None, max_chunk: int = 512,
                       dca: bool | dict | None = None) -> None:
    """InputError for a load() argument out of its range, before anything is read (the CLI checks its flags with
    it before the model loads): the words name the argument and its flag."""
    if ctx is not None and not (_is_count(ctx) and ctx > 0):
        raise InputError(f"ctx (-c/--ctx) must be a positive number of tokens, got {ctx!r}")
    if threads is not None:
        import numba
        if not (_is_count(threads) and 1 <= threads <= numba.config.NUMBA_NUM_THREADS):
            raise InputError(f"threads={threads!r}: choose 1 .. {numba.config.NUMBA_NUM_THREADS} (-t/--threads: the "
                             "CPU threads this machine offers)")
    if not (_is_count(max_chunk) and max_chunk > 0):
        raise InputError(f"max_chunk must be a positive number of tokens, got {max_chunk!r}")
    if isinstance(dca, dict):
        unknown = set(dca) - {"chunk_size", "local_size", "yarn_factor"}
        if unknown:
            raise InputError(f"unknown DCA option(s) {sorted(unknown)}; use chunk_size, local_size, yarn_factor")
        for name, flag in (("chunk_size", "--dca-chunk-size"), ("local_size", "--dca-local-size")):
            value = dca.get(name)
            if value is not None and not (_is_count(value) and value > 0):
                raise InputError(f"DCA {name} ({flag}) must be a positive number of tokens, got {value!r}")
        yarn = dca.get("yarn_factor", 1.0)
        if yarn is None or isinstance(yarn, bool) or not isinstance(yarn, (int, float, np.floating)) or \
                not 1.0 <= yarn < math.inf:
            raise InputError(f"DCA yarn_factor (--dca-yarn-factor) must be a finite number >= 1 (1 = off), "
                             f"got {yarn!r}")
    elif dca is not None and not isinstance(dca, (bool, DCAConfig)):
        raise InputError(f"dca must be True, False, None or a dict of chunk_size, local_size, yarn_factor; got {dca!r}")


def _fit_cache(cfg: ModelConfig, ctx: int, kv_type_k: str, kv_type_v: str, budget: int | None, *, auto: bool,
               spill: bool, mirror: bool, max_chunk: int, normalize_k: bool | None, float_mirror: bool | None,
               max_slowdown: float = 0.2, spill_rates=None,
               tail: dict | None = None):
    """(kv_type_k, kv_type_v, kv_plan, spill_plan, spec) of a cache within `budget` (None: no budget): "auto"
    types planned (kv/plan.py), given ones checked, spilled to the host when asked and needed. BudgetError when
    it cannot fit. With auto types and spill, when the best tier does not fit whole, the tiers are weighed by the
    cost spill_rates() measures (kv/spill_cost.py)."""
    kv_plan = spill_plan = None
    if auto and spill and not best_tier_fits_whole(cfg, ctx, budget, max_chunk=max_chunk, normalize_k=normalize_k):
        choice = plan_spill_tier(cfg, ctx, budget, spill_rates(), max_slowdown, max_chunk=max_chunk,
                                 normalize_k=normalize_k, host_available=host_bytes_available(),
                                 host_types=lambda spec: floor_tail(cfg, spec))  # (the q4_0 floor, as below)
        spec = dataclasses.replace(choice.chosen.spec, float_mirror=float_mirror)
        return choice.chosen.tier.kv_type_k, choice.chosen.tier.kv_type_v, choice.kv_plan(), choice.spill_plan(), spec
    if auto:
        try:
            kv_plan = plan_kv(cfg, ctx, budget, mirror=mirror, max_chunk=max_chunk, normalize_k=normalize_k)
            kv_type_k, kv_type_v = kv_plan.tier.kv_type_k, kv_plan.tier.kv_type_v
        except BudgetError:
            if not spill:
                raise
            kv_type_k, kv_type_v = TIERS[-1].kv_type_k, TIERS[-1].kv_type_v  # keeps the most positions on the device
    spec = KVSpec(ctx=ctx, kv_type_k=kv_type_k, kv_type_v=kv_type_v, max_chunk=max_chunk, normalize_k=normalize_k,
                  float_mirror=float_mirror, **(tail or {}))
    if budget is not None and kv_plan is None:
        try:
            check_budget(cfg, spec, budget, mirror=mirror)
        except BudgetError:
            if not spill:
                raise
            if auto:  # the host part in q4_0 where the window's type is above it (kv/plan.py floor_tail)
                spec = floor_tail(cfg, spec)
            spill_plan = plan_spill(cfg, spec, budget, host_available=host_bytes_available())
            spec = spill_plan.spec
    return kv_type_k, kv_type_v, kv_plan, spill_plan, spec


def check_kv_window(cfg: ModelConfig, ctx: int, kv_window: int, kv_type_k_tail: str | None,
                    kv_type_v_tail: str | None, *, spill: bool = False, mirror: bool = False) -> None:
    """InputError for mixed-type options (kv/window.py) that do not go together, before the model loads."""
    tails = [t for t in (kv_type_k_tail, kv_type_v_tail) if t is not None]
    if not (_is_count(kv_window) and kv_window >= 0):
        raise InputError(f"kv_window (--kv-window) must be a number of positions >= 0, got {kv_window!r}")
    for name in tails:
        if name == "auto":
            raise InputError("the tail types (-ctkt/-ctvt) take a KV type, not auto (-ctk auto with --kv-spill "
                             "picks a q4_0 tail itself)")
        for head_dim in sorted(cfg.head_dims()):
            get_format(name, head_dim=head_dim)
    if spill and kv_window:
        raise InputError("with --kv-spill (kv_spill=True) the host part is the tail and the planner sizes the "
                         "device window: drop --kv-window (kv_window=)")
    if kv_window and not tails:
        raise InputError(f"--kv-window {kv_window} keeps the newest positions in -ctk/-ctv and older ones in the "
                         "tail types: give them (-ctkt/--cache-type-k-tail, -ctvt/--cache-type-v-tail; "
                         "kv_type_k_tail=, kv_type_v_tail=), e.g. -ctkt q4_0 -ctvt q4_0")
    if tails and not kv_window and not spill:
        raise InputError("the tail types (-ctkt/-ctvt) store the positions older than a window: give its size "
                         "with --kv-window N (kv_window=N), or --kv-spill for a spilled cache's host part")
    if tails and kv_window and mirror:
        raise InputError("--kv-mirror keeps a float32 copy of every position, which outweighs what a tail type "
                         "saves: drop --kv-mirror (kv_mirror=) or --kv-window and the tail types")


def _dca_config(dca, cfg: ModelConfig) -> DCAConfig | None:
    if dca is None or dca is False:
        return None
    if dca is True:
        return DCAConfig.for_model(cfg.ctx_train)
    if isinstance(dca, DCAConfig):
        return dca
    check_load_options(dca=dca)
    chunk = dca.get("chunk_size") or cfg.ctx_train
    local = dca.get("local_size") or chunk // 32
    if not 0 < local < chunk:
        raise InputError(f"DCA needs 0 < local size < chunk size; got local size {local} (--dca-local-size), chunk "
                         f"size {chunk} (--dca-chunk-size{', the trained context' * (not dca.get('chunk_size'))})")
    return DCAConfig.for_model(cfg.ctx_train, chunk, local, dca.get("yarn_factor", 1.0))
