"""The requantization report on a torch device (a CUDA GPU, or torch CPU): the same figures as the host
report (:func:`moeref.quant.requantize`), bit for bit.

The host report decodes the target and the source to float64 on the host, subtracts and reduces: at 8 bytes
per element it is what bounds ``moeref convert`` on the host. Here the same steps run on the device, as torch
operations whose results IEEE 754 fixes, and only a handful of numbers come back:

1. **decode**: :meth:`QuantizedTensor.dequantize(float64) <moeref.quant.QuantizedTensor.dequantize>` on the
   device: the codec's own decode table (:func:`moeref.formats.decode_table`) indexed by the codes (4-bit
   codes unpacked, even element low), times the float64 block scale values (FP32 scales widened, UE8M0 /
   UE4M3 codes through their tables, times the global factor): one correctly rounded float64 product per
   element, exact (at most 4 + 24 + 24 significant bits), as on the host;
2. **error** ``y - x``: one IEEE subtraction per element; the non-finite handling is the host's, operation
   for operation;
3. **norms**: :func:`device_sum_of_squares`, the host's :func:`moeref.quant.tensor.sum_of_squares` order
   (squares, rows of a power of two summed by halving, then the row sums): elementwise IEEE additions in
   the same order give the same float64 (a library reduction, whose order is the implementation's, would
   not);
4. **max, min, first index of the largest |error|, any nonzero**: exact whatever the order (``argmax`` and
   ``argmin`` return the first extreme element in torch as in NumPy);
5. the figures (``max_abs_error``, ``rel_l2``, ``sqnr_db``, ``worst_block``) from these host numbers by the
   host's own code, :func:`moeref.quant.tensor.report_from_sums`.

:func:`device_requantize` is :func:`moeref.quant.requantize` (and :func:`~moeref.quant.quantize_and_report`)
with this report. It covers the rule step and its report; where the rule is lossy and the lossless
candidates could apply (the three sample blocks of :func:`moeref.quant.lossless.sample_blocks`, copied to the
host, are representable), it returns None and the caller runs the host :func:`~moeref.quant.requantize`, which
tries them (the report says where it was computed). ``tests/test_device_report.py`` checks every field against
the host report bit for bit, on torch CPU tensors and, where there is one, on a CUDA GPU.

Like :mod:`moeref.quant.device`, this module shares no kernel with the fast paths (``fastpath``): moeref is
the oracle.
"""
from __future__ import annotations

import numpy as np

from ..formats import decode_table
from .lossless import _searchable, sample_block_representable, sample_blocks
from .quantized import QuantizedTensor
from .scheme import Scheme
from .tensor import ReportSums, RequantReport, _sum_row, _halve_rows, quantize, report_from_sums

__all__ = ["device_sum_of_squares", "device_dequantize", "device_codes_amax", "device_report", "device_requantize",
           "device_report_unavailable", "upload", "remember_upload", "clear_uploads"]


def _torch():
    import torch

    return torch


def device_sum_of_squares(t) -> float:
    """:func:`moeref.quant.tensor.sum_of_squares` of the float64 tensor ``t``, on its device, in the same
    order (the same float64)."""
    return float(_sum_of_squares(t))


def _sum_of_squares(t):
    """:func:`device_sum_of_squares` as a 0-d float64 tensor on ``t``'s device (the host does not wait)."""
    torch = _torch()
    a = t.reshape(-1)
    square = True
    while True:
        n = a.numel()
        if n == 0:
            return torch.zeros((), dtype=torch.float64, device=a.device)
        if n == 1 and not square:
            return a[0]
        r = _sum_row(n)
        rows = -(-n // r)
        b = torch.zeros(rows * r, dtype=torch.float64, device=a.device)
        if square:
            torch.mul(a, a, out=b[:n])
        else:
            b[:n] = a
        b = b.reshape(rows, r)
        _halve_rows(b)
        a, square = b[:, 0].contiguous(), False


_DECODE: dict = {}


def _table(name: str, device):
    key = (name, str(device))
    if key not in _DECODE:
        _DECODE[key] = _torch().as_tensor(np.array(decode_table(name), np.float64), device=device)
    return _DECODE[key]


def _device_scales(scales, scheme: Scheme, global_scale, dev):
    """The block scales of ``scheme`` as float64 on ``dev`` (FP32 scales converted, E8M0 / UE4M3 codes decoded
    by table), times ``global_scale`` where given (a Python float: no host-to-device copy; the float64 product is
    the same)."""
    torch = _torch()
    fmt = scheme.scale_format
    if fmt == "fp32":
        s = scales.to(torch.float64)
    else:
        s = _table("e8m0" if fmt == "ue8m0" else "ue4m3", dev)[scales.to(torch.int64)]
    if global_scale is not None:
        s = s * float(global_scale)
    return s


def device_dequantize(codes, scales, scheme: Scheme, shape: tuple, global_scale: float | None = None):
    """:meth:`QuantizedTensor.dequantize(np.float64) <moeref.quant.QuantizedTensor.dequantize>` of the codes
    and stored scales (torch tensors on one device, laid out as ``QuantizedTensor``'s) on their device: the
    exact float64 values (module docstring, step 1). Zero points and channel scales are not handled
    (:func:`device_report_unavailable`)."""
    torch = _torch()
    dev = codes.device
    shape = tuple(int(d) for d in shape)
    c = codes.to(torch.int64)
    if scheme.packed:  # even element in the low nibble
        c = torch.stack([c & 0xF, c >> 4], dim=-1).reshape(*c.shape[:-1], 2 * c.shape[-1])[..., : shape[-1]]
    v = _table(scheme.element, dev)[c]
    s = _device_scales(scales, scheme, global_scale, dev)
    block = tuple(int(b) for b in scheme.resolve_block(shape))
    k = len(block)
    nl = len(shape) - k
    for i, b in enumerate(block):  # the block scale of every element (cropped at the end of an axis)
        s = torch.repeat_interleave(s, b, dim=nl + i).narrow(nl + i, 0, shape[nl + i])
    return v * s


_MAGNITUDES: dict = {}


def _magnitude_table(name: str, device):
    """``|decode(k)|`` for the low 7 bits ``k`` of the 8-bit element format ``name`` (float64, NaN for NaN
    codes) where the format is sign-magnitude in the sense :func:`device_codes_amax` needs: the code ``k | 0x80``
    has the magnitude of ``k``, the magnitudes do not decrease with ``k`` and the NaN codes are the largest
    ``k``; else None. Read off the decode table (:func:`moeref.formats.decode_table`), not assumed."""
    key = (name, str(device))
    if key not in _MAGNITUDES:
        t = np.abs(np.array(decode_table(name), np.float64))
        ok = t.size == 256
        if ok:
            lo, hi = t[:128], t[128:]
            nan = np.isnan(lo)
            first_nan = int(np.argmax(nan)) if nan.any() else 128
            ok = (np.array_equal(lo, hi, equal_nan=True) and bool(nan[first_nan:].all())
                  and bool(np.all(np.diff(lo[:first_nan]) >= 0)))
        _MAGNITUDES[key] = _torch().as_tensor(t[:128], device=device) if ok else None
    return _MAGNITUDES[key]


def device_codes_amax(codes, scales, scheme: Scheme, shape: tuple, global_scale: float | None = None,
                float32: bool = False):
    """``device_dequantize(codes, scales, ...).abs().max()`` (``float32``: of the values rounded to float32)
    as a 0-d tensor on the codes' device, without decoding the tensor: from each block's largest and smallest
    code magnitude (one byte per element read) and the block's scale. None where this does not apply (then
    decode): packed 4-bit codes, an element format that is not sign-magnitude (:func:`_magnitude_table`), a
    shape that is not a whole number of blocks, an empty tensor.

    Exact, the same float as the decoded maximum, NaN included: an element's value is ``decode(code) *
    scale`` (float64, :func:`device_dequantize`), whose magnitude ``|decode(code)| * |scale|`` (rounding is
    symmetric in sign) does not decrease with ``|decode(code)|`` for a fixed scale (rounding, to float64 and
    then to float32, is monotone), so a block's largest magnitude is its largest code magnitude times
    ``|scale|``; an element is NaN where its code is (the NaN codes have the largest ``k``: a block holding
    one has a NaN maximum), where its scale is, and for a zero code times an infinite scale (a block whose
    smallest magnitude is 0 with an infinite scale gives NaN) or an infinite code times a zero scale (the
    largest magnitude, inf, times 0: NaN). ``torch.max`` propagates NaN, as the decoded maximum does."""
    torch = _torch()
    dev = codes.device
    shape = tuple(int(d) for d in shape)
    if scheme.packed or codes.dtype != torch.uint8 or tuple(codes.shape) != shape or codes.numel() == 0:
        return None
    mags = _magnitude_table(scheme.element, dev)
    block = tuple(int(b) for b in scheme.resolve_block(shape))
    nl = len(shape) - len(block)
    if mags is None or any(shape[nl + i] % b for i, b in enumerate(block)):
        return None
    view = shape[:nl] + tuple(d for i, b in enumerate(block) for d in (shape[nl + i] // b, b))
    inner = tuple(nl + 2 * i + 1 for i in range(len(block)))
    k = torch.bitwise_and(codes, 0x7F).reshape(view)
    kmax, kmin = k.amax(dim=inner), k.amin(dim=inner)
    s = _device_scales(scales, scheme, global_scale, dev)
    s = s.reshape(kmax.shape)
    top = mags[kmax.to(torch.int64)] * s.abs()
    zero_by_inf = (mags[kmin.to(torch.int64)] == 0) & torch.isinf(s)
    top = torch.where(zero_by_inf, torch.full((), float("nan"), dtype=torch.float64, device=dev), top)
    if float32:
        top = top.to(torch.float32)
    return top.max()


def device_report_unavailable(target: Scheme, source=None) -> str | None:
    """None when :func:`device_report` measures ``target`` (and :func:`device_requantize` reads ``source``, a
    :class:`~moeref.quant.QuantizedTensor`, where given), else why not: zero points and channel scales stay
    on the host."""
    for what, s in (("target", target), ("source", getattr(source, "scheme", None))):
        if s is not None and (s.zero_point or s.channel_block):
            return f"the {what} scheme {s.name!r} has zero points or channel scales (decoded on the host)"
    if source is not None and (source.zero_points is not None or source.channel_scales is not None):
        return "the source has zero points or channel scales (decoded on the host)"
    return None


_UPLOADS: dict = {}
UPLOADS_KEPT = 4
"""Uploads :func:`upload` keeps (the converter uploads a fused group's members for their shared global, then
for their reports: the same host tensors)."""


def _device_key(device) -> str:
    """``device`` as one string for each device (``"cuda"`` is the current CUDA device, ``"cuda:0"`` there)."""
    torch = _torch()
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


def clear_uploads() -> None:
    """Drop the uploads :func:`upload` keeps (the converter does at the end of a shard)."""
    _UPLOADS.clear()


def remember_upload(q: QuantizedTensor, codes, scales) -> bool:
    """Record that the device tensors ``codes`` and ``scales`` hold ``q``'s codes and scales (a device
    quantizer's result, whose host copy ``q`` is), so that :func:`upload` gives them back instead of copying
    ``q`` to the device again. Only tensors laid out as ``q``'s arrays are taken (uint8 codes of
    ``q.codes``' shape, scales of ``q.scales``' shape and dtype); returns whether they were."""
    torch = _torch()
    ok = (torch.is_tensor(codes) and torch.is_tensor(scales) and codes.dtype == torch.uint8
          and tuple(codes.shape) == q.codes.shape and tuple(scales.shape) == q.scales.shape
          and str(scales.dtype).replace("torch.", "") == q.scales.dtype.name and codes.device == scales.device)
    if ok:
        key = (id(q), _device_key(codes.device))
        _UPLOADS.pop(key, None)
        _UPLOADS[key] = (q, codes, scales)
        while len(_UPLOADS) > UPLOADS_KEPT:
            _UPLOADS.pop(next(iter(_UPLOADS)))
    return ok


def upload(q: QuantizedTensor, device):
    """``(codes, scales)`` of the host tensor ``q`` on ``device``; the last :data:`UPLOADS_KEPT` uploads are
    kept and given back for the same ``q`` (a QuantizedTensor's arrays are read-only)."""
    from .._interop import to_device

    key = (id(q), _device_key(device))
    hit = _UPLOADS.pop(key, None)
    if hit is not None and hit[0] is q:
        _UPLOADS[key] = hit  # most recent last
        return hit[1], hit[2]
    if _torch().device(device).type == "cpu":  # torch refuses to share a read-only array
        codes, scales = to_device(np.array(q.codes), device), to_device(np.array(q.scales), device)
    else:
        codes, scales = to_device(q.codes, device), to_device(q.scales, device)
    _UPLOADS[key] = (q, codes, scales)
    while len(_UPLOADS) > UPLOADS_KEPT:
        _UPLOADS.pop(next(iter(_UPLOADS)))
    return codes, scales


def device_report(target: QuantizedTensor, x, method: str, precision: str = "exact",
                  codes=None, scales=None) -> RequantReport:
    """The report of :func:`moeref.quant.requantize` for the quantized ``target`` against the exact source
    values ``x`` (a float64 torch tensor of the logical shape), computed on ``x``'s device; ``codes`` and
    ``scales``: ``target``'s, already on that device (else copied there). The figures equal the host
    report's bit for bit; ``error`` is the per-element error as a float64 tensor on the device."""
    torch = _torch()
    if codes is None:
        codes, scales = upload(target, x.device)
    y = device_dequantize(codes, scales, target.scheme, target.shape, target.global_scale)
    err = torch.sub(y, x, out=y)
    del y
    # the sums and, for a finite error, the extremes and their first indices: one copy to the host
    sums = [_sum_of_squares(x), _sum_of_squares(err)]
    if err.numel():
        flat_err = err.reshape(-1)
        sums += [(err != 0).any(), err.max(), err.min(), flat_err.argmax(), flat_err.argmin()]
    got = torch.stack([v.to(torch.float64) for v in sums]).tolist()  # exact: indices < 2**53
    x2, e2 = got[0], got[1]
    allfin = np.isfinite(x2) and np.isfinite(e2)
    if allfin:
        lossless = len(got) == 2 or not got[2]  # NaN counts as an error (a NaN makes the sums non-finite)
        hi = lo = 0.0
        flat = 0
        if not lossless:
            hi, lo = got[3], got[4]
            flat = int(got[5]) if hi >= -lo else int(got[6])
        return report_from_sums(ReportSums(lossless, hi, lo, flat, float(e2), float(x2)), err,
                                tuple(target.shape), tuple(target.block_shape), method, precision)
    # a NaN or Inf somewhere: the host's handling, operation for operation
    yy = err + x
    both_nan = torch.isnan(x) & torch.isnan(yy)
    err = torch.where(both_nan | (torch.isinf(x) & (x == yy)), torch.zeros((), dtype=err.dtype,
                                                                           device=err.device), err)
    fin = torch.isfinite(err)
    e2, x2 = device_sum_of_squares(err[fin]), device_sum_of_squares(x[fin])
    lossless = not bool((err != 0).any())  # NaN counts as an error
    hi = lo = 0.0
    flat = 0
    if not lossless:
        ef = torch.where(torch.isfinite(err), err, torch.zeros((), dtype=err.dtype, device=err.device))
        hi, lo = float(ef.max()), float(ef.min())
        flat = int(ef.reshape(-1).argmax()) if hi >= -lo else int(ef.reshape(-1).argmin())
    return report_from_sums(ReportSums(lossless, hi, lo, flat, float(e2), float(x2)), err,
                            tuple(target.shape), tuple(target.block_shape), method, precision)


def _as_float_tensor(values, device):
    from .._interop import to_device, to_torch
    from .blockwise import as_input

    xa = as_input(values)
    return to_device(to_torch(xa), device), xa.dtype


def device_requantize(q, target: Scheme, *, device, values=None, precision: str = "exact",
                      prefer_exact: bool = True, quantizer=None, global_scale=None):
    """:func:`moeref.quant.requantize` ``(q, target, ...)`` with the report computed on ``device`` (module
    docstring); with ``q=None``, :func:`moeref.quant.quantize_and_report` of the float ``values``.

    ``quantizer(values, target, **static)`` as in :func:`~moeref.quant.requantize` (None: the NumPy
    quantizer). It is handed the values as a torch tensor on ``device`` when it has a true attribute
    ``device_values`` (the fast engines' quantizers do), else as the host array the host path gives it.

    Returns ``(QuantizedTensor, RequantReport)``, the same as the host call, or None where the rule is lossy
    and the lossless candidates may apply (the caller then runs the host :func:`~moeref.quant.requantize`)."""
    torch = _torch()
    from .._checks import check_choice
    from .tensor import PRECISIONS

    check_choice(precision, PRECISIONS, "requantize precision")
    why = device_report_unavailable(target, q)
    if why is not None:
        raise ValueError(f"device_requantize cannot measure this on the device: {why}")
    if q is not None:
        if not isinstance(q, QuantizedTensor):
            raise TypeError(f"q must be a QuantizedTensor; got {type(q).__name__}")
        codes, scales = upload(q, device)
        x = device_dequantize(codes, scales, q.scheme, q.shape, q.global_scale)
        x32 = x.to(torch.float32)
        if precision == "float32" or bool(((x32.to(torch.float64) == x) | (torch.isnan(x) & torch.isnan(x32))).all()):
            src = x32
        else:
            src = x
    else:  # quantize_and_report: the rule on the values as given, the report "exact"
        precision = "exact"
        xt, dt = _as_float_tensor(values, device)
        src = xt if dt in (np.float32, np.float64) else xt.to(torch.float32)
        x = xt.to(torch.float64)
    static = {} if global_scale is None else {"global_scale": global_scale}
    if global_scale is not None and target.family != "nvfp4":
        raise ValueError(f"global_scale is for NVFP4 targets; got scheme {target.name!r}")
    if quantizer is not None and getattr(quantizer, "device_values", False):
        first = quantizer(src, target, **static)
    else:
        from .._interop import to_numpy

        first = (quantizer or quantize)(to_numpy(src), target, **static)
    rep = device_report(first, x, "rule", precision)
    if rep.lossless or not prefer_exact:
        return first, rep
    if not _searchable(None, target) or x.numel() == 0:
        return first, rep
    samples = sample_blocks(tuple(x.shape), target)
    parts = [x[idx] for idx, _ in samples]
    host = torch.cat([p.reshape(-1) for p in parts]).cpu().numpy()  # the blocks in one copy
    at = 0
    for (_, block), p in zip(samples, parts):
        xs = host[at:at + p.numel()].reshape(tuple(p.shape))
        at += p.numel()
        if not sample_block_representable(xs, block, target):
            return first, rep  # no lossless encoding exists: neither candidate can be
    return None
