"""The errors a user can cause. Each message says what was wrong and what to do about it."""


class CupyllmError(Exception):
    """Base class: the CLI prints these as one line, without a traceback."""


class InputError(CupyllmError, ValueError):
    """A value given to cupyllm that it cannot use: a flag or an argument of load/generate out of its range, a
    prompt file it cannot decode, a prompt cache that does not fit the model. A ValueError in the Python API."""


class ModelFileError(CupyllmError):
    """A model file is missing, truncated, corrupt, or of an architecture/tensor type we do not run."""


class ContextOverflowError(CupyllmError):
    """A request needs more KV positions than the cache was sized for."""


class BudgetError(CupyllmError):
    """A memory budget that no KV plan can fit."""


class DeviceError(CupyllmError):
    """The GPU path was asked for but is not usable (no CuPy, no device, a kernel failed to compile)."""


class SamplingError(CupyllmError, ValueError):
    """A sampling parameter out of its range (top-k, top-p, min-p, repeat penalty)."""


class ContextPastTrainingWarning(UserWarning):
    """A context larger than the model was trained on, without Dual Chunk Attention (llama.cpp warns alike)."""


class ModelFileWarning(UserWarning):
    """A model file that loads but carries something cupyllm does not use (tensors of unknown names)."""
