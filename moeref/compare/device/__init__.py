"""The device engine of :mod:`moeref.compare`: the layer bound of a device-engine run
(:func:`moeref.moe.run_moe` with ``device=``) on its device, as torch float64 tensors, bit for bit the bound
that :mod:`moeref.compare.bounds` defines in NumPy.

The definitions live in :mod:`moeref.compare` (:mod:`~moeref.compare.bounds`, :mod:`~moeref.compare.gemm_bounds`,
:mod:`~moeref.compare.operand_radius`, :mod:`~moeref.compare.stage_bounds`, :mod:`~moeref.compare.summation_order`);
this package evaluates them fast and imports them, never the reverse (:func:`moeref.compare.layer_bound` reaches
:mod:`.layer` for a device run only):

* :mod:`.layer`: the layer bound stage by stage (:func:`~moeref.compare.device.layer.device_layer_bound`);
* :mod:`.bounds` and :mod:`.adder`: the GEMM error bounds and the operand-radius term, on the operands of
  :mod:`.operands`; :mod:`.emulated`: the GEMMs of an emulated profile; :mod:`.requant`: the flip-aware
  re-quantization;
* the Triton kernels they launch (``_*_kernels``, ``_adder_mma``), with their float64 constants read from a tensor
  (:mod:`._constants`).

Needs torch and Triton (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``); ``import moeref.compare`` does not
import this package.
"""
