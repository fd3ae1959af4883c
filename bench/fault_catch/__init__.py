"""The planted-fault study's parts (``bench/bench_fault_catch.py`` is its entry point and driver).

* :mod:`bench.fault_catch.cases`: the layers and shapes, the exact-regime and general cases, the reference run,
  and the faults that edit a kernel's inputs or output (they wrap any honest kernel);
* :mod:`bench.fault_catch.layer`: the honest layer in torch eager, the steps its internal faults and honest
  variants replace (:class:`~bench.fault_catch.layer.Hooks`), and the lists of faults and honest variants.
"""
