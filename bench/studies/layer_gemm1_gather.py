"""The layer before scattered-row GEMM1 (``bench/bench_moe_device.py --before bench.studies.layer_gemm1_gather``):
:func:`fastpath.moe.fused_moe` with :data:`fastpath._moe_layer.GEMM1_SCATTER_FOR_GLUON` off, so an FP8 Triton
layer's GEMM1 reads the token rows through ``a_src`` with the TMA tiles instead of running the Gluon kernel on
scattered layout rows; no graph cache (every launch of the call). The same bits."""
from __future__ import annotations

import fastpath._moe_layer as _ml
from fastpath import moe as _moe


def fused_moe(*args, **kw):
    """:func:`fastpath.moe.fused_moe` (``graph_cache=False``) with GEMM1 on gathered rows."""
    old = _ml.GEMM1_SCATTER_FOR_GLUON
    _ml.GEMM1_SCATTER_FOR_GLUON = False
    try:
        return _moe.fused_moe(*args, graph_cache=False, **kw)
    finally:
        _ml.GEMM1_SCATTER_FOR_GLUON = old
