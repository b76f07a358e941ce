"""The CPU backend's first-run notice (cupyllm/backend/compile_notice.py)."""
from __future__ import annotations

from numba import njit


def test_first_compile_notice_names_cupyllm_kernels_once():
    """The one-line notice of a first run: written when a kernel of a cupyllm module starts compiling, once per
    listener, and not for other modules' kernels (a cached kernel broadcasts no compile event at all)."""
    import io

    from numba.core import event

    from cupyllm.backend.compile_notice import NOTICE, FirstCompileNotice

    def outside(x):
        return x + 1

    def ours(x):
        return x * 2

    def ours_too(x):
        return x * 3

    ours.__module__ = ours_too.__module__ = "cupyllm.fake_kernels"
    stream = io.StringIO()
    listener = FirstCompileNotice(stream)
    event.register("numba:compile", listener)
    try:
        assert njit(outside)(1) == 2
        assert stream.getvalue() == ""
        assert njit(ours)(2) == 4
        assert njit(ours_too)(2) == 6
    finally:
        event.unregister("numba:compile", listener)
    assert stream.getvalue() == NOTICE + "\n"
