"""cupyllm: long-context LLM inference for Gemma and Qwen GGUF models (NumPy/numba on the CPU, CuPy + our CUDA
kernels on the GPU). Start with `cupyllm.load()`."""
from .api import Model, load
from .errors import BudgetError, ContextOverflowError, CupyllmError, DeviceError, ModelFileError

__all__ = ["load", "Model", "CupyllmError", "ModelFileError", "ContextOverflowError", "BudgetError", "DeviceError"]
__version__ = "0.1.0"
