"""The float32 probe set of the fast paths' rounding checks (``test_fastpath_rounding.py``, and the GPU
check of ``test_fastpath_quant.py`` that the hardware FP8 cast equals the integer rounding)."""
from __future__ import annotations

import ml_dtypes
import numpy as np


def probe_values() -> np.ndarray:
    """Every bf16 bit pattern (as float32) and random float32 bit patterns and magnitudes."""
    allbf = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    rng = np.random.default_rng(20261121)
    with np.errstate(over="ignore"):
        mags = (rng.standard_normal(100000) * np.exp2(rng.uniform(-140, 128, 100000))).astype(np.float32)
    raw = rng.integers(0, 2**32, 100000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.concatenate([allbf, mags, raw])
