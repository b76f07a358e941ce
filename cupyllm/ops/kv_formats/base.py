"""What every KV-cache storage format is: the `KVFormat` dataclass (rows of float32 values <-> uint8 rows of
whole blocks) and its argument checks. The formats themselves are in scalar.py, turbo.py and tcq.py; formats.py
names them (`get_format`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import CupyllmError

MAX_GROUP_VALUES = 128  # the rotated formats never rotate more than 128 values together


class KVFormatError(CupyllmError, ValueError):
    """An unknown KV format name, or arrays of the wrong shape/dtype handed to a KV format."""


@dataclass(frozen=True)
class KVFormat:
    """One storage format. Subclasses implement ``encode`` and ``decode``."""

    name: str
    block_values: int  # values per block
    block_bytes: int  # bytes per block

    @property
    def bits_per_value(self) -> float:
        return self.block_bytes * 8 / self.block_values

    def row_bytes(self, d: int) -> int:
        """Bytes one row of ``d`` values takes."""
        self._check_width(d)
        return d // self.block_values * self.block_bytes

    def encode(self, x: np.ndarray) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def decode(self, data: np.ndarray, d: int) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- argument checks shared by all formats -------------------------------------------------

    def _check_width(self, d: int) -> None:
        if d <= 0 or d % self.block_values:
            raise KVFormatError(
                f"KV format {self.name!r} stores blocks of {self.block_values} values, but the row width is {d}; "
                f"use a row width that is a positive multiple of {self.block_values}"
            )

    def _float_rows(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x)
        if x.ndim != 2:
            raise KVFormatError(
                f"KV format {self.name!r}: encode takes a 2-D array [n, d], got shape {x.shape}; reshape it first"
            )
        if not np.issubdtype(x.dtype, np.floating):
            raise KVFormatError(f"KV format {self.name!r}: encode takes float values, got dtype {x.dtype}")
        self._check_width(x.shape[1])
        return np.ascontiguousarray(x, dtype=np.float32)

    def _byte_rows(self, data: np.ndarray, d: int) -> np.ndarray:
        data = np.asarray(data)
        self._check_width(d)
        want = self.row_bytes(d)
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != want:
            raise KVFormatError(
                f"KV format {self.name!r}: decode of rows of {d} values takes uint8 [n, {want}], "
                f"got {data.dtype} {data.shape}; pass the bytes encode() returned"
            )
        return np.ascontiguousarray(data)
