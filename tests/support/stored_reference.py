"""Checks that arrays stored under tests/data/ are what their tool computes now."""
from __future__ import annotations

import numpy as np


def assert_recomputed_equal(fresh: dict, stored) -> None:
    """`fresh` (a tool's compute(), run now) holds the stored npz's arrays: floats within 1e-5 (BLAS builds sum in
    other orders), ids and hashes exactly."""
    assert sorted(fresh) == sorted(stored.files)
    for name, value in fresh.items():
        if value.dtype.kind == "f":
            np.testing.assert_allclose(value, stored[name], atol=1e-5, rtol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(value, stored[name], err_msg=name)
