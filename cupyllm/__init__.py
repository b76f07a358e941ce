"""cupyllm: long-context LLM inference for Gemma and Qwen GGUF models (NumPy/numba on the CPU, CuPy + our CUDA
kernels on the GPU). Start with `cupyllm.load()`."""
from .api import Model, load
from .errors import (BudgetError, ContextOverflowError, ContextPastTrainingWarning, CupyllmError, DeviceError,
                     InputError, ModelFileError, ModelFileWarning)
from .kv.prompt_cache import PromptCache

__all__ = ["load", "Model", "PromptCache", "CupyllmError", "InputError", "ModelFileError", "ContextOverflowError",
           "BudgetError", "DeviceError", "ContextPastTrainingWarning", "ModelFileWarning"]
__version__ = "0.1.0"
