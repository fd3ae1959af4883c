"""``moeref explain SCHEME``: walk a small example through a scaling scheme, step by step.

For each preset asked for, the example is quantized with :func:`moeref.quant.quantize` and every
intermediate is read back from the :class:`~moeref.quant.QuantizedTensor` (nothing is recomputed
here): the block amax, the global scale of two-level schemes (NVFP4), each block's stored scale
code and the decode multiplier it stands for, then each element's scaled value ``x / scale``, its
code, its decoded value and the error. Notes flag the interesting cases: an exact tie of the
element rounding, a saturated element, a negative zero, and codes that differ between presets.

The default example (``seed=0``) is hand-picked: 32 values in two rows of 16 for 2-D blocks, or one
row of 32, holding ties of E2M1 rounding (2.5, -5, 0.25, 1.75, 3.5, 0.75, 1.25), a tiny negative
value, and a second block whose amax 1.125 puts the NVFP4 scale exactly on a UE4M3 tie (84 lies
half-way between 80 and 88), which TransformerEngine's and FlashInfer's operation orders round
differently (radixark/miles PR #1054). Any other seed draws random data with a few outliers.

Plain data (:func:`explain_steps`) is separate from the ``rich`` rendering (:func:`explain`) so
that both can be tested; :func:`explain_text` renders to a string.

>>> steps = explain_steps("nvfp4", presets=["nvfp4_te", "nvfp4_flashinfer"])
>>> [r["blocks"][1]["scale code"] for r in steps["runs"]]
['0x6b', '0x6a']
>>> [r["blocks"][1]["scale"] for r in steps["runs"]]
['88', '80']
"""
from __future__ import annotations

import inspect

import numpy as np

from .formats import decode_table, representable_values

__all__ = ["example_input", "explain_steps", "explain", "explain_text"]

MAX_ELEMENTS = 64  # the walk lists every element; keep examples small

_CURATED = np.array(
    [6.0, 2.5, -5.0, 0.25, 1.75, 3.5, 0.75, 1.25, -0.1, 4.4, 3.0, -1.0, 0.5, 2.0, 5.5, -2.9,
     1.125, -0.9, 0.3, 0.6, -0.45, 0.15, 0.05, -1.0, 0.8, 0.7, -0.2, 0.33, 0.0, 0.99, -0.55, 0.4],
    np.float32)


def _schemes():
    from .quant import SCHEMES

    return SCHEMES


_FP8_COMMON = ("default", "deepgemm", "deepgemm_cuda", "vllm", "te_fp8")
_MX_COMMON = ("default", "ocp", "torchao_floor", "torchao_ceil", "torchao_even", "torchao_rceil",
              "microxcaling")

#: The presets that fit each scheme: the anchors that implement that scheme (the tables in
#: docs/fp8-scaling.md, docs/mx-formats.md, docs/int4-groups.md, docs/nvfp4.md). Any other preset
#: would run its knobs on a storage it was not written for (``gptq``'s ``element_max=7.5`` on an
#: FP8 walk, ``nvfp4_te`` over an INT4 walk), so :func:`explain_steps` refuses it. NVFP4 schemes
#: take ``default`` and the ``nvfp4_*`` presets (:data:`moeref.quant.NVFP4_PRESETS`).
SCHEME_PRESETS: dict[str, tuple[str, ...]] = {
    "fp8_per_tensor": _FP8_COMMON,
    "fp8_per_token": _FP8_COMMON,
    "fp8_per_channel": _FP8_COMMON,
    "fp8_group": _FP8_COMMON + ("te_fp8_block",),
    "fp8_block": _FP8_COMMON + ("te_fp8_block",),
    "mxfp8": _MX_COMMON + ("te_mxfp8", "deepgemm", "deepgemm_cuda"),
    "mxfp6": _MX_COMMON,
    "mxfp4": _MX_COMMON + ("deepgemm", "deepgemm_cuda"),
    "int8_per_token": ("default", "vllm_int8"),
    "int8_per_channel": ("default", "vllm_int8"),
    "int4_group": ("default", "gptq", "vllm_int4"),
    "w4a8_cutlass": (),
}


def scheme_presets(name: str) -> tuple[str, ...]:
    """The preset names :func:`explain_steps` accepts for scheme ``name`` (first: the default).

    >>> scheme_presets("int4_group")
    ('default', 'gptq', 'vllm_int4')
    >>> scheme_presets("nvfp4")[:4]
    ('default', 'nvfp4_te', 'nvfp4_te_encode_scale', 'nvfp4_flashinfer')
    """
    schemes = _schemes()
    if not isinstance(name, str) or name not in schemes:
        raise ValueError(f"unknown scheme {name!r}; accepted: {', '.join(schemes)}")
    if name in SCHEME_PRESETS:
        return SCHEME_PRESETS[name]
    if name.startswith("nvfp4"):
        from .quant import NVFP4_PRESETS

        return NVFP4_PRESETS
    return ()  # a scheme registered later without a table entry: its own default only


def _make_scheme(name: str, preset, scale: str | None = None):
    fits = scheme_presets(name)
    factory = _schemes()[name]
    params = inspect.signature(factory).parameters
    kwargs = {}
    if scale is not None:
        if "scale" not in params:
            raise ValueError(f"scheme {name!r} has a fixed scale format; drop --scale")
        kwargs["scale"] = scale
    if preset is None:
        return factory(**kwargs)
    if "preset" not in params or not fits:
        raise ValueError(f"scheme {name!r} has no presets to choose from; drop --preset")
    from .quant import NVFP4_ORDERS, PRESETS

    if isinstance(preset, str) and preset not in fits and not (
            preset in NVFP4_ORDERS and name.startswith("nvfp4")):  # deprecated NVFP4 aliases
        known = preset in PRESETS or preset in NVFP4_ORDERS
        raise ValueError(f"{'preset' if known else 'unknown preset'} {preset!r} "
                         f"{'does not fit' if known else 'for'} scheme {name!r}; presets that "
                         f"fit: {', '.join(fits)}")
    return factory(preset=preset, **kwargs)


def _two_d(scheme) -> bool:
    return len(scheme.block) >= 2 and scheme.block[-2] not in (None, 1)


def example_input(scheme_name: str, seed: int = 0) -> np.ndarray:
    """The example walked by :func:`explain`: float32, ``(1, 32)`` or ``(2, 16)`` (2-D blocks).

    ``seed=0``: the hand-picked values (module docstring); otherwise standard normal values with
    two outliers (x8), rounded to 3 significant digits so the table reads easily. Schemes that
    only take whole groups (W4A8, K a multiple of 128) get the 32 values tiled to one group.

    >>> example_input("nvfp4").shape, example_input("nvfp4_weight").shape
    ((1, 32), (2, 16))
    """
    scheme = _make_scheme(scheme_name, None)
    if seed == 0:
        x = _CURATED.copy()
    else:
        rng = np.random.default_rng(seed)
        x = rng.standard_normal(32)
        x[rng.choice(32, 2, replace=False)] *= 8.0
        x = np.array([float(f"{v:.3g}") for v in x], np.float32)
    return _fit_example(x.reshape((2, 16) if _two_d(scheme) else (1, 32)), [scheme])


def _num(v: float) -> str:
    v = float(v)
    if np.isnan(v):
        return "NaN"
    if np.isinf(v):
        return "-Inf" if v < 0 else "Inf"
    if v == 0:
        return "-0" if np.signbit(v) else "0"
    return f"{v:.6g}"


def _block_amax(x: np.ndarray, block) -> np.ndarray:
    from .quant.blockwise import block_amax, block_view

    return block_amax(block_view(x.astype(np.float64), block), len(block))


def _global_rows(q) -> list[tuple[str, str]] | None:
    if q.global_scale is None:
        return None
    rows = [("global decode factor g", _num(q.global_scale))]
    if q.scheme.family == "nvfp4":
        from .quant.nvfp4 import global_scale_as

        conv = q.scheme.preset.option("global_convention")
        rows.insert(0, ("stored global scale", f"{_num(global_scale_as(q, conv))} ({conv})"))
        rows.append(("encode scale 1/g = 2688/amax", _num(global_scale_as(q, "encode_scale"))))
    return rows


def explain_steps(scheme_name: str, presets=None, x=None, seed: int = 0,
                  scale: str | None = None) -> dict:
    """The walk as plain data.

    Args:
        scheme_name: a key of :data:`moeref.quant.SCHEMES` (``"nvfp4"``, ``"mxfp4"``, ...).
        presets: None (the scheme's default preset) or a list of preset names
            (:func:`scheme_presets`).
        x: example data (at most 64 elements; 1-D input is one row); None = :func:`example_input`.
        seed: example seed (0 = the hand-picked example).
        scale: the scale format for schemes that take one (``"fp32"`` or ``"ue8m0"`` for the FP8
            schemes); None = the scheme's default.

    Raises:
        ValueError: an unknown scheme or preset, a preset that does not fit the scheme (the
            message names those that do, :func:`scheme_presets`), ``scale`` on a scheme with a
            fixed scale format.

    Returns:
        ``{"scheme": str, "shape": tuple, "runs": [run, ...]}``; each run has ``"preset"``,
        ``"description"``, ``"scheme description"``, ``"global"`` (rows or None; when present,
        the element step divides by the decode multiplier ``scale * g``), ``"blocks"`` (one dict per block: index,
        amax, scale code, scale, decode multiplier) and ``"elements"`` (one dict per element:
        index, block, x, x / scale, code, value, dequantized, error, note).
    """
    from .quant import quantize
    from .quant.blockwise import expand_to_elements

    preset_list = [None] if not presets else list(presets)
    schemes = [_make_scheme(scheme_name, p, scale) for p in preset_list]
    if x is None:
        xa = example_input(scheme_name, seed)
    else:
        from ._checks import as_float_array

        xa = np.asarray(as_float_array(x, "x"))
        if xa.ndim == 1:
            xa = xa[None, :]
        if xa.size > MAX_ELEMENTS or xa.size == 0:
            raise ValueError(f"x must hold 1..{MAX_ELEMENTS} elements to be walked; got shape {xa.shape}")
    runs = []
    for scheme in schemes:
        q = quantize(xa, scheme)
        block = q.block_shape
        el = scheme.element_format
        amax = _block_amax(xa, block)
        sv = q.scale_values()
        grid_codes = q.scales
        blocks = []
        for idx in np.ndindex(*amax.shape):
            code = grid_codes[idx]
            blocks.append({
                "block": str(idx),
                "amax": _num(amax[idx]),
                "scale code": f"0x{int(code):02x}" if code.dtype == np.uint8 else "fp32",
                "scale": _num(_scale_value(q, idx)),
                "decode multiplier": _num(sv[idx]),
            })
        d = expand_to_elements(sv, block, q.shape)
        codes = q.element_codes()
        vals = q.element_values()
        deq = q.dequantize(np.float64)
        x64 = xa.astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            scaled = np.where(d == 0, 0.0, x64 / d)
        mids = _midpoints(el)
        elements = []
        for idx in np.ndindex(*xa.shape):
            bidx = tuple(i // b for i, b in zip(idx[len(idx) - len(block):], block))
            bidx = idx[: len(idx) - len(block)] + bidx
            note = []
            s = abs(float(np.float32(scaled[idx])))  # the anchors scale in float32
            if q.zero_points is None:  # with a zero point, x / scale is not the element value
                if s in mids:
                    note.append("tie")
                if s > el.max_finite:
                    note.append("saturated")
            if el.has_negative_zero and codes[idx] == el.sign_mask:
                note.append("-0")
            elements.append({
                "index": str(idx), "block": str(bidx), "x": _num(x64[idx]),
                "x / scale": _num(scaled[idx]), "code": f"0x{int(codes[idx]):x}",
                "value": _num(vals[idx]), "dequantized": _num(deq[idx]),
                "error": _num(deq[idx] - x64[idx]), "note": " ".join(note),
                "_code": int(codes[idx]),
            })
        runs.append({
            "preset": scheme.preset.name,
            "description": scheme.preset.description,
            "scheme description": scheme.description or scheme.name,
            "global": _global_rows(q),
            "blocks": blocks,
            "elements": elements,
        })
    if len(runs) > 1:
        for i in range(len(runs[0]["elements"])):
            cs = {r["elements"][i]["_code"] for r in runs}
            if len(cs) > 1:
                for r in runs:
                    e = r["elements"][i]
                    e["note"] = (e["note"] + " differs").strip()
    return {"scheme": scheme_name, "shape": tuple(xa.shape), "runs": runs}


def _fit_example(xa: np.ndarray, schemes) -> np.ndarray:
    """The example itself, or (for schemes that only take whole groups, W4A8) the example tiled
    along the last axis to one group, each copy scaled by a different power of two."""
    from .quant import quantize

    try:
        for s in schemes:
            quantize(xa, s)
        return xa
    except ValueError:
        width = max((s.block[-1] for s in schemes if isinstance(s.block[-1], int)), default=0)
        if width <= xa.shape[-1]:
            raise
        reps = -(-width // xa.shape[-1])
        tiles = [xa * np.float32(2.0 ** (-i)) for i in range(reps)]
        return np.concatenate(tiles, axis=-1)[..., :width]


def _scale_value(q, idx) -> float:
    fmt = q.scheme.scale_format
    if fmt == "fp32":
        return float(q.scales[idx])
    return float(decode_table("e8m0" if fmt == "ue8m0" else "ue4m3")[int(q.scales[idx])])


def _midpoints(el) -> set:
    v = representable_values(el)
    v = v[v >= 0]
    return set(((v[:-1] + v[1:]) / 2).tolist())


# ---- rich rendering (the cli extra) ------------------------------------------------------------

def explain(scheme_name: str, presets=None, x=None, seed: int = 0, scale: str | None = None):
    """``rich`` renderable of :func:`explain_steps` (``moeref explain SCHEME [--preset A ...]``).

    With several presets the block and element tables put the presets side by side. Where that
    is wider than the console (an 80-column terminal), the same numbers come in layouts made for
    the width (:class:`moeref._console.Fit`): the blocks one row per block and preset, the
    elements one table per preset, with short headers explained under the tables.
    """
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from ._console import Fit, compact_table

    steps = explain_steps(scheme_name, presets=presets, x=x, seed=seed, scale=scale)
    runs = steps["runs"]
    parts = [Text(f"{steps['scheme']}: {runs[0]['scheme description']}  (input shape "
                  f"{steps['shape']})", style="bold")]
    multi = len(runs) > 1
    tags = {r["preset"]: (f" ({chr(65 + i)})" if multi else "") for i, r in enumerate(runs)}
    letters = {r["preset"]: chr(65 + i) for i, r in enumerate(runs)}
    for r in runs:
        parts.append(Text(f"preset{tags[r['preset']]} {r['preset']}: {r['description']}"))
    if runs[0]["global"] is not None:
        t = Table(title="Step 1. Global (per-tensor) scale", title_justify="left")
        t.add_column("quantity")
        for r in runs:
            t.add_column(r["preset"], justify="right")
        for i, (label, _) in enumerate(runs[0]["global"]):
            t.add_row(label, *[r["global"][i][1] for r in runs])
        parts.append(t)
    block_title = "Step 2. Block amax -> scale code -> decode multiplier"
    block_cols = ("scale code", "scale", "decode multiplier")
    t = Table(title=block_title, title_justify="left")
    t.add_column("block")
    t.add_column("amax", justify="right")
    for r in runs:
        tag = tags[r["preset"]]
        for c in block_cols:
            t.add_column(c + tag, justify="right")
    for i, b in enumerate(runs[0]["blocks"]):
        t.add_row(b["block"], b["amax"], *[r["blocks"][i][c] for r in runs for c in block_cols])
    if multi:  # narrow: one row per block and preset
        n = compact_table("block", ("amax", "right"), "preset",
                          *[(c, "right") for c in block_cols], title=block_title)
        for i, b in enumerate(runs[0]["blocks"]):
            for j, r in enumerate(runs):
                n.add_row(b["block"] if j == 0 else "", b["amax"] if j == 0 else "",
                          letters[r["preset"]], *[r["blocks"][i][c] for c in block_cols],
                          end_section=j == len(runs) - 1)
        t = Fit(t, n)
    parts.append(t)
    element_title = "Step 3. Elements: x / scale -> code -> value -> dequantized, error"
    t = Table(title=element_title, title_justify="left")
    for c in ("index", "block", "x"):
        t.add_column(c, justify="right" if c == "x" else "left")
    # side by side, the element value column is dropped (the code and the dequantized value carry it)
    per = ("x / scale", "code", "dequantized", "error", "note") if multi else (
        "x / scale", "code", "value", "dequantized", "error", "note")
    two_level = runs[0]["global"] is not None
    short = {"x / scale": "x/s", "dequantized": "deq", "error": "err"} if multi else {}
    if two_level:  # the element step divides by the decode multiplier scale * g, not by scale
        short["x / scale"] = "x/(s*g)" if multi else "x / (scale*g)"
    for r in runs:
        tag = tags[r["preset"]]
        for c in per:
            t.add_column(short.get(c, c) + tag, justify="left" if c == "note" else "right")
    for i, e in enumerate(runs[0]["elements"]):
        row = [e["index"], e["block"], e["x"]]
        for r in runs:
            ee = r["elements"][i]
            row += [ee[c] for c in per]
        style = "bold" if "differs" in e["note"] else None
        t.add_row(*row, style=style)
    # narrow: one table per preset, no block column (a blank line between blocks), short headers
    tiny = {"x / scale": "x/(s*g)" if two_level else "x/s", "dequantized": "deq", "error": "err"}
    narrow = []
    for r in runs:
        n = compact_table("index", ("x", "right"),
                          *[(tiny.get(c, c), "left" if c == "note" else "right") for c in per],
                          title=(f"Step 3{tags[r['preset']]} {r['preset']}. Elements "
                                 "(a blank line between blocks)"))
        els = r["elements"]
        for i, ee in enumerate(els):
            last = i + 1 == len(els) or els[i + 1]["block"] != ee["block"]
            n.add_row(ee["index"], ee["x"], *[ee[c] for c in per],
                      style="bold" if "differs" in ee["note"] else None, end_section=last)
        narrow.append(n)
    parts.append(Fit(t, Group(*narrow)))
    if two_level:
        parts.append(Text("x / (scale*g), x/(s*g): x divided by the decode multiplier, the block "
                          "scale times the global decode factor g (Step 1)."))
    parts.append(Text("short headers: x/s = x / scale, deq = dequantized, err = error. notes: tie = "
                      "exactly half-way between two element values (rounded to even); saturated = "
                      "beyond the element max, clamped; -0 = negative zero code; differs = the "
                      "presets disagree on this code."))
    return Group(*parts)


def explain_text(scheme_name: str, presets=None, x=None, seed: int = 0, width: int = 160,
                 scale: str | None = None) -> str:
    """:func:`explain` rendered to plain text (no colour) at ``width`` columns."""
    import io

    from rich.console import Console

    console = Console(file=io.StringIO(), width=width, color_system=None, record=True)
    console.print(explain(scheme_name, presets=presets, x=x, seed=seed, scale=scale))
    return console.export_text()
