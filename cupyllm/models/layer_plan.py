"""Layer plans: run blocks of middle layers a second time (RYS, "Repeat Your Self"; depth up-scaling at
inference time, as mergekit's passthrough merges do on disk, without copying a weight).

A plan is a list of blocks [i, j) of stored layers. The stack runs each block again right after its first run:

    plan [(4, 6)] on 8 layers:   0 1 2 3 4 5 4 5 6 7

Every layer of the stack is a layer in its own right: its own cache slot (so the KV cache grows by exactly the
repeated layers), its own kind (a repeated sliding-window layer stays sliding, a global one global), and the
stored weights shared with its first run. `planned_config` re-indexes the model's per-layer facts by the stack's
layers; nothing downstream (cache, attention, budgets, spill, DCA) needs to know a plan exists.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Sequence

from ..errors import InputError
from ..files.config import ModelConfig

LayerBlocks = tuple[tuple[int, int], ...]  # [(i, j), ...]: blocks [i, j) of stored layers, ascending, disjoint

_BLOCK = re.compile(r"^\s*(-?\d+)\s*,\s*(-?\d+)\s*$")


def parse_repeat_layers(plan: str | Sequence[Sequence[int]] | None, n_layer: int) -> LayerBlocks:
    """The blocks of `plan`: text "i,j;k,l" (--repeat-layers), a sequence of (i, j) pairs, or None / "" (no plan).
    InputError unless every block is 0 <= i < j <= n_layer and the blocks ascend without overlapping (a block
    repeated twice, or two overlapping ones, would leave unclear which run the other repeats)."""
    if plan is None or (isinstance(plan, str) and not plan.strip()):
        return ()
    usage = ('write blocks [i, j) of layers as "i,j" separated by ";" (e.g. --repeat-layers "8,12" or "4,6;10,12"; '
             f"this model has layers 0 .. {n_layer - 1})")
    if isinstance(plan, str):
        pairs = []
        for text in plan.split(";"):
            found = _BLOCK.match(text)
            if found is None:
                raise InputError(f"repeat_layers {plan!r}: cannot read {text.strip()!r} as a block; {usage}")
            pairs.append((int(found.group(1)), int(found.group(2))))
    else:
        try:
            pairs = [tuple(block) for block in plan]
        except TypeError:
            raise InputError(f"repeat_layers {plan!r}: {usage}") from None
        if not all(len(block) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in block)
                   for block in pairs):
            raise InputError(f"repeat_layers {plan!r}: each block must be a pair of layer numbers (i, j); {usage}")
    end = 0
    for i, j in pairs:
        if not 0 <= i < j <= n_layer:
            raise InputError(f"repeat_layers: block [{i}, {j}) is not a run of this model's layers (0 <= i < j <= "
                             f"{n_layer}); {usage}")
        if i < end:
            raise InputError(f"repeat_layers: block [{i}, {j}) starts before the block ahead of it ends ({end}); "
                             "give the blocks in order, without overlaps")
        end = j
    return tuple(pairs)


def layer_order(blocks: LayerBlocks, n_layer: int) -> tuple[int, ...]:
    """The stored layer each layer of the stack runs: 0 .. n_layer-1 with each block again after its end."""
    repeat_after = {j - 1: i for i, j in blocks}
    order: list[int] = []
    for layer in range(n_layer):
        order.append(layer)
        if layer in repeat_after:
            order.extend(range(repeat_after[layer], layer + 1))
    return tuple(order)


def boundary_warning(blocks: LayerBlocks, n_layer: int) -> str | None:
    """A warning for blocks within max(3, n_layer / 8) layers of either end of the stack (repeating the first
    or last layers usually breaks a model: they map tokens in and out of the middle layers' representation)."""
    margin = max(3, n_layer // 8)
    near = [(i, j) for i, j in blocks if i < margin or j > n_layer - margin]
    if not near:
        return None
    spans = ", ".join(f"[{i}, {j})" for i, j in near)
    return (f"repeat_layers: block(s) {spans} touch the first or last {margin} layers of {n_layer}; repeating "
            f"those usually breaks the model (keep blocks within [{margin}, {n_layer - margin}); `cupyllm rys-probe` "
            "ranks the blocks that help)")


def planned_config(cfg: ModelConfig, blocks: LayerBlocks) -> ModelConfig:
    """`cfg` for the stack of `blocks`'s plan: n_layer counts every layer it runs and each per-layer fact is the
    stored layer's. A KV-shared layer (Gemma 4) reads the latest run of its source layer before it. No plan:
    `cfg` itself."""
    if not blocks:
        return cfg
    if cfg.layer_order:
        raise InputError("this model runs a layer plan already; plan from the stored layers")
    order = layer_order(blocks, cfg.n_layer)
    by_layer = lambda values: tuple(values[s] for s in order) if values else values  # noqa: E731
    kv_sources = ()
    if cfg.kv_sources:
        latest: dict[int, int] = {}  # stored layer -> its latest run in the stack so far
        sources = []
        for layer, stored in enumerate(order):
            latest[stored] = layer
            sources.append(latest[cfg.kv_source(stored)])
        kv_sources = tuple(sources)
    return dataclasses.replace(
        cfg, n_layer=len(order), layer_order=order, sliding_layers=by_layer(cfg.sliding_layers),
        layer_head_dims=by_layer(cfg.layer_head_dims), layer_kv_heads=by_layer(cfg.layer_kv_heads),
        recurrent_layers=by_layer(cfg.recurrent_layers), kv_sources=kv_sources)


def describe(blocks: LayerBlocks) -> str:
    """The plan as --repeat-layers spells it ("" for none)."""
    return ";".join(f"{i},{j}" for i, j in blocks)
