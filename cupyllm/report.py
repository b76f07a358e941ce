"""`cupyllm info`: what a GGUF model is and what it needs in memory at a given context."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from .files.config import config_from_gguf
from .files.gguf import read_gguf
from .errors import CupyllmError
from .kv.cache import KVSpec, kv_bytes
from .kv.plan import TIERS, parse_bytes, plan_kv, plan_spill, tier_fits_model
from .kv.plan import format_bytes as _gib
from .files.model_store import default_model_path
from .models.layer_plan import describe, parse_repeat_layers, planned_config


def model_report(model: str | Path | None, *, ctx: int = 4096, kv_type_k: str = "f16", kv_type_v: str = "f16",
                 normalize_k: bool | None = None, kv_budget: int | str | None = None, kv_spill: bool = False,
                 kv_window: int = 0, kv_type_k_tail: str | None = None,
                 kv_type_v_tail: str | None = None, kv_tiers: bool = False, repeat_layers: str | None = None) -> str:
    path = Path(model) if model else default_model_path()
    gguf = read_gguf(path)
    cfg = config_from_gguf(gguf)
    blocks = parse_repeat_layers(repeat_layers, cfg.n_layer)
    cfg = planned_config(cfg, blocks)  # the cache holds a slot for every layer the stack runs
    budget = parse_bytes(kv_budget) if kv_budget is not None else None
    budget_line = []
    if "auto" in (kv_type_k, kv_type_v):
        if budget is None or kv_type_k != kv_type_v:
            raise CupyllmError("-ctk auto -ctv auto pick the KV types for a budget: give it with --kv-budget")
        plan = plan_kv(cfg, ctx, budget, normalize_k=normalize_k)  # the device cache: no float32 copy
        kv_type_k, kv_type_v = plan.tier.kv_type_k, plan.tier.kv_type_v
        budget_line = [f"KV plan         {plan.tier.name}: the best tier that fits {_gib(budget)} (kv/plan.py)"]
    tensors = [t for name, t in gguf.tensors.items() if not cfg.is_nextn_tensor(name)]  # (an MTP head: not loaded)
    weight_bytes = sum(t.data.nbytes for t in tensors)
    n_params = sum(t.n_elements for t in tensors)
    types = Counter(t.type.name for t in tensors)
    spec = KVSpec(ctx=ctx, kv_type_k=kv_type_k, kv_type_v=kv_type_v, normalize_k=normalize_k,
                  kv_window=kv_window, kv_type_k_tail=kv_type_k_tail, kv_type_v_tail=kv_type_v_tail)
    cache = kv_bytes(cfg, spec)
    n_sliding = sum(cfg.sliding_layers) if cfg.sliding_layers else 0
    lines = [
        f"file            {path}",
        f"name            {cfg.name}",
        f"architecture    {cfg.arch}",
        f"parameters      {n_params / 1e6:,.1f} M in {len(tensors)} tensors ({_gib(weight_bytes)})",
        "tensor types    " + ", ".join(f"{name} x{count}" for name, count in types.most_common()),
        f"layers          {cfg.n_layer}" + (f" ({n_sliding} sliding-window of {cfg.sliding_window}, "
                                              f"{cfg.n_layer - n_sliding} global)" if n_sliding else "")
        + (f"; {cfg.n_stored_layer} stored, blocks {describe(blocks)} run twice" if blocks else ""),
        f"d_model         {cfg.d_model}   ffn {cfg.ffn_dim}   vocab {cfg.n_vocab}"
        + (f"   per-layer embedding {cfg.per_layer_dim}" if cfg.per_layer_dim else "")
        + (f"   experts {cfg.n_expert_used} of {cfg.n_expert}" if cfg.n_expert else ""),
        _attention_line(cfg),
        f"rope            base {cfg.rope.base:g}, {cfg.rope.n_rot} dims, scaling {cfg.rope.scaling}"
        + (f" x{cfg.rope.factor:g}" if cfg.rope.scaling != "none" else "")
        + (f"; sliding layers base {cfg.rope_local.base:g}" if cfg.rope_local else ""),
        f"trained context {cfg.ctx_train}",
        f"KV cache        {_gib(cache)} at ctx {ctx} (K {kv_type_k}{', normalised' if spec.k_normalized else ''}, "
        f"V {kv_type_v}" + (f"; older than the newest {kv_window}: K {spec.tail_type_k}, V {spec.tail_type_v}"
                            if spec.windowed else "") + ")",
        f"memory needed   {_gib(weight_bytes + cache)} (weights + KV cache); --kv-mirror (CPU) adds "
        f"{_gib(kv_bytes(cfg, spec, mirror=True) - cache)} for a float32 copy of the cache",
        *budget_line,
    ]
    if budget is not None and not budget_line:
        lines.append(f"KV budget       {_gib(budget)}: the cache {'fits' if cache <= budget else 'does NOT fit'}")
        if cache > budget and kv_spill:
            lines.append(f"KV spill        {plan_spill(cfg, spec, budget).describe()}")
    if kv_tiers:
        lines += _tier_table(cfg, ctx, normalize_k)
    return "\n".join(lines)


def _attention_line(cfg) -> str:
    """Query/KV heads and head dims; Gemma 4's sliding and global layers differ, and may share caches."""
    shapes = sorted({(cfg.is_sliding(il), cfg.n_kv_head_of(il), cfg.head_dim_of(il)) for il in range(cfg.n_layer)})
    if len(shapes) == 1:
        text = f"{cfg.n_head} query heads, {cfg.n_kv_head} KV heads, head dim {cfg.head_dim}"
    else:
        text = f"{cfg.n_head} query heads; " + "; ".join(
            f"{'sliding' if sliding else 'global'} layers {n_kv} KV heads, head dim {head_dim}"
            for sliding, n_kv, head_dim in shapes)
    shared = sum(cfg.kv_source(il) != il for il in range(cfg.n_layer))
    return "attention       " + text + (f"; the last {shared} layers reuse earlier layers' caches" if shared else "")


def _tier_table(cfg, ctx: int, normalize_k: bool | None) -> list[str]:
    """The KV tiers (kv/plan.py) with this model's cache size at ctx and their measured quality."""
    lines = ["KV tiers        (best first; median KLD vs f16 measured on Gemma 3 270M / Qwen2.5-0.5B, "
             "bench/results/kv_quality.md)"]
    for tier in TIERS:
        if not tier_fits_model(tier, cfg):
            continue
        spec = KVSpec(ctx=ctx, kv_type_k=tier.kv_type_k, kv_type_v=tier.kv_type_v, normalize_k=normalize_k)
        gemma, qwen = tier.median_kld
        lines.append(f"  {tier.name:<24}{_gib(kv_bytes(cfg, spec)):>12}   KLD {gemma:.2g} / {qwen:.2g}")
    return lines
