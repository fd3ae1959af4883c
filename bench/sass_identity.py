"""Fingerprints (SHA-256 of the SASS text) of every fast-path quantization kernel variant, so a
refactoring of fastpath.quant can be shown to leave the compiled code byte-identical.

Compiles for Hopper (sm_90) on the CPU with the ptxas bundled with Triton (no GPU, no driver):
the benchmark's kernels (:func:`bench.sass_report.cases`) and further presets, layouts, cast
paths and the dequantizer (:func:`extra_cases`).

    python bench/sass_identity.py --write before.json     # on the old tree
    python bench/sass_identity.py --compare before.json   # on the new one: exit 1 on a difference

The fingerprints depend on the Triton version (and its ptxas), so they are compared between two
trees on one installation, not stored in the repository.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sass_report as SR  # noqa: E402  (pops TRITON_INTERPRET before triton is imported)

import torch  # noqa: E402


def extra_cases(M=512, K=7168):
    """Variants the benchmark does not launch, through the public API only (the same calls on
    any tree): other presets and elements, the integer cast path, static scales, the scale
    layouts, FP4 odd shapes, and dequantization."""
    import fastpath.fused as F
    import fastpath.quant as Q
    from moeref.quant import fp8_group, fp8_per_tensor, fp8_per_token, mxfp4, mxfp8, nvfp4
    x = torch.empty(M, K, dtype=torch.bfloat16)
    xf = torch.empty(M, 1000, dtype=torch.float32)
    gu = torch.empty(M, 2 * K, dtype=torch.bfloat16)
    s_g = fp8_group(128)
    cases = {
        "g128_int_path": lambda: Q.quantize(x, s_g, hw_fp8=False),
        "g128_e5m2": lambda: Q.quantize(x, fp8_group(128, element="e5m2"), hw_fp8=True),
        "g128_te": lambda: Q.quantize(x, fp8_group(128, "fp32", "te_fp8"), hw_fp8=True),
        "g128_te_block": lambda: Q.quantize(x, fp8_group(128, "fp32", "te_fp8_block"), hw_fp8=True),
        "g128_deepgemm_cuda": lambda: Q.quantize(x, fp8_group(128, "fp32", "deepgemm_cuda"),
                                                 hw_fp8=True),
        "g128_vllm_ue8m0_mn": lambda: Q.quantize(x, fp8_group(128, "ue8m0", "vllm"),
                                                 scale_layout="mn_major", hw_fp8=True),
        "g128_dg_packed": lambda: Q.quantize(x, fp8_group(128, "ue8m0", "deepgemm"),
                                             scale_layout="packed_ue8m0", hw_fp8=True),
        "g128_mn_fp32": lambda: Q.quantize(x, fp8_group(128, "fp32", "deepgemm"),
                                           scale_layout="mn_major", hw_fp8=True),
        "per_token_short_vllm": lambda: Q.quantize(xf, fp8_per_token(preset="vllm"), hw_fp8=True),
        "per_tensor_static": lambda: Q.quantize(x, fp8_per_tensor(), scale=0.5, hw_fp8=True),
        "mxfp8_torchao_even": lambda: Q.quantize(x, mxfp8(preset="torchao_even"),
                                                 scale_layout="swizzled_128x4", hw_fp8=True),
        "mxfp8_te": lambda: Q.quantize(x, mxfp8(preset="te_mxfp8"), hw_fp8=True),
        "mxfp8_ocp_int": lambda: Q.quantize(x, mxfp8(preset="ocp"), hw_fp8=False),
        "mxfp4_deepgemm": lambda: Q.quantize(x, mxfp4(preset="deepgemm"), hw_fp8=True),
        "mxfp4_microx": lambda: Q.quantize(x, mxfp4(preset="microxcaling"), hw_fp8=True),
        "mxfp4_int_f32_odd": lambda: Q.quantize(xf[:, :999], mxfp4(), hw_fp8=False),
        "nvfp4_torchao": lambda: Q.quantize(x, nvfp4(preset="nvfp4_torchao"), hw_fp8=True),
        "nvfp4_flashinfer": lambda: Q.quantize(x, nvfp4(preset="nvfp4_flashinfer"), hw_fp8=True),
        "nvfp4_te_int": lambda: Q.quantize(x, nvfp4(), hw_fp8=False),
        "silu_ue8m0_mn": lambda: F.silu_and_mul_quant_fp8(gu, fp8_group(128, "ue8m0", "deepgemm"),
                                                          scale_layout="mn_major"),
        "silu_act_only": lambda: F.silu_and_mul(gu),
    }

    def dq(scheme, layout, shape, cdt, sshape, sdt, dtype, glob=False):
        codes = torch.empty(shape, dtype=cdt)
        scales = torch.empty(sshape, dtype=sdt)
        g = torch.empty(1, dtype=torch.float64) if glob else None
        return lambda: Q.dequantize(Q.FastQuantized(codes, scales, layout, scheme, (M, K),
                                                    global_scale=g), dtype)

    u8 = torch.uint8
    cases.update({
        "dequant_g128_bf16": dq(s_g, "row_major", (M, K), u8, (M, K // 128), torch.float32,
                                torch.bfloat16),
        "dequant_g128_f16": dq(s_g, "row_major", (M, K), u8, (M, K // 128), torch.float32,
                               torch.float16),
        "dequant_tensor_f32": dq(fp8_per_tensor(), "row_major", (M, K), u8, (1, 1), torch.float32,
                                 torch.float32),
        "dequant_mxfp4_swz": dq(mxfp4(), "swizzled_128x4", (M, K // 2), u8,
                                (M * (K // 32),), u8, torch.bfloat16),
        "dequant_nvfp4_swz": dq(nvfp4(), "swizzled_128x4", (M, K // 2), u8,
                                (M * (K // 16),), u8, torch.bfloat16, glob=True),
    })
    return cases


def fingerprints(maxnreg=None) -> dict:
    """{"case/kernel#i": sha256 of its SASS} for every recorded launch."""
    out = {}
    cases = dict(SR.cases())
    cases.update(extra_cases())
    for name, call in cases.items():
        for i, (fn, grid, args, kw) in enumerate(SR.record(call)):
            sass = SR.compile_sass(fn, args, kw, maxnreg)[0]
            out[f"{name}/{fn.__name__}#{i}"] = hashlib.sha256(sass.encode()).hexdigest()
            print(f"{name:28s} {fn.__name__:26s} {out[f'{name}/{fn.__name__}#{i}'][:16]}", flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", metavar="JSON")
    g.add_argument("--compare", metavar="JSON")
    a = ap.parse_args(argv)
    fp = fingerprints()
    if a.write:
        with open(a.write, "w") as f:
            json.dump(fp, f, indent=1, sort_keys=True)
        print(f"{len(fp)} kernels written to {a.write}")
        return 0
    with open(a.compare) as f:
        old = json.load(f)
    diff = sorted(k for k in set(old) | set(fp) if old.get(k) != fp.get(k))
    for k in diff:
        print(f"DIFFERENT {k}: {old.get(k, 'absent')[:16]} -> {fp.get(k, 'absent')[:16]}")
    print(f"{len(fp)} kernels, {len(diff)} different")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
