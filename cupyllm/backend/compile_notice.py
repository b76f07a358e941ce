"""One line on stderr when numba starts compiling cupyllm's CPU kernels.

The first run on a machine spends a minute or two compiling them (later runs load numba's cache in
milliseconds); without a word, a first `cupyllm generate` looks hung in its prefill. numba broadcasts a
"numba:compile" event only when it really compiles, so a cached run prints nothing.
"""
from __future__ import annotations

import sys
import threading

from numba.core import event

NOTICE = ("cupyllm: compiling the CPU kernels for this machine (the first run only, a minute or two on two cores; "
          "numba caches them)")


class FirstCompileNotice(event.Listener):
    """Writes NOTICE to `stream` when the first kernel of a cupyllm module starts compiling."""

    def __init__(self, stream=None):
        self.stream = stream
        self.said = False

    def on_start(self, ev):
        if self.said:
            return
        dispatcher = (ev.data or {}).get("dispatcher")
        module = getattr(getattr(dispatcher, "py_func", None), "__module__", None) or ""
        if module.startswith("cupyllm."):
            self.said = True
            print(NOTICE, file=self.stream or sys.stderr, flush=True)

    def on_end(self, ev):
        pass


_lock = threading.Lock()
_installed: list[FirstCompileNotice] = []  # numba's listeners are per process: one notice per process


def install() -> FirstCompileNotice:
    """Register the notice once per process (the CPU backend does, when it is created)."""
    with _lock:
        if not _installed:
            listener = FirstCompileNotice()
            event.register("numba:compile", listener)
            _installed.append(listener)
        return _installed[0]


def compiled_this_process() -> bool:
    """Whether the notice was given: a cupyllm kernel compiled in this process (its timings include that)."""
    return bool(_installed) and _installed[0].said
