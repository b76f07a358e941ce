"""KV-cache storage formats: the registry that names them (their common dataclass is base.py's).

A KV format turns float32 rows ``[n, d]`` (``d`` a multiple of ``block_values``) into uint8 rows
``[n, d // block_values * block_bytes]`` and back. Blocks are stored back to back along the row, in the
order of the values they hold; nothing else is stored (no row header, no padding between blocks).

Formats (``list_formats()``):

========== ====== =========== ==============================================================
name       values bytes       module / layout
========== ====== =========== ==============================================================
f32        1      4           ``scalar``: IEEE float32, little-endian (exact)
f16        1      2           ``scalar``: IEEE binary16, round-to-nearest-even
bf16       1      2           ``scalar``: bfloat16, round-to-nearest-even (NaN kept quiet)
q8_0       32     34          ``scalar``: llama.cpp block_q8_0
q6_0       32     26          ``scalar``: ik_llama.cpp block_q6_0
q5_1       32     24          ``scalar``: llama.cpp block_q5_1
q5_0       32     22          ``scalar``: llama.cpp block_q5_0
q4_1       32     20          ``scalar``: llama.cpp block_q4_1
q4_0       32     18          ``scalar``: llama.cpp block_q4_0
turbo4     G      2 + G/2     ``turbo``: WHT rotation + fp16 norm + 4-bit Lloyd-Max codes
turbo3     G      2 + 3G/8    ``turbo``: same, 3-bit codes
turbo2     G      2 + G/4     ``turbo``: same, 2-bit codes
turbo3_tcq G      4*ceil(..)  ``tcq``: rotation + norm + bitshift trellis, k=3, L=9 (52 B at G=128)
turbo2_tcq G      4*ceil(..)  ``tcq``: rotation + norm + bitshift trellis, k=2, L=8 (36 B at G=128)
========== ====== =========== ==============================================================

The rotated formats work on groups of ``G = min(128, head_dim)`` values of one head (``G`` a power of two):
``get_format(name)`` gives ``G = 128``; ``get_format(name, head_dim=64)`` or ``group_format(name, 64)`` gives
64-value groups (Qwen2.5-0.5B). ``bits_per_value_for(name, head_dim)`` reports the storage cost.
"""

from __future__ import annotations

import functools

from . import scalar, tcq, turbo
from .base import MAX_GROUP_VALUES, KVFormat, KVFormatError

__all__ = ["KVFormat", "KVFormatError", "MAX_GROUP_VALUES", "bits_per_value_for", "get_format", "group_format",
           "group_values_for", "is_float", "is_rotated", "list_formats"]


_ROTATED_NAMES = ("turbo4", "turbo3", "turbo2", "turbo3_tcq", "turbo2_tcq")
_FLOAT_NAMES = ("f32", "f16", "bf16")
_SCALAR_NAMES = _FLOAT_NAMES + ("q8_0", "q6_0", "q5_1", "q5_0", "q4_1", "q4_0")


def list_formats() -> list[str]:
    """Every format name, scalar ones first, from most to fewest bits."""
    return list(_SCALAR_NAMES + _ROTATED_NAMES)


def is_float(name: str) -> bool:
    """True for the unquantized formats (f32, f16, bf16)."""
    return name in _FLOAT_NAMES


def is_rotated(name: str) -> bool:
    """True for the formats that store WHT-rotated groups (turbo*, *_tcq)."""
    return name in _ROTATED_NAMES


def group_values_for(head_dim: int) -> int:
    """Group size of the rotated formats for a head dimension: ``min(128, head_dim)``."""
    if head_dim <= 0:
        raise KVFormatError(f"head_dim must be positive, got {head_dim}")
    return min(MAX_GROUP_VALUES, head_dim)


@functools.lru_cache(maxsize=None)
def group_format(name: str, group_values: int) -> KVFormat:
    """A rotated format (turbo*, *_tcq) with groups of ``group_values`` values (a power of two, 2..128)."""
    if name not in _ROTATED_NAMES:
        if name in _SCALAR_NAMES:
            raise KVFormatError(f"KV format {name!r} has no groups; use get_format({name!r})")
        raise _unknown(name)
    if name.endswith("_tcq"):
        return tcq.make_format(name, group_values)
    return turbo.make_format(name, group_values)


def get_format(name: str, head_dim: int | None = None) -> KVFormat:
    """The format called ``name``. For rotated formats ``head_dim`` picks the group size ``min(128, head_dim)``
    (default 128); the scalar formats ignore it apart from checking it is a multiple of their block."""
    if name in _ROTATED_NAMES:
        group = MAX_GROUP_VALUES if head_dim is None else group_values_for(head_dim)
        fmt = group_format(name, group)
    elif name in _SCALAR_NAMES:
        fmt = _scalar_formats()[name]
    else:
        raise _unknown(name)
    if head_dim is not None and head_dim % fmt.block_values:
        raise KVFormatError(
            f"KV format {name!r} stores blocks of {fmt.block_values} values, which do not tile head_dim {head_dim}; "
            f"pick another KV format (f16 / q8_0 need head_dim % 32 == 0 for the q* types)"
        )
    return fmt


def bits_per_value_for(name: str, head_dim: int) -> float:
    """Storage bits per cached value of format ``name`` for heads of ``head_dim`` values."""
    return get_format(name, head_dim=head_dim).bits_per_value


@functools.lru_cache(maxsize=1)
def _scalar_formats() -> dict[str, KVFormat]:
    return {f.name: f for f in scalar.all_formats()}


def _unknown(name: str) -> KVFormatError:
    return KVFormatError(f"unknown KV format {name!r}; choose one of: {', '.join(list_formats())}")
