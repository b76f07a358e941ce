"""Speculative decoding: drafters propose tokens, the target checks them all in one forward and keeps what its
own sampling would have produced (decoder.py), so the output is the target's, only sooner.

Drafters: n-gram lookup in the text so far (ngram.py), a draft model of the same vocabulary (draft_model.py),
the model itself ("self": every greedy draft is kept; the loop's own test), a Qwen3.5 / Qwen3-Next file's own
NextN (MTP) head ("mtp", mtp.py) and a Gemma 4 assistant ("assistant", gemma4_assistant.py). factory.py makes the
drafter of a SpecConfig for a loaded model.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import InputError
from .decoder import DraftLength, DraftStats, Drafter, TokenSource
from .draft_model import ModelDrafter, check_same_vocabulary
from .mtp import MTPDrafter
from .ngram import NgramDrafter

SPEC_TYPES = ("ngram", "draft", "self", "mtp", "assistant")

__all__ = ["SpecConfig", "SPEC_TYPES", "DraftLength", "DraftStats", "Drafter", "TokenSource", "ModelDrafter",
           "MTPDrafter", "NgramDrafter", "check_same_vocabulary", "spec_config"]


@dataclass(frozen=True)
class SpecConfig:
    """What to draft with, and how much (llama.cpp's --spec-type, --draft-max, --draft-min, --draft-p-min,
    --spec-ngram-size).

    type: "ngram" (prompt lookup), "draft" (the draft model given to load), "assistant" (the Gemma 4 assistant
    given to load as its draft model: gemma4_assistant.py), "self" (the model drafts for itself),
    "mtp" (the model file's NextN head: Qwen3.5 / Qwen3-Next GGUFs converted with it).
    draft_max: most tokens drafted per step; draft_min: fewest, once drafting (adaptive: 0 lets it stop drafting
    where drafts do not pay). adaptive: choose each step's length from the measured acceptance and forward
    costs (DraftLength); False: always draft_max. draft_p_min: a draft model (or an MTP head) stops where its
    top token's probability is below this. ngram_size / ngram_min: the longest and shortest n-gram looked up."""

    type: str = "ngram"
    draft_max: int = 16
    draft_min: int = 0
    draft_p_min: float = 0.75
    ngram_size: int = 3
    ngram_min: int = 2
    adaptive: bool = True

    def __post_init__(self):
        wrong = [f"{name} {value!r} (need {rule})" for name, value, ok, rule in (
            ("type", self.type, self.type in SPEC_TYPES, " or ".join(SPEC_TYPES)),
            ("draft_max", self.draft_max, _count(self.draft_max) and self.draft_max >= 1, "a count >= 1"),
            ("draft_min", self.draft_min, _count(self.draft_min) and 0 <= self.draft_min <= self.draft_max,
             "a count from 0 to draft_max"),
            ("draft_p_min", self.draft_p_min, isinstance(self.draft_p_min, (int, float))
             and 0.0 <= self.draft_p_min <= 1.0, "0 <= p <= 1"),
            ("ngram_size", self.ngram_size, _count(self.ngram_size) and self.ngram_size >= 1, "a count >= 1"),
            ("ngram_min", self.ngram_min, _count(self.ngram_min) and 1 <= self.ngram_min <= self.ngram_size,
             "a count from 1 to ngram_size"))
            if not ok]
        if wrong:
            raise InputError("speculative decoding option out of range: " + "; ".join(wrong))


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def spec_config(spec) -> SpecConfig | None:
    """spec as given to load() / generate(): None, a type name ("ngram", "draft", "self"), a dict of SpecConfig's
    fields, or a SpecConfig."""
    if spec is None or isinstance(spec, SpecConfig):
        return spec
    if isinstance(spec, str):
        return SpecConfig(type=spec)
    if isinstance(spec, dict):
        unknown = set(spec) - {f.name for f in dataclasses.fields(SpecConfig)}
        if unknown:
            raise InputError(f"unknown speculative decoding option(s) {', '.join(sorted(unknown))}; known: "
                             + ", ".join(f.name for f in dataclasses.fields(SpecConfig)))
        return SpecConfig(**spec)
    raise InputError(f"spec must be a type name ({', '.join(SPEC_TYPES)}), a dict or a SpecConfig; got {spec!r}")
