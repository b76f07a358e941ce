"""The drafter of a SpecConfig for a loaded model (api.Model): made here for generate() (api.Model._drafter)
and for each slot of the server (server/engine.py), which keep it between generations and run its forwards
where they must."""
from __future__ import annotations

from typing import Callable

from .draft_model import ModelDrafter
from .gemma4_assistant import AssistantDrafter
from .mtp import MTPDrafter
from .ngram import NgramDrafter, text_fold


def drafter_for(spec, model, kept=None, execute: Callable | None = None):
    """The drafter of `spec` (a SpecConfig; None: no drafter) for `model`, ready for a new generation: a fresh
    n-gram index; else `kept`, the drafter this function made for the same spec type before (its weights and
    cache kept, so that a conversation's next turn drafts after running only what is new), or a new one.
    `execute(work)` runs a new drafter's own forwards (the server: on its batcher's thread, one at a time);
    None: where the drafter is called."""
    if spec is None:
        return None
    if spec.type == "ngram":
        return NgramDrafter(spec.ngram_size, spec.ngram_min, fold=text_fold(model.tokenizer.token_bytes))
    drafter = kept if kept is not None else _new_drafter(spec.type, model, execute)
    if spec.type == "mtp":  # (the head's weights and cache made once; its state new for each generation)
        drafter.reset()
    drafter.p_min = 0.0 if spec.type == "self" else spec.draft_p_min  # (self: its drafts are what it would say)
    return drafter


def _new_drafter(kind: str, model, execute: Callable | None):
    if kind == "mtp":  # the file's NextN head, on the target's hidden rows
        drafter = MTPDrafter.for_model(model)
    elif kind == "assistant":  # reads the target's cache and hidden rows: nothing of its own to keep
        drafter = AssistantDrafter(model.draft, model.transformer, model.threads)
    else:  # "draft": the draft model; "self": this model's stored layers (a drafter never runs the layer plan)
        source = model._without_layer_plan() if kind == "self" else model.draft
        cache = source.transformer.ops.new_cache(source.cfg, source.kv_spec)  # (self: a second cache)
        forward = source._forward_numpy if execute is None else _run_by(execute, source._forward_numpy)
        return ModelDrafter(forward, cache, source.kv_spec.max_chunk, n_vocab=model.cfg.n_vocab)
    if execute is not None:
        drafter.execute = execute
    return drafter


def _run_by(execute: Callable, forward: Callable) -> Callable:
    """`forward`, each call run by `execute`."""
    def run(tokens, positions, cache, all_logits=False):
        return execute(lambda: forward(tokens, positions, cache, all_logits))
    return run
