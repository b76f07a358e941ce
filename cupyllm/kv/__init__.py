"""The KV cache and its policies: the cache of every layer (cache.py), the tier and spill plans for a memory
budget (plan.py), prompt caches (prompt_cache.py), the device cache (gpu_cache.py, gpu_spill.py).

The storage formats themselves are operations (cupyllm/ops/kv_formats/); they are named here too, so that
``cupyllm.kv.get_format(name, head_dim=None)`` keeps working: a frozen format object with ``name``,
``block_values``, ``block_bytes``, ``bits_per_value``, ``encode(x)`` (float32 [n, d] -> uint8
[n, d // block_values * block_bytes]) and ``decode(data, d)``.
"""

from ..ops.kv_formats.formats import (KVFormat, KVFormatError, bits_per_value_for, get_format, group_format,
                                      group_values_for, is_rotated, list_formats)

__all__ = [
    "KVFormat",
    "KVFormatError",
    "bits_per_value_for",
    "get_format",
    "group_format",
    "group_values_for",
    "is_rotated",
    "list_formats",
]
