"""moeref: exact references for Mixture-of-Experts numerics and quantization.

Subpackages: ``formats`` (element codecs), ``quant`` (scaling schemes), ``layouts`` (scale
layouts), ``routing``, ``dispatch``, ``activations``, ``gemm``, ``moe`` (the layer as
prepare -> experts -> finalize), ``compare`` (error-bounded comparison), ``strategies``
(Hypothesis strategies; needs the ``test`` extra).
"""
__version__ = "0.1.0"
