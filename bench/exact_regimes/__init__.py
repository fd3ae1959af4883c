"""The exact-regime GPU proof's parts (``bench/bench_exact_regimes.py`` is its entry point and driver).

* :mod:`bench.exact_regimes.models`: the models' shapes and schemes, the exact (or single-rounding) layer of a
  model, and a case made of some of its tokens (:func:`~bench.exact_regimes.models.token_case`);
* :mod:`bench.exact_regimes.draws`: the Hypothesis-drawn cases (:class:`~bench.exact_regimes.draws.Draw`, its
  strategy, the case of a draw);
* :mod:`bench.exact_regimes.torch_layer`: the layer in torch eager (cuBLAS bf16, CUTLASS ``torch._grouped_mm``,
  cuBLAS ``torch._scaled_mm``), its honest variants and EP shards, and the faults planted in it;
* :mod:`bench.exact_regimes.fastpath_runs`: ``fastpath.moe`` on the layer (Triton, DeepGEMM where it imports;
  contiguous, masked, capturable) and on EP shards.
"""
