"""KV-cache storage formats (NumPy references that define every byte; CUDA kernels must match them).

``get_format(name, head_dim=None)`` -> a frozen format object with ``name``, ``block_values``, ``block_bytes``,
``bits_per_value``, ``encode(x)`` (float32 [n, d] -> uint8 [n, d // block_values * block_bytes]) and
``decode(data, d)``. Rotated formats (turbo*, *_tcq) also have ``rotate``/``unrotate`` and
``encode_rotated``/``decode_rotated``. Layouts: ``scalar`` (f32, f16, bf16, q8_0, q6_0, q5_1, q5_0, q4_1, q4_0),
``turbo`` (turbo4/3/2), ``tcq`` (turbo3_tcq, turbo2_tcq).
"""

from cupyllm.kv.formats import (
    KVFormat,
    KVFormatError,
    bits_per_value_for,
    get_format,
    group_format,
    group_values_for,
    is_rotated,
    list_formats,
)

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
