"""DeepGEMM's two decode GEMMs alone (DeepSeek-V3 layer, 1 and 8 tokens) against the SM count it is told to
use (``deep_gemm.set_num_sms``: its heuristics enumerate block sizes and 2-CTA clusters for that count, and an odd
count rules the clusters out), contiguous (``m_indices``) and masked layouts, each a CUDA graph of 10 calls,
median of 9 replays, against the HBM roofline of the touched experts' weights.

    python bench/studies/deepgemm_decode_sms.py      # writes $OUT/dg_sms.json (or ./dg_sms.json)

What it showed (H100, 2026-11-25) is in docs/moe-gpu.md ("Not yet here").
"""
import json
import os
import statistics
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import deep_gemm
from bench.bench_moe_device import _copy_bandwidth, deepseek_v3_layer, routing
from bench.latency_cases import capture
from bench.studies.profile_moe_decode import _replay_ms
from fastpath import dispatch
from fastpath.grouped_gemm import grouped_gemm_contiguous, grouped_gemm_masked
from fastpath.moe import FastMoEWeights

gen = torch.Generator(device="cuda").manual_seed(0)
weights = deepseek_v3_layer(256, gen)
fw = FastMoEWeights(weights.w13.codes.view(torch.float8_e4m3fn), weights.w2.codes.view(torch.float8_e4m3fn),
                    "gate_up", weights.w13.scales.float(), weights.w2.scales.float())
del weights
bw = _copy_bandwidth()
out = []
for m in (1, 8):
    tw, ids = routing(m, 256, 8, gen)
    ids_t = torch.as_tensor(ids, device="cuda")
    lay = dispatch.to_contiguous(None, ids_t, 256, 128)
    mk = dispatch.to_masked(None, ids_t, 256, 128, expected_m=1, validate=False)
    ms = int(lay.m_indices.numel()); touched = len(np.unique(ids))
    for gname, (w, ws, k) in {"gemm1": (fw.w13, fw.w13_scales, 7168), "gemm2": (fw.w2, fw.w2_scales, 2048)}.items():
        a = torch.randn((ms, k), device="cuda", generator=gen).to(torch.float8_e4m3fn)
        sa = torch.rand((ms, k // 128), device="cuda", generator=gen) + 0.5
        am = torch.randn((256, 128, k), device="cuda", generator=gen).to(torch.float8_e4m3fn)
        sam = torch.rand((256, 128, k // 128), device="cuda", generator=gen) + 0.5
        roof = touched * int(w.shape[1]) * k / bw * 1e3
        for sms in (132, 131, 130, 128, 112):
            deep_gemm.set_num_sms(sms)
            fns = {"contiguous": lambda: grouped_gemm_contiguous(a, w, lay.m_indices, impl="deep_gemm", a_scales=sa, b_scales=ws),
                   "masked_em1": lambda: grouped_gemm_masked(am, w, mk.masked_m, impl="deep_gemm", a_scales=sam, b_scales=ws, expected_m=max(1, m * 8 // 256))}
            for name, fn in fns.items():
                try:
                    g, res = capture(fn, calls=10)
                    t = _replay_ms(g, 10, reps=9)
                    row = dict(tokens=m, gemm=gname, sms=sms, case=name, median_ms=statistics.median(t), min_ms=min(t), max_ms=max(t), roofline_ms=roof, of_roofline=roof / statistics.median(t))
                    del g
                except Exception as e:
                    row = dict(tokens=m, gemm=gname, sms=sms, case=name, error=f"{type(e).__name__}: {e}"[:300])
                out.append(row); print(row, flush=True)
        deep_gemm.set_num_sms(132)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "dg_sms.json"), "w"), indent=1)
