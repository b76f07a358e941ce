"""KV-cache plans for a memory budget: the best K/V formats that fit (auto tier selection).

The tiers are the Pareto front of the KV-quality measurements (bench/results/kv_quality.md: median KL
divergence of the next-token distribution against an f16 cache over 2,048 tokens on Gemma 3 270M and
Qwen2.5-Coder-0.5B, K normalised; a type's quality is the worse of the two): each tier stores fewer bits per
value than the one before it, and every measured type or pair left out is beaten by some tier in both bits
and quality (q4_0 and q4_1 by turbo4, turbo3 by turbo3_tcq/turbo2_tcq, q8_0/q4_0 by q6_0, ...;
tests/test_kv_plan.py recomputes the front from the measurements). `plan_kv` takes the first tier whose
cache fits the budget; its bytes come from `kv_bytes`, the same count the cache allocates. With --kv-spill, a
better tier that does not fit whole may be kept spilled when its measured cost allows (kv/spill_cost.py).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from ..files.config import ModelConfig
from ..errors import BudgetError, CupyllmError, InputError
from .cache import KVSpec, host_kv_bytes, kv_bytes
from ..ops.kv_formats.formats import get_format


@dataclass(frozen=True)
class KVTier:
    kv_type_k: str
    kv_type_v: str
    median_kld: tuple[float, float]  # measured: (Gemma 3 270M, Qwen2.5-Coder-0.5B)

    @property
    def name(self) -> str:
        return self.kv_type_k if self.kv_type_k == self.kv_type_v else f"{self.kv_type_k}/{self.kv_type_v}"


TIERS = (
    KVTier("f16", "f16", (0.0, 0.0)),
    KVTier("q8_0", "q8_0", (0.000137, 0.000188)),
    KVTier("q6_0", "q6_0", (0.00215, 0.0027)),
    KVTier("q5_1", "q5_1", (0.00493, 0.00586)),
    KVTier("q8_0", "turbo3_tcq", (0.00839, 0.00688)),
    KVTier("q5_0", "q5_0", (0.00837, 0.00932)),
    KVTier("turbo4", "turbo4", (0.0151, 0.0195)),
    KVTier("turbo3_tcq", "turbo3_tcq", (0.0317, 0.0431)),
    KVTier("turbo3_tcq", "turbo2_tcq", (0.0629, 0.0694)),
    KVTier("turbo2_tcq", "turbo2_tcq", (0.192, 0.218)),
    KVTier("turbo2", "turbo2", (0.427, 0.381)),
)

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
          "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def parse_bytes(size: int | float | str) -> int:
    """A memory size: bytes as a number, or text such as "6GiB", "512 MiB", "2.5G" (G = 1e9, GiB = 2**30)."""
    if isinstance(size, (int, float)) and not isinstance(size, bool):
        value = float(size)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(size))
        if match is None or match.group(2).lower() not in _UNITS:
            raise InputError(f"memory size {size!r} (--kv-budget, kv_budget=) is not a size; write it like 6GiB, "
                             "512MiB, 2.5G or a byte count")
        value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not 0 < value < math.inf:
        raise InputError(f"memory size {size!r} (--kv-budget, kv_budget=) must be a positive, finite number of "
                         "bytes")
    return int(value)


@dataclass(frozen=True)
class KVPlan:
    tier: KVTier
    ctx: int
    bytes_needed: int
    budget: int
    # --kv-spill: the tiers weighed by their measured spill cost (kv/spill_cost.py plan_spill_tier), when the best
    # tier did not fit whole; None: the first tier that fits was taken
    spill_choice: object = None  # a kv/spill_cost.py SpillChoice (not imported: spill_cost builds on this module)

    def describe(self) -> str:
        if self.spill_choice is not None:
            return self.spill_choice.describe()
        return (f"KV cache {self.tier.name} (auto for {format_bytes(self.budget)}: "
                f"{format_bytes(self.bytes_needed)} at ctx {self.ctx})")


def tier_fits_model(tier: KVTier, cfg: ModelConfig) -> bool:
    """Whether both formats can store every head dim of the model (rotated groups need whole groups)."""
    try:
        for head_dim in cfg.head_dims():
            get_format(tier.kv_type_k, head_dim=head_dim)
            get_format(tier.kv_type_v, head_dim=head_dim)
    except CupyllmError:
        return False
    return True


def plan_kv(cfg: ModelConfig, ctx: int, budget: int, *, mirror: bool = False, max_chunk: int = 512,
            normalize_k: bool | None = None) -> KVPlan:
    """The best tier whose cache of `ctx` positions takes at most `budget` bytes (mirror: with the CPU
    backend's float32 copy, which every tier pays alike). BudgetError, with the largest context the
    smallest tier allows, when none fits."""
    tiers = [t for t in TIERS if tier_fits_model(t, cfg)]

    def need(tier: KVTier, n_ctx: int) -> int:
        spec = KVSpec(ctx=n_ctx, kv_type_k=tier.kv_type_k, kv_type_v=tier.kv_type_v, max_chunk=max_chunk,
                      normalize_k=normalize_k)
        return kv_bytes(cfg, spec, mirror=mirror)

    for tier in tiers:
        n_bytes = need(tier, ctx)
        if n_bytes <= budget:
            return KVPlan(tier, ctx, n_bytes, budget)
    smallest = min(tiers, key=lambda tier: need(tier, ctx))  # the last tier, unless tiny heads reorder them
    lo, hi = 0, ctx  # the largest context the smallest tier fits: kv_bytes grows with ctx
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if need(smallest, mid) <= budget else (lo, mid - 1)
    fits = f"it fits ctx {lo} there" if lo > 0 else "no context fits"
    copy = _MIRROR_NOTE if mirror else ""
    raise BudgetError(f"a KV cache of {ctx} tokens needs {format_bytes(need(smallest, ctx))} even as "
                      f"{smallest.name}, the smallest tier, and the budget is {format_bytes(budget)}; {fits}: lower "
                      f"-c/--ctx (ctx=...) or raise --kv-budget (kv_budget=...){copy}")


_MIRROR_NOTE = (" (the CPU cache also keeps the float32 copy that --kv-mirror / kv_mirror=True asks for; without "
                "it the cache takes only its format's bytes)")


def largest_ctx_within(cfg: ModelConfig, spec: KVSpec, n_bytes: float, *, mirror: bool = False) -> int:
    """The largest context, at most spec.ctx, whose cache (spec's types otherwise) takes at most `n_bytes`
    (0: none); kv_bytes grows with the context, so bisection finds it."""
    lo, hi = 0, spec.ctx
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if kv_bytes(cfg, replace(spec, ctx=mid), mirror=mirror) <= n_bytes else (lo, mid - 1)
    return lo


def check_memory(cfg: ModelConfig, spec: KVSpec, available: float, device: str, *, mirror: bool = False) -> int:
    """Bytes of the cache `spec` describes; BudgetError, naming the largest context that fits, when that exceeds
    the `available` memory of `device`, before anything is allocated (a cache past the free memory would be
    paged in row by row and swap, or fail halfway)."""
    n_bytes = kv_bytes(cfg, spec, mirror=mirror)
    if n_bytes > available:
        fits = largest_ctx_within(cfg, spec, available, mirror=mirror)
        room = f"-c {fits} (ctx={fits}) is the largest context that fits" if fits else "no context fits"
        raise BudgetError(f"a KV cache of {spec.ctx} tokens (K {spec.kv_type_k}, V {spec.kv_type_v}) needs "
                          f"{format_bytes(n_bytes)} and the {device.upper()} has {format_bytes(available)} "
                          "available; "
                          f"{room}: lower -c/--ctx or store K/V in fewer bits (-ctk/-ctv q8_0, turbo3, ...; "
                          "-ctk auto -ctv auto picks the best that fit)" + (_MIRROR_NOTE if mirror else ""))
    return n_bytes


def check_budget(cfg: ModelConfig, spec: KVSpec, budget: int, *, mirror: bool = False) -> int:
    """Bytes of the cache `spec` describes; BudgetError when that exceeds `budget` (types chosen by hand)."""
    n_bytes = kv_bytes(cfg, spec, mirror=mirror)
    if n_bytes > budget:
        raise BudgetError(f"a KV cache of {spec.ctx} tokens (K {spec.kv_type_k}, V {spec.kv_type_v}) needs "
                          f"{format_bytes(n_bytes)}, over the budget of {format_bytes(budget)}; pass -ctk auto -ctv "
                          "auto (kv_type_k='auto', kv_type_v='auto') to pick the best types that fit, or lower "
                          "-c/--ctx" + (_MIRROR_NOTE if mirror else ""))
    return n_bytes


@dataclass(frozen=True)
class SpillPlan:
    """A cache too large for the device: global layers keep the newest `device_window` positions there, the
    rest in pinned host memory (kv/gpu_spill.py); sliding-window layers stay whole on the device."""

    spec: KVSpec  # with device_window set
    device_bytes: int
    host_bytes: int
    predicted_slowdown: float | None = None  # decode, against the whole cache (kv/spill_cost.py); None: not weighed

    def describe(self) -> str:
        cost = "" if self.predicted_slowdown is None else \
            f"; predicted decode slowdown +{self.predicted_slowdown:.0%}"
        return (f"KV cache spilled: the newest {self.spec.device_window} of {self.spec.ctx} positions on the device "
                f"({format_bytes(self.device_bytes)}), the rest in pinned host memory "
                f"({format_bytes(self.host_bytes)}){cost}")


def plan_spill(cfg: ModelConfig, spec: KVSpec, budget: int, host_available: float = float("inf")) -> SpillPlan:
    """The largest device window (at least one prefill chunk) whose device bytes fit `budget`, the older
    positions on the host. Device bytes grow by the same amount per window position (the global layers' rows),
    so the window is found by bisection on kv_bytes."""

    def device_bytes(window: int) -> int:
        return kv_bytes(cfg, replace(spec, device_window=window))

    lo, hi = spec.max_chunk, spec.ctx - 1
    if lo > hi or device_bytes(lo) > budget:
        need = device_bytes(min(lo, spec.ctx))
        raise BudgetError(f"even spilled, the KV cache needs {format_bytes(need)} on the device (sliding-window "
                          f"layers and one prefill chunk of {spec.max_chunk} positions of the global layers), over the "
                          f"budget of {format_bytes(budget)}; raise --kv-budget or store K/V in fewer bits (-ctk/-ctv)")
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if device_bytes(mid) <= budget else (lo, mid - 1)
    plan = SpillPlan(replace(spec, device_window=lo), device_bytes(lo),
                     host_kv_bytes(cfg, replace(spec, device_window=lo)))  # (in the tail types when set)
    if plan.host_bytes > host_available:
        raise BudgetError(f"{plan.describe()}, and the host has {format_bytes(host_available)} available; lower "
                          "-c/--ctx or store K/V in fewer bits (-ctk/-ctv)")
    return plan


def format_bytes(n_bytes: float) -> str:
    """Bytes, KiB, MiB below a GiB, else GiB (what `cupyllm info` and the plans print)."""
    if n_bytes < 2**10:
        return f"{n_bytes:.0f} bytes"
    if n_bytes < 2**20:
        return f"{n_bytes / 2**10:,.1f} KiB"
    return f"{n_bytes / 2**20:,.1f} MiB" if n_bytes < 2**30 else f"{n_bytes / 2**30:,.2f} GiB"


TAIL_FLOOR = "q4_0"  # an auto-typed spilled cache's host part takes at most this many bits (the "q4_0 floor")


def floor_tail(cfg: ModelConfig, spec: KVSpec) -> KVSpec:
    """`spec` with its spilled host part (the tail) in q4_0 where the window's type stores more bits per value
    (auto types with --kv-spill): the old positions, read with small weights and copied over PCIe every step,
    take the cheap type; the recent ones keep the tier's."""
    def floor(name: str) -> str | None:
        return TAIL_FLOOR if any(get_format(name, head_dim=d).bits_per_value >
                                 get_format(TAIL_FLOOR, head_dim=d).bits_per_value for d in cfg.head_dims()) else None
    return replace(spec, kv_type_k_tail=floor(spec.kv_type_k), kv_type_v_tail=floor(spec.kv_type_v))


def describe_tail(spec: KVSpec) -> str:
    """What a cache with tail types stores where (kv/window.py; a spilled cache's host part)."""
    where = (f"positions past the device window of {spec.device_window} (the host part)" if spec.spilled else
             f"positions past the newest {spec.kv_window}")
    return (f"KV tail: {where} stored as K {spec.tail_type_k}, V {spec.tail_type_v}; the window as K "
            f"{spec.kv_type_k}, V {spec.kv_type_v}")
