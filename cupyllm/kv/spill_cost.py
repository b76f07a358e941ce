"""Cost-aware auto tiers for a spilled cache (`-ctk auto -ctv auto --kv-spill`): keep a better KV tier and spill
a little of it to the host when that is cheap, quantize when it is not.

A spilled decode step (kv/gpu_spill.py) copies every host row of every layer that reads a spilled cache over
PCIe, a staged chunk of `STAGE_TOKENS` rows at a time, moves the row its new key evicts from each spilled cache
to the host, and runs eagerly: a step that needs host positions is not captured as a CUDA graph
(api.Model._decode_forward). A tier's step, with the terms `measure_spill_rates` times on the device at load
(SpillRates):

    attention_s  = sum over attention layers of  attention_s_per_position * keys(layer) * values(layer) / probe_values
    whole_s      = graph_step_s + attention_s                                   (the tier wholly on the device)
    spilled_s    = eager_step_s + attention_s + streamed_bytes / h2d_bytes_per_s + n_stream_chunks * stream_chunk_s
                   + n_spilled_caches * evict_s
    slowdown     = spilled_s / whole_s - 1                                      (0 for a tier that fits whole)

keys(layer) is the context for global layers and the window for sliding ones, values(layer) its KV heads times
its K and V head dims (the attention probe's shape gives probe_values); streamed_bytes are the host rows the
layers read per step at a full cache (a KV-shared layer streams its source's rows again), n_stream_chunks the
staged copies they take, n_spilled_caches the global layers' own caches. The attention term is measured on an
f16 cache for every tier: the quantized tiers' kernels take longer per position (bench/results/attention_gpu.json),
which makes their true slowdown smaller than predicted (the error is on the safe side).

`plan_spill_tier` keeps the first tier of kv/plan.py's TIERS whose predicted slowdown is at most `max_slowdown`
(the first tier that fits whole has none, so nothing past it is considered), or the tier predicted fastest when
none is. Pure: the rates come in as numbers (tests/test_spill_cost.py), and only `measure_spill_rates` touches
the device.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import numpy as np

from ..errors import BudgetError, InputError
from ..files.config import ModelConfig
from ..ops.kv_formats.formats import get_format
from .cache import KVSpec, kv_bytes
from .gpu_spill import STAGE_TOKENS
from .plan import TIERS, KVPlan, KVTier, SpillPlan, format_bytes, plan_spill, tier_fits_model

DEFAULT_MAX_SLOWDOWN = 0.20


def check_max_slowdown(value) -> float:
    """--kv-spill-max-slowdown / kv_spill_max_slowdown=: a finite fraction >= 0, or its text (None: the default
    0.20)."""
    if value is None:
        return DEFAULT_MAX_SLOWDOWN
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass  # (the error below names the text)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or \
            not 0 <= float(value) < math.inf:
        raise InputError(f"kv_spill_max_slowdown (--kv-spill-max-slowdown) must be a number >= 0, the decode "
                         f"slowdown a spilled KV tier may cost (0.2: 20% slower), got {value!r}")
    return float(value)


@dataclass(frozen=True)
class SpillRates:
    """What a spilled decode step costs on this device, timed at load (measure_spill_rates)."""

    h2d_bytes_per_s: float  # pinned host rows into the device staging buffer, as kv/gpu_spill.py copies them
    attention_s_per_position: float  # one layer's decode attention per cached position (f16 cache, probe shape)
    probe_values: int  # KV heads x (K + V head dims) of the probed layer: other shapes scale by theirs
    stream_chunk_s: float  # one staged chunk of host rows beyond its bytes: launches, the partial, the LSE merge
    evict_s: float  # a spilled cache's one-token write beyond a device cache's: the evicted row to the host
    eager_step_s: float  # a one-token step launched from Python (near-empty cache): what a spilled step pays
    graph_step_s: float  # the same step replayed as a CUDA graph (= eager_step_s where graphs are off)

    def describe(self) -> str:
        return (f"host->device {self.h2d_bytes_per_s / 1e9:.1f} GB/s, attention "
                f"{self.attention_s_per_position * 1e9:.3g} ns per position and layer, "
                f"{self.stream_chunk_s * 1e6:.0f} us per staged chunk, {self.evict_s * 1e6:.0f} us per evicted row, "
                f"step {self.eager_step_s * 1e3:.2f} ms eager / {self.graph_step_s * 1e3:.2f} ms as a graph")


@dataclass(frozen=True)
class TierCost:
    """One tier as planned for the budget, with its predicted decode step at a full cache."""

    tier: KVTier
    spec: KVSpec  # device_window set when it spills
    device_bytes: int
    host_bytes: int  # kv/plan.py's host part (0: fits whole)
    streamed_bytes: int  # host rows copied per decode step
    n_stream_chunks: int
    whole_s: float  # predicted step, the tier wholly on the device
    step_s: float  # predicted step as planned

    @property
    def spills(self) -> bool:
        return self.spec.spilled

    @property
    def slowdown(self) -> float:
        return self.step_s / self.whole_s - 1.0 if self.spills else 0.0


@dataclass(frozen=True)
class SpillChoice:
    costs: tuple[TierCost, ...]  # the tiers considered, best first, up to the first that fits whole
    chosen: TierCost
    max_slowdown: float
    budget: int
    rates: SpillRates

    def describe(self) -> str:
        tiers = "; ".join(f"{c.tier.name} " + (f"spills {format_bytes(c.host_bytes)}, predicted +{c.slowdown:.0%}"
                                               if c.spills else "fits whole")
                          for c in self.costs)
        why = ("within" if self.chosen.slowdown <= self.max_slowdown else "none within, the fastest of") + \
            f" --kv-spill-max-slowdown {self.max_slowdown:.0%}"
        return (f"KV cache {self.chosen.tier.name} (auto for {format_bytes(self.budget)} with --kv-spill, {why}: "
                f"{tiers})\n  measured: {self.rates.describe()}")

    def kv_plan(self) -> KVPlan:
        whole = kv_bytes_whole(self.chosen)
        return KVPlan(self.chosen.tier, self.chosen.spec.ctx, whole, self.budget, spill_choice=self)

    def spill_plan(self) -> SpillPlan | None:
        c = self.chosen
        return SpillPlan(c.spec, c.device_bytes, c.host_bytes, predicted_slowdown=c.slowdown) if c.spills else None


def kv_bytes_whole(cost: TierCost) -> int:
    return cost.device_bytes + cost.host_bytes


def _host_bytes_per_position(cfg: ModelConfig, spec: KVSpec, layer: int) -> int:
    """Bytes of one position of `layer`'s host part: in the tail types where the spec has them (kv/window.py)."""
    k_dim, v_dim = cfg.head_dim_of(layer), cfg.v_head_dim_of(layer)
    k_type = getattr(spec, "tail_type_k", None) or spec.kv_type_k
    v_type = getattr(spec, "tail_type_v", None) or spec.kv_type_v
    k_row = get_format(k_type, head_dim=k_dim).row_bytes(k_dim)
    v_row = get_format(v_type, head_dim=v_dim).row_bytes(v_dim)
    return cfg.n_kv_head_of(layer) * (k_row + v_row)


def predict_step(cfg: ModelConfig, spec: KVSpec, rates: SpillRates) -> tuple[float, float, int, int]:
    """(whole_s, step_s, streamed_bytes, n_stream_chunks) of one decode step at a full cache of `spec` (see the
    module's formula; step_s = whole_s when nothing spills)."""
    host_positions = spec.ctx - spec.device_window if spec.spilled else 0
    attention_s, streamed, chunks, evicting = 0.0, 0, 0, 0
    for layer in range(cfg.n_layer):
        if cfg.is_recurrent(layer):
            continue
        source = cfg.kv_source(layer)
        sliding = cfg.is_sliding(source)
        keys = min(spec.ctx, cfg.sliding_window) if sliding else spec.ctx
        values = cfg.n_kv_head_of(source) * (cfg.head_dim_of(source) + cfg.v_head_dim_of(source))
        attention_s += rates.attention_s_per_position * keys * values / rates.probe_values
        if host_positions and not sliding:
            streamed += host_positions * _host_bytes_per_position(cfg, spec, source)
            chunks += -(-host_positions // STAGE_TOKENS)
            evicting += source == layer
    whole_s = rates.graph_step_s + attention_s
    if not host_positions:
        return whole_s, whole_s, 0, 0
    step_s = (rates.eager_step_s + attention_s + streamed / rates.h2d_bytes_per_s + chunks * rates.stream_chunk_s
              + evicting * rates.evict_s)
    return whole_s, step_s, streamed, chunks


def best_tier_fits_whole(cfg: ModelConfig, ctx: int, budget: int, *, max_chunk: int = 512,
                         normalize_k: bool | None = None) -> bool:
    """Whether the best tier the model takes fits `budget` whole (then no spill is worth a cost, nothing is
    measured and plan_kv's choice stands)."""
    best = next(t for t in TIERS if tier_fits_model(t, cfg))
    spec = KVSpec(ctx=ctx, kv_type_k=best.kv_type_k, kv_type_v=best.kv_type_v, max_chunk=max_chunk,
                  normalize_k=normalize_k)
    return kv_bytes(cfg, spec) <= budget


def plan_spill_tier(cfg: ModelConfig, ctx: int, budget: int, rates: SpillRates, max_slowdown: float, *,
                    max_chunk: int = 512, normalize_k: bool | None = None,
                    host_available: float = float("inf"), host_types=None) -> SpillChoice:
    """The first tier (best quality first) whose predicted decode slowdown, spilled as plan_spill sizes it, is at
    most `max_slowdown`; else the tier predicted fastest. Tiers that cannot spill within the budget or the host
    memory are passed over; BudgetError (plan_spill's, for the smallest tier) when none can. host_types(spec):
    the spec a tier spills with (its host part's types, e.g. kv/plan.py floor_tail); None: the tier's own."""
    costs, last_error = [], None
    for tier in (t for t in TIERS if tier_fits_model(t, cfg)):
        spec = KVSpec(ctx=ctx, kv_type_k=tier.kv_type_k, kv_type_v=tier.kv_type_v, max_chunk=max_chunk,
                      normalize_k=normalize_k)
        whole = kv_bytes(cfg, spec)
        if whole <= budget:
            device_bytes, host_bytes = whole, 0
        else:
            try:
                plan = plan_spill(cfg, host_types(spec) if host_types else spec, budget, host_available)
            except BudgetError as exc:
                last_error = exc
                continue
            spec, device_bytes, host_bytes = plan.spec, plan.device_bytes, plan.host_bytes
        whole_s, step_s, streamed, chunks = predict_step(cfg, spec, rates)
        costs.append(TierCost(tier, spec, device_bytes, host_bytes, streamed, chunks, whole_s, step_s))
        if not host_bytes:
            break  # fits whole: no slowdown, and every later tier is worse in quality
    if not costs:
        raise last_error
    chosen = next((c for c in costs if c.slowdown <= max_slowdown), None) or min(costs, key=lambda c: c.slowdown)
    return SpillChoice(tuple(costs), chosen, max_slowdown, budget, rates)


# --- the measurement (the device) -----------------------------------------------------------------------

@dataclass(frozen=True)
class ProbeSizes:
    """How much the probes move and attend over: a few ms on a GPU; tiny on the CUDA emulator (whose kernels
    run on the CPU)."""

    copy_bytes: int = 32 << 20
    positions: tuple[int, int] = (2048, 16384)  # attention timed at both: the slope drops the launch cost
    host_rows: int = 1024  # the spilled probe's host part (one staged chunk)
    repeats: int = 5

    @classmethod
    def for_device(cls, cp) -> "ProbeSizes":
        if getattr(cp, "__cupyllm_emulated__", False):
            return cls(copy_bytes=64 << 10, positions=(16, 48), host_rows=16, repeats=1)
        return cls()


def _timed(cp, fn, repeats: int) -> float:
    """Median wall seconds of fn() over `repeats` runs after one warm-up, the device synchronized around each
    (the spilled path's copies are synchronous, so wall time is what a step pays)."""
    fn()
    times = []
    for _ in range(repeats):
        cp.cuda.Device().synchronize()
        start = time.perf_counter()
        fn()
        cp.cuda.Device().synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_spill_rates(transformer, sizes: ProbeSizes | None = None, *, graphs: bool | None = None) -> SpillRates:
    """Time the SpillRates terms on the transformer's GPU backend: a pinned host -> device copy the way
    kv/gpu_spill.py stages rows, f16 decode attention at the model's first global layer's shape over two lengths
    (the slope), the same layer spilled (its extra time beyond the copied bytes: the per-chunk cost; and a
    one-token write, which evicts a row, against the device layer's), and one
    decode step of the model over a near-empty cache, eager and replayed as a CUDA graph (graphs: whether the
    model's unspilled steps replay graphs; None: unless a layer routes experts, as api.Model._decode_forward
    decides). Frees what it allocated."""
    from ..kv.gpu_cache import device_layer_factory
    from ..kv.gpu_spill import SpilledLayerKV, _pinned
    from ..ops.kv_formats.gpu import GpuKVCodec

    ops, cfg = transformer.ops, transformer.cfg
    cp = ops.cp
    sizes = sizes or ProbeSizes.for_device(cp)
    rng = np.random.default_rng(0)
    pool = cp.get_default_memory_pool()

    host = _pinned((sizes.copy_bytes,))
    host[:] = 1
    stage = cp.empty(sizes.copy_bytes, cp.uint8)

    def copy_in():
        stage[:] = cp.asarray(host)

    h2d = sizes.copy_bytes / _timed(cp, copy_in, sizes.repeats)
    del host, stage

    layer = next((il for il in range(cfg.n_layer) if not cfg.is_sliding(il) and not cfg.is_recurrent(il)), 0)
    n_kv, k_dim, v_dim = cfg.n_kv_head_of(layer), cfg.head_dim_of(layer), cfg.v_head_dim_of(layer)
    make = device_layer_factory(lambda f, d, n: GpuKVCodec(f, d, n, registry=ops.registry), ops.inputs)
    f16_k, f16_v = get_format("f16", head_dim=k_dim), get_format("f16", head_dim=v_dim)
    q = cp.asarray(rng.standard_normal((1, cfg.n_head, k_dim), dtype=np.float32))
    short, long = sizes.positions

    def fill(kv_layer, start: int, stop: int):
        for first in range(start, stop, short):
            n = min(short, stop - first)
            k = cp.asarray(rng.standard_normal((n, n_kv, k_dim), dtype=np.float32))
            v = cp.asarray(rng.standard_normal((n, n_kv, v_dim), dtype=np.float32))
            kv_layer.write(k, v, np.arange(first, first + n))

    def attend(kv_layer, n_keys: int):
        return lambda: ops.attention(q, np.array([n_keys - 1]), kv_layer, scale=k_dim ** -0.5)

    whole = make(f16_k, f16_v, n_kv, k_dim, v_dim, capacity=long, ring=False, window=0, mirror=False,
                 normalize_k=False)
    fill(whole, 0, short)
    t_short = _timed(cp, attend(whole, short), sizes.repeats)
    fill(whole, short, long)
    t_long = _timed(cp, attend(whole, long), sizes.repeats)
    per_position = (t_long - t_short) / (long - short)
    if per_position <= 0:  # (noise on a tiny probe) the whole time per position, launches included
        per_position = t_long / long

    ring = make(f16_k, f16_v, n_kv, k_dim, v_dim, capacity=short, ring=True, window=0, mirror=False,
                normalize_k=False)
    spilled = SpilledLayerKV(ring, host_capacity=sizes.host_rows + sizes.repeats + 1)
    fill(spilled, 0, short + sizes.host_rows)
    t_spilled = _timed(cp, attend(spilled, short + sizes.host_rows), sizes.repeats)
    probe_bytes = sizes.host_rows * n_kv * (f16_k.row_bytes(k_dim) + f16_v.row_bytes(v_dim))
    chunk_s = max(0.0, t_spilled - t_short - per_position * sizes.host_rows - probe_bytes / h2d)
    k1 = cp.asarray(rng.standard_normal((1, n_kv, k_dim), dtype=np.float32))
    v1 = cp.asarray(rng.standard_normal((1, n_kv, v_dim), dtype=np.float32))
    t_write = _timed(cp, lambda: whole.write(k1, v1, np.array([long - 1])), sizes.repeats)
    next_position = iter(range(short + sizes.host_rows, short + sizes.host_rows + sizes.repeats + 1))
    t_evict = _timed(cp, lambda: spilled.write(k1, v1, np.array([next(next_position)])), sizes.repeats)
    evict_s = max(0.0, t_evict - t_write)
    del spilled, ring, whole

    if graphs is None:
        graphs = not any(getattr(block, "moe", None) is not None for block in transformer.layers)
    eager_s, graph_s = _step_times(transformer, sizes.repeats, graphs)
    pool.free_all_blocks()
    return SpillRates(h2d_bytes_per_s=h2d, attention_s_per_position=per_position,
                      probe_values=n_kv * (k_dim + v_dim), stream_chunk_s=chunk_s, evict_s=evict_s,
                      eager_step_s=eager_s,
                      graph_step_s=graph_s)


def _step_times(transformer, repeats: int, graphs: bool) -> tuple[float, float]:
    """(eager, graph) seconds of a one-token decode step over a near-empty f16 cache (its attention is
    negligible: the step's weights and launches)."""
    ops, cfg = transformer.ops, transformer.cfg
    cp = ops.cp
    n_steps = repeats + 2
    spec = KVSpec(ctx=4 * n_steps, max_chunk=1)
    token = np.array([min(1, cfg.n_vocab - 1)])

    def steps(forward):
        cache = ops.new_cache(cfg, spec)
        forward(token, np.array([0]), cache)  # warm-up (and, for graphs, the capture)
        times = []
        for position in range(1, n_steps):
            cp.cuda.Device().synchronize()
            start = time.perf_counter()
            forward(token, np.array([position]), cache)
            cp.cuda.Device().synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])

    eager = steps(transformer.forward)
    if not graphs:
        return eager, eager
    replayed = ops.decode_forward(transformer.forward, min_bucket=spec.ctx)
    graph = steps(replayed)
    enabled = replayed.enabled
    replayed.reset()
    return eager, (graph if enabled else eager)


def rates_from(values: dict) -> SpillRates:
    """A SpillRates from its fields (a JSON record of a measurement)."""
    return SpillRates(**{name: values[name] for name in SpillRates.__dataclass_fields__})


__all__ = ["DEFAULT_MAX_SLOWDOWN", "ProbeSizes", "SpillChoice", "SpillRates", "TierCost", "best_tier_fits_whole",
           "check_max_slowdown", "measure_spill_rates", "plan_spill_tier", "predict_step", "rates_from"]
