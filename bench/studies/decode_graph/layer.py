"""The decode sweep's FP8 layer, its tiles and its recorded stages (``bench/studies/decode_graph_sweep.py``)."""
from __future__ import annotations

import contextlib
import os

import torch

from fastpath.grouped_gemm import GemmTiles

from .timing import Run


def sweep_tiles(smoke: bool) -> list[GemmTiles]:
    if smoke:  # interpreter: small tiles, warps/stages are launch options it ignores
        return [GemmTiles(16, 32, 128, 4, 3, swap_ab=True), GemmTiles(16, 64, 128, 4, 4, swap_ab=True)]
    return [GemmTiles(16, bn, 128, w, s, swap_ab=True) for bn in (64, 128, 256) for w in (4, 8) for s in (3, 4, 5, 6)]


def short(t: GemmTiles | None) -> str:
    """``n128 w4 s3`` (BLOCK_N, warps, stages of a 16-row swapped tile), else the dataclass's repr."""
    if t is None:
        return "default"
    if t.block_m == 16 and t.block_k == 128 and t.swap_ab:
        return f"n{t.block_n} w{t.num_warps} s{t.num_stages}"
    return str(t)



def build(run: Run, shape: dict, tokens: list[int]):
    """(FastMoEWeights, {tokens: (x, topk_weights, topk_ids)}) of the FP8 layer."""
    from fastpath.moe import FastMoEWeights

    gen = torch.Generator(device=run.dev).manual_seed(0)
    h, n, e, k = shape["hidden"], shape["inter"], shape["experts"], shape["top_k"]

    def experts(rows, cols):
        codes = torch.randint(0, 256, (e, rows, cols), dtype=torch.uint8, device=run.dev, generator=gen)
        codes[(codes & 0x7F) == 0x7F] -= 1  # no NaN codes
        s = 1e-4 * (1.0 + torch.rand((e, -(-rows // 128), -(-cols // 128)), device=run.dev, generator=gen))
        return codes.view(torch.float8_e4m3fn), s.to(torch.float32)

    w13, s13 = experts(2 * n, h)
    w2, s2 = experts(h, n)
    fw = FastMoEWeights(w13, w2, "gate_up", s13, s2)
    cases = {}
    for m in tokens:
        x = torch.randn((m, h), device=run.dev, generator=gen).to(torch.bfloat16)
        ids = torch.rand((m, e), device=run.dev, generator=gen).topk(k, dim=1).indices.to(torch.int32)
        tw = torch.rand((m, k), device=run.dev, generator=gen)
        cases[m] = (x, (tw / tw.sum(dim=1, keepdim=True)).float(), ids)
    return fw, cases


def layer_fn(fw, case, tiles=None):
    from fastpath.moe import fused_moe

    x, tw, ids = case
    return lambda: fused_moe(x, fw, tw, ids, impl="triton", layout="masked", capturable=True, graph_cache=False,
                             tiles=tiles)


def weight_bytes(fw, ids) -> dict:
    touched = int(torch.unique(ids[ids >= 0]).numel())
    b1 = touched * int(fw.w13.shape[1]) * int(fw.w13.shape[2])
    b2 = touched * int(fw.w2.shape[1]) * int(fw.w2.shape[2])
    return dict(touched=touched, gemm1=b1, gemm2=b2, layer=b1 + b2)


def record_stages(fw, case) -> dict:
    """The calls after the dispatch of one eager layer call, recorded as ``(args, kwargs, output)`` with the
    layer's own operands: ``gemm1``, ``gemm2`` (``fastpath.grouped_gemm.grouped_gemm_masked``), ``act`` (the
    fused SiLU + a2 quantization, ``fastpath.fused.silu_and_mul_quant_fp8``), ``reduce``
    (``fastpath.dispatch._reduce``). Each is called again as :func:`stage_fn` gives it."""
    import fastpath.dispatch as dp
    import fastpath.fused as fu
    import fastpath.grouped_gemm as gg

    rec: dict = {"gemms": []}
    origs = {(gg, "grouped_gemm_masked"): "gemms", (fu, "silu_and_mul_quant_fp8"): "act", (dp, "_reduce"): "reduce"}
    saved = {k: getattr(*k) for k in origs}

    def recorder(key):
        orig = saved[key]

        def call(*a, **kw):
            out = orig(*a, **kw)
            if origs[key] == "gemms":
                rec["gemms"].append((a, kw, out))
            else:
                rec[origs[key]] = (a, kw, out)
            return out
        return call

    for (mod, name) in origs:
        setattr(mod, name, recorder((mod, name)))
    try:
        layer_fn(fw, case)()
    finally:
        for (mod, name), f in saved.items():
            setattr(mod, name, f)
    if len(rec["gemms"]) != 2 or "act" not in rec or "reduce" not in rec:
        raise RuntimeError(f"expected 2 masked GEMMs, the fused activation and the reduce; recorded "
                           f"{len(rec['gemms'])} GEMMs and {sorted(k for k in rec if k != 'gemms')}")
    return dict(gemm1=rec["gemms"][0], gemm2=rec["gemms"][1], act=rec["act"], reduce=rec["reduce"])


def stage_fn(name: str, call, tiles=None):
    """A zero-argument call of a recorded stage (:func:`record_stages`), the GEMMs with ``tiles`` if given."""
    import fastpath.dispatch as dp
    import fastpath.fused as fu
    import fastpath.grouped_gemm as gg

    a, kw, _ = call
    if name in ("gemm1", "gemm2"):
        return lambda: gg.grouped_gemm_masked(*a, **(kw if tiles is None else dict(kw, tiles=tiles)))
    f = {"act": fu.silu_and_mul_quant_fp8, "reduce": dp._reduce}[name]
    return lambda: f(*a, **kw)


def record_gemms(fw, case):
    """The layer's two ``grouped_gemm_masked`` calls (args, kwargs, output) from one eager call."""
    st = record_stages(fw, case)
    return [st["gemm1"], st["gemm2"]]


def gemm_fn(call, tiles):
    import fastpath.grouped_gemm as gg

    a, kw, _ = call
    return lambda: gg.grouped_gemm_masked(*a, **dict(kw, tiles=tiles))


def routed_rows(call):
    a, kw, out = call
    masked_m = a[2]
    cap = int(out.shape[1])
    return torch.arange(cap, device=masked_m.device)[None, :] < masked_m.to(torch.int64)[:, None]


@contextlib.contextmanager
def compile_in_parallel(run: Run):
    """Launches of the grouped GEMM inside become ``warmup`` compiles on a thread pool (Triton's AsyncCompileMode;
    nothing runs); the kernels are in Triton's cache after the block."""
    if run.smoke or run.args.serial_compile:
        yield False
        return
    from concurrent.futures import ThreadPoolExecutor

    import fastpath.grouped_gemm as gg
    from triton.runtime import _async_compile

    orig = gg.launch

    def warm(kernel, grid, *a, **kw):
        kernel.warmup(*a, grid=grid, **kw)

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as ex:
        mode = _async_compile.AsyncCompileMode(ex, ignore_errors=True)
        gg.launch = warm
        try:
            with mode:
                yield True
        finally:
            gg.launch = orig

