"""Dual Chunk Attention on the CPU: the fused few-query kernel (the CPU twin of kernels_cu/dca_fused.cu: one pass
over the keys, the query rotation picked per key by its regime, one softmax: the split-K kernel of
cpu_encoded.py). Prefill streams key blocks through `dca.attend_dca` (three masked attentions per block, merged
by LSE; backend/cpu.py)."""
from __future__ import annotations

import numpy as np

from .cpu_encoded import attend_floats
from .dca import DCAConfig


def dca_few(q_intra, q_successive, q_inter, k, v, q_pos, k_pos, dca: DCAConfig, *, scale: float,
            softcap: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(O, LSE) of a few queries over float32 K / V: each key scored with its regime's query rotation (the
    encoded cache's kernel, cpu_encoded.py, reading float32 rows)."""
    return attend_floats(np.stack([q_intra, q_successive, q_inter]), k, v, q_pos, k_pos,
                         scale=scale * dca.logit_scale, softcap=softcap, chunk_len=dca.chunk_len)
