"""`cupyllm rys-probe`: rank blocks of layers to repeat (models/layer_plan.py) by what they do to the model.

For every block [i, i + w) of a band of middle layers and a set of widths w, the model (loaded once; each plan
shares its weights) is scored on
- perplexity over a small fixed corpus (data/rys/corpus.txt, or --corpus), against the model without a plan, and
- a graded battery of short tasks (data/rys/battery.json: arithmetic, capitals, code completion; greedy, up to
  8 tokens or the first newline, a task passes when its answer is a substring of the reply).
Blocks that pass fewer tasks than the model without a plan are dropped; the rest rank by perplexity. Two plans
come out: the most efficient (perplexity gained per added layer) and the largest gain. docs/layer-plans.md.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Sequence

from tqdm.auto import tqdm

from .errors import InputError
from .models.layer_plan import LayerBlocks, describe


@dataclass(frozen=True)
class Task:
    kind: str  # arithmetic | facts | code
    prompt: str
    answer: str


@dataclass(frozen=True)
class Battery:
    tasks: tuple[Task, ...]
    max_tokens: int = 8
    stop: str = "\n"


@dataclass
class PlanScore:
    """One plan's scores: mean negative log-likelihood per corpus token (perplexity = exp of it) and tasks passed."""

    plan: str  # as --repeat-layers spells it; "" for the model without a plan
    added_layers: int
    nll: float
    passed: int
    passed_by_kind: dict = field(default_factory=dict)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)


@dataclass
class ProbeResult:
    model: str
    n_layer: int
    band: tuple[int, int]
    widths: tuple[int, ...]
    corpus_tokens: int
    n_tasks: int
    base: PlanScore
    candidates: list[PlanScore]

    def ranked(self) -> list[PlanScore]:
        """Candidates that pass at least the base model's tasks, lowest perplexity first (ties: fewer layers,
        then the earlier block)."""
        kept = [c for c in self.candidates if c.passed >= self.base.passed]
        return sorted(kept, key=lambda c: (c.nll, c.added_layers, c.plan))

    def gain(self, score: PlanScore) -> float:
        """Perplexity the plan takes off the base model's (negative: it got worse)."""
        return self.base.perplexity - score.perplexity

    def most_efficient(self) -> PlanScore | None:
        """The kept plan with the largest perplexity gain per added layer (None: no plan lowers perplexity)."""
        return max(self._gaining(), key=lambda c: (self.gain(c) / c.added_layers, -c.added_layers), default=None)

    def largest_gain(self) -> PlanScore | None:
        return max(self._gaining(), key=lambda c: (self.gain(c), -c.added_layers), default=None)

    def _gaining(self) -> list[PlanScore]:
        return [c for c in self.ranked() if self.gain(c) > 0]

    def to_json(self) -> dict:
        def row(score: PlanScore) -> dict:
            return {**asdict(score), "perplexity": score.perplexity, "gain": self.gain(score)}
        chosen = {name: (best.plan if best else None) for name, best in
                  (("most_efficient", self.most_efficient()), ("largest_gain", self.largest_gain()))}
        ranked = self.ranked()
        return {"model": self.model, "n_layer": self.n_layer, "band": list(self.band), "widths": list(self.widths),
                "corpus_tokens": self.corpus_tokens, "n_tasks": self.n_tasks, "base": row(self.base),
                "ranked": [row(c) for c in ranked], "dropped": [row(c) for c in self.candidates if c not in ranked],
                "plans": chosen}

    def table(self, top_k: int = 10) -> str:
        lines = [f"{'plan':<12}{'layers':>7}{'perplexity':>12}{'change':>9}{'tasks':>8}   by kind",
                 self._line(self.base, "(none)")]
        ranked = self.ranked()
        lines += [self._line(c) for c in ranked[:top_k]]
        dropped = len(self.candidates) - len(ranked)
        lines.append(f"{len(self.candidates)} blocks scored, {dropped} dropped (fewer tasks passed than without a "
                     "plan)")
        for name, best in (("most efficient", self.most_efficient()), ("largest gain", self.largest_gain())):
            lines.append(f"{name + ':':<16}" + (f'--repeat-layers "{best.plan}" (perplexity {best.perplexity:.3f}, '
                                                f'{self.gain(best):+.3f} per {best.added_layers} added layer(s))'
                                                if best else "no block lowers perplexity without losing tasks"))
        return "\n".join(lines)

    def _line(self, score: PlanScore, name: str | None = None) -> str:
        kinds = " ".join(f"{kind} {n}" for kind, n in score.passed_by_kind.items())
        change = score.perplexity / self.base.perplexity - 1
        return (f"{name or score.plan:<12}{self.n_layer + score.added_layers:>7}{score.perplexity:>12.3f}"
                f"{change:>+9.2%}{score.passed:>5}/{self.n_tasks:<2}   {kinds}")


def default_battery() -> Battery:
    return read_battery(resources.files("cupyllm.data") / "rys" / "battery.json")


def read_battery(path) -> Battery:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        tasks = tuple(Task(t["kind"], t["prompt"], t["answer"]) for t in data["tasks"])
        return Battery(tasks, int(data.get("max_tokens", 8)), str(data.get("stop", "\n")))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"cannot read the task battery {path}: {exc}") from None


def corpus_text(path: str | Path | None = None) -> str:
    """The perplexity corpus: `path`'s text (UTF-8), or the shipped one."""
    if path is None:
        return (resources.files("cupyllm.data") / "rys" / "corpus.txt").read_text(encoding="utf-8")
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read the corpus {path}: {exc}; give a UTF-8 text file") from None


def band_and_widths(n_layer: int, band: str | Sequence[int] = "auto",
                    widths: str | Sequence[int] = "auto") -> tuple[tuple[int, int], tuple[int, ...]]:
    """The band [lo, hi) of layers blocks may cover (auto: all but max(3, n_layer / 8) at each end, the layers
    layer_plan.boundary_warning leaves alone) and the block widths (auto: 1, 2, 4, ... up to half the band)."""
    if band == "auto":
        margin = max(3, n_layer // 8)
        lo, hi = (margin, n_layer - margin) if n_layer - 2 * margin >= 1 else (0, n_layer)
    else:
        lo, hi = _ints(band, "--band", 2)
    if not 0 <= lo < hi <= n_layer:
        raise InputError(f"--band {lo},{hi}: give layers lo,hi with 0 <= lo < hi <= {n_layer}")
    if widths == "auto":
        widths = tuple(1 << k for k in range(8) if (1 << k) <= max(1, (hi - lo) // 2))
    else:
        widths = tuple(sorted(set(_ints(widths, "--widths"))))
    if not widths or not all(0 < w <= hi - lo for w in widths):
        raise InputError(f"--widths {widths}: each width must be 1 .. {hi - lo} (the band's layers)")
    return (lo, hi), widths


def _ints(value, flag: str, count: int | None = None) -> tuple[int, ...]:
    try:
        parts = tuple(int(v) for v in (value.split(",") if isinstance(value, str) else value))
    except (TypeError, ValueError):
        parts = ()
    if not parts or (count is not None and len(parts) != count):
        raise InputError(f"{flag} {value!r}: give {count or 'some'} comma-separated layer numbers, or auto")
    return parts


def candidate_plans(band: tuple[int, int], widths: Sequence[int]) -> list[LayerBlocks]:
    lo, hi = band
    return [((i, i + w),) for w in widths for i in range(lo, hi - w + 1)]


def score_plan(model, corpus_ids: Sequence[int], battery: Battery) -> PlanScore:
    """`model`'s (with its layer plan) mean corpus NLL and the battery's passes."""
    nll = model.token_nll(corpus_ids)
    by_kind: dict[str, int] = {}
    for task in battery.tasks:
        reply = model.generate(task.prompt, max_tokens=battery.max_tokens, temperature=0, stop=[battery.stop],
                               progress=False)
        by_kind[task.kind] = by_kind.get(task.kind, 0) + (task.answer in reply)
    added = model.cfg.n_layer - model.cfg.n_stored_layer
    return PlanScore(describe(model.repeat_layers), added, float(nll.mean()), sum(by_kind.values()), by_kind)


def probe(model, *, band: str | Sequence[int] = "auto", widths: str | Sequence[int] = "auto",
          corpus: str | None = None, battery: Battery | None = None, progress: bool = True) -> ProbeResult:
    """Score the model without a plan and with each block of the band and widths (the weights loaded once)."""
    stored = model.with_layer_plan(None)
    n_layer = stored.cfg.n_layer
    band, widths = band_and_widths(n_layer, band, widths)
    battery = battery or default_battery()
    corpus_ids = stored.tokenize(corpus if corpus is not None else corpus_text())
    if len(corpus_ids) < 2:
        raise InputError("the corpus needs at least two tokens to score")
    if len(corpus_ids) > stored.kv_spec.ctx:
        raise InputError(f"the corpus has {len(corpus_ids)} tokens and the context {stored.kv_spec.ctx}: raise "
                         "-c/--ctx or give a shorter --corpus")
    plans = candidate_plans(band, widths)
    base = score_plan(stored, corpus_ids, battery)
    scores = [score_plan(stored.with_layer_plan(plan), corpus_ids, battery)
              for plan in tqdm(plans, desc="rys-probe", unit="block", disable=not progress)]
    return ProbeResult(model=model.path.name, n_layer=n_layer, band=band, widths=widths,
                       corpus_tokens=len(corpus_ids), n_tasks=len(battery.tasks), base=base, candidates=scores)
