"""Which engine quantizes a module: the NumPy reference or a fast engine, never silently.

moeref holds the reference only. A fast engine is a plug-in: a package offers it under a name in the entry
point group :data:`ENTRY_POINT_GROUP` (``moeref.checkpoint_engines``; this repository's ``pyproject.toml``
declares ``triton = "fastpath.checkpoint_engine:ENGINE"``, the Triton fast path), or the caller passes the
engine object itself (``ConvertOptions(engine=ENGINE)``). Whatever computes the codes, the report is the
NumPy reference's: :func:`moeref.quant.requantize` (or its device twin,
:func:`moeref.quant.device_report.device_requantize`, bit-identical) measures the engine's result against the
exact source values, and ``--verify`` re-reads the written files with NumPy, so no figure of the report (and
no check of it) runs the engine's code.

``engine`` (:attr:`ConvertOptions.engine <moeref.checkpoint.ConvertOptions>`): ``"numpy"`` is the reference;
``"triton"`` (or the name of another installed engine, or an engine object) asks for that engine and raises
:class:`~moeref.checkpoint.CheckpointError` when it cannot run; ``"auto"`` takes the ``"triton"`` engine where
it is installed and says it runs (on a CUDA GPU), else the reference. The reason goes into the report.

An engine has a ``name`` and two methods:

* ``choose(scheme, shape, *, auto) -> (ok, reason, quantizer or None)``: whether it quantizes a tensor of
  ``shape`` into ``scheme`` here (``auto``: not asked for by name), and the quantizer
  ``quantizer(values, target, **static) -> QuantizedTensor`` (host arrays in, a host tensor out; a
  quantizer with a true attribute ``device_values`` also takes the values as a torch tensor on the device
  where the converter computes its report, :func:`moeref.quant.device_report.device_requantize`);
* ``source_quantizer(q, scheme, device=None) -> (quantizer or None, reason)``: optionally, a quantizer that
  reads a quantized source ``q`` directly (the same values :func:`moeref.quant.requantize` hands it).
"""
from __future__ import annotations

import functools

from .safetensors_io import CheckpointError

__all__ = ["ENGINES", "ENTRY_POINT_GROUP", "check_engine", "choose_engine", "cuda_available", "engine_name",
           "find_engine", "fused_source_quantizer", "installed_engines", "source_quantizer"]

ENGINES = ("auto", "numpy", "triton")
"""Engine names ``moeref convert --engine`` accepts (``"triton"`` once its package is installed)."""

ENTRY_POINT_GROUP = "moeref.checkpoint_engines"


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@functools.lru_cache(maxsize=1)
def _entry_points() -> tuple:
    """The entry points of :data:`ENTRY_POINT_GROUP`, read once per process (a scan of every installed
    distribution's metadata: milliseconds, which the converter would otherwise pay per module)."""
    from importlib.metadata import entry_points

    return tuple(entry_points(group=ENTRY_POINT_GROUP))


def installed_engines() -> dict:
    """``{name: entry point}`` of the fast engines installed in :data:`ENTRY_POINT_GROUP` (nothing loaded;
    read once per process)."""
    return {ep.name: ep for ep in _entry_points()}


def find_engine(name: str):
    """``(engine or None, reason)``: the installed engine ``name``, loaded, or why there is none."""
    ep = installed_engines().get(name)
    if ep is None:
        return None, (f"no engine {name!r} is installed (entry point group {ENTRY_POINT_GROUP!r}: install the "
                      "package that provides it; in this repository, reinstall moeref with `pip install -e .`)")
    try:
        return ep.load(), "ok"
    except ImportError as e:
        return None, f"cannot be imported: {e}"


def _is_engine(engine) -> bool:
    return callable(getattr(engine, "choose", None)) and isinstance(getattr(engine, "name", None), str)


def engine_name(engine) -> str:
    """The name the report gives ``engine`` (a name, or an engine object's ``name``)."""
    return engine if isinstance(engine, str) else engine.name


def check_engine(engine) -> None:
    """``ValueError`` unless ``engine`` is one of :data:`ENGINES` or an engine object."""
    if isinstance(engine, str):
        if engine not in ENGINES and engine not in installed_engines():
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, an installed engine's name or an "
                             f"engine object; got {engine!r}")
    elif not _is_engine(engine):
        raise ValueError(f"engine must be a name or an object with a name and a choose() method; got {engine!r}")


def choose_engine(engine, scheme, shape) -> tuple:
    """``(engine name, reason, quantizer or None)`` for one tensor; never silent.

    ``"auto"`` takes the ``"triton"`` engine where it is installed and runs (a CUDA GPU); an engine asked for
    by name or passed as an object raises :class:`CheckpointError` when it cannot run."""
    if isinstance(engine, str) and engine == "numpy":
        return "numpy", "asked for", None
    auto = isinstance(engine, str) and engine == "auto"
    if isinstance(engine, str):
        name = "triton" if auto else engine
        fast, why = find_engine(name)
        if fast is None:
            if auto:
                return "numpy", f"{name}: {why}", None
            raise CheckpointError(f"engine {name!r} {why}" if why.startswith("cannot") else why)
    else:
        fast = engine
    ok, why, quantizer = fast.choose(scheme, shape, auto=auto)
    if not ok:
        if auto:
            return "numpy", f"{fast.name}: {why}", None
        raise CheckpointError(f"engine {fast.name!r} {why}")
    return fast.name, why, quantizer


def source_quantizer(engine, q, scheme) -> tuple:
    """``(quantizer or None, reason)`` of the engine that :func:`choose_engine` chose (its name or object)
    for a quantized source ``q``: the engine's ``source_quantizer`` where it has one."""
    fast = engine
    if isinstance(engine, str):
        fast, why = find_engine(engine)
        if fast is None:
            return None, why
    if not callable(getattr(fast, "source_quantizer", None)):
        return None, f"engine {fast.name!r} reads decoded values only"
    return fast.source_quantizer(q, scheme)


def fused_source_quantizer(q, scheme, device: str | None = None) -> tuple:
    """Deprecated: :func:`fastpath.checkpoint_engine.fused_source_quantizer`, through the installed
    ``"triton"`` engine (moeref does not import the fast path)."""
    import warnings

    warnings.warn("moeref.checkpoint.engines.fused_source_quantizer moved to "
                  "fastpath.checkpoint_engine.fused_source_quantizer", DeprecationWarning, stacklevel=2)
    fast, why = find_engine("triton")
    if fast is None:
        return None, why
    return fast.source_quantizer(q, scheme, device)
