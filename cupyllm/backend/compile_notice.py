"""One line on stderr when numba starts compiling one of cupyllm's CPU kernels during a run.

The CPU backend compiles every kernel into numba's cache before its first run on a machine, with a progress bar
(backend/precompile.py), so a run normally loads them all from the cache in milliseconds and compiles nothing.
Should a kernel still compile (argument types the precompile did not cover), it takes seconds to a minute, and
without a word a `cupyllm generate` would look hung: this says so. numba broadcasts a "numba:compile" event only
when it really compiles, so a cached run prints nothing.
"""
from __future__ import annotations

import sys
import threading

from numba.core import event

NOTICE = ("cupyllm: compiling a CPU kernel that numba's cache does not hold for these argument types (seconds to a "
          "minute; cached for later runs)")


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
