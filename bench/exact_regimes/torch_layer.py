"""The exact-regime proof's layer in torch eager (:class:`TorchLayer`: cuBLAS bf16 GEMMs with FP32 accumulation,
``torch._grouped_mm`` (CUTLASS), ``torch._scaled_mm`` rowwise FP8 (cuBLAS); bf16 stores; FP8 re-quantization in
float32 with torch's float8 cast), its honest variants (split-K GEMM1, the top-k sum reversed, chunks of 32
tokens, EP shards summed in rank order) and the faults planted in it (:data:`FAULTS`,
:data:`SINGLE_ROUNDING_FAULTS`)."""
from __future__ import annotations

import numpy as np

FAULTS = ("skipped_last_k_block", "halved_w2_scale_block", "swapped_topk_weights", "gate_up_swapped",
          "renormalized_weights", "neighbour_expert", "last_bit_noise", "tanh_gelu")
SINGLE_ROUNDING_FAULTS = ("rz_gemm1_store", "rz_intermediate", "rz_output_store", "second_gemm2_store")
"""Faults only ``--regime single_rounding`` sees: a store rounding toward zero (GEMM1's, the FP8 codes or bf16
activation store, the output's) and GEMM2's output stored in bf16 before the top-k sum."""


def stack_weights(ws, torch, dev):
    """bf16 [E, R, C] on ``dev`` from per-expert bf16 arrays or FP8 QuantizedTensors (exact: small integers times
    powers of two)."""
    if isinstance(ws[0], np.ndarray):
        return torch.stack([torch.from_numpy(np.ascontiguousarray(w).view(np.int16))
                            .view(torch.bfloat16) for w in ws]).to(dev)
    out = []
    cache = {}
    for w in ws:
        key = id(w)
        if key not in cache and w.scheme.element != "e4m3fn":  # MXFP4: E2M1 x 2^e, exact in bf16
            cache[key] = torch.from_numpy(w.dequantize(np.float32)).to(dev).to(torch.bfloat16)
        if key not in cache:
            r, c = w.shape
            codes = torch.from_numpy(np.array(w.codes, copy=True)).view(torch.float8_e4m3fn).to(dev).float()
            s = torch.from_numpy(np.asarray(w.scale_values(), np.float32).copy()).to(dev)
            br = 1 if s.shape[0] == r else 128
            bc = c if s.shape[1] == 1 else 128
            cache[key] = (codes * s.repeat_interleave(br, 0)[:r].repeat_interleave(bc, 1)[:, :c]).to(torch.bfloat16)
        out.append(cache[key])
    return torch.stack(out)


def _toward_zero(torch, x, fmt: str):
    """float32 ``x`` rounded toward zero to bf16 (the low 16 bits cut) or to E4M3 (3 fraction bits, exponents
    >= -6), as float32: a truncating store, the fault model."""
    x = x.float().contiguous()
    if fmt == "bfloat16":
        return (x.view(torch.int32) & -65536).view(torch.float32)
    _, ex = torch.frexp(x)
    step = torch.exp2((torch.clamp(ex - 1, min=-6) - 3).float())
    return torch.trunc(x / step) * step


def _fp8_groups(torch, x, group: int, ue8m0: bool, toward_zero: bool = False):
    """Dynamic FP8 per ``group`` columns in float32: (dequantized values, E4M3 codes, scales [M, C/group]);
    ``toward_zero``: the codes rounded toward zero (a fault)."""
    m, k = x.shape
    xg = x.reshape(m, k // group, group)
    s = xg.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448.0
    if ue8m0:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    codes = (_toward_zero(torch, xg / s, "e4m3") if toward_zero else xg / s).to(torch.float8_e4m3fn)
    return (codes.float() * s).reshape(m, k), codes.reshape(m, k), s.reshape(m, -1)


class TorchLayer:
    """The layer in torch on one device; ``run(gemm=..., fault=..., variant=..., ep=...)``. The weights are
    stacked once; :meth:`on` gives the same weights with another case's tokens and routing."""

    def __init__(self, lay, dev):
        import torch

        self.torch, self.dev = torch, dev
        cfg = lay.config
        self.fp8 = lay.scheme.startswith("fp8")
        self.ue8m0 = lay.scheme.endswith("ue8m0")
        self.w13 = stack_weights(list(lay.weights.w13), torch, dev)
        self.w2 = stack_weights(list(lay.weights.w2), torch, dev)
        self.shared = None
        if cfg.shared_experts is not None:
            self.shared = (stack_weights([cfg.shared_experts.w13], torch, dev),
                           stack_weights([cfg.shared_experts.w2], torch, dev))
        self._tokens(lay)

    def _tokens(self, lay):
        torch, dev = self.torch, self.dev
        self.lay = lay
        self.x = torch.from_numpy(lay.hidden).to(dev)
        self.ids = torch.from_numpy(lay.topk_ids.astype(np.int64)).to(dev)
        self.w = torch.from_numpy(lay.topk_weights.astype(np.float32)).to(dev)
        counts = np.bincount(lay.topk_ids[lay.topk_ids >= 0], minlength=len(lay.weights.w13))
        self.busiest = int(counts.argmax())
        self.gemm2_store = "gemm2" not in lay.excluded_stores  # single_rounding_layer: GEMM2 into the sum in FP32

    def on(self, lay) -> "TorchLayer":
        """This layer's stacked weights with ``lay``'s tokens and routing (``lay``: a :func:`token_case` of the
        layer this one was built from)."""
        import copy

        other = copy.copy(self)
        other._tokens(lay)
        return other

    def _gemm(self, a, w, rows_expert, kind, faulty_rows=None, k_cut=None, out_dtype=None):
        """``a [R, C]`` float32 (exact bf16 or FP8 values) times ``w[e] [N, C]`` per row's expert, bf16 output
        (``out_dtype=torch.float32``: FP32 output, ``bf16`` and ``split_k`` kinds only)."""
        torch = self.torch
        out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
        if out_dtype != torch.bfloat16 and kind not in ("bf16", "split_k"):
            raise ValueError(f"{kind} stores its output in bf16, and single_rounding_layer declares GEMM2's output "
                             "unstored (FP32 into the top-k sum)")
        out = torch.empty(a.shape[0], w.shape[1], dtype=out_dtype, device=a.device)
        experts = torch.unique(rows_expert).tolist()
        if kind == "grouped_mm":
            order = torch.argsort(rows_expert, stable=True)
            counts = torch.bincount(rows_expert, minlength=w.shape[0])
            offs = torch.cumsum(counts, 0).to(torch.int32)
            res = torch._grouped_mm(a[order].to(torch.bfloat16), w.transpose(-2, -1), offs=offs)
            out[order] = res.to(torch.bfloat16)
            return out
        for e in experts:
            sel = torch.nonzero(rows_expert == e).flatten()
            ae, we = a[sel], w[e]
            if k_cut is not None and e == faulty_rows:
                ae, we = ae[:, :k_cut], we[:, :k_cut]
            if kind == "bf16" and out_dtype == torch.float32:  # FP32 GEMM of bf16-exact values (TF32 off)
                out[sel] = ae.to(torch.bfloat16).float() @ we.float().T
            elif kind == "bf16":
                out[sel] = ae.to(torch.bfloat16) @ we.T
            elif kind == "split_k":
                half = ae.shape[1] // 2
                p1 = ae[:, :half].to(torch.bfloat16).float() @ we[:, :half].float().T
                p2 = ae[:, half:].to(torch.bfloat16).float() @ we[:, half:].float().T
                out[sel] = (p2 + p1).to(out_dtype)
            elif kind.startswith("scaled_mm"):
                # rowwise FP8: per-row scale 2^ceil(log2(amax / 448)) (exact: every row's amax is 448 * 2^j)
                amax = ae.abs().amax(1, keepdim=True).clamp(min=1e-30)
                sa = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
                a8 = (ae / sa).to(torch.float8_e4m3fn)
                w8 = we.float().to(torch.float8_e4m3fn)
                m = a8.shape[0]
                pad = (-m) % 16
                if pad:
                    a8 = torch.cat([a8, torch.zeros(pad, a8.shape[1], dtype=a8.dtype, device=a8.device)])
                    sa = torch.cat([sa, torch.ones(pad, 1, device=sa.device)])
                r = torch._scaled_mm(a8, w8.T, scale_a=sa.float(), scale_b=torch.ones(1, w8.shape[0], device=a8.device),
                                     out_dtype=torch.bfloat16, use_fast_accum=kind.endswith("fast"))
                out[sel] = r[:m]
            else:
                raise ValueError(kind)
        return out

    def run(self, gemm: str = "bf16", fault: str | None = None, variant: str | None = None, ep=None):
        """The layer's bf16 output. ``ep``: an :class:`moeref.distributed.EPPlacement`; each rank sums the slots
        of its experts into its own FP32 partial output, and the partials are added in rank order."""
        torch = self.torch
        lay, cfg = self.lay, self.lay.config
        m, k = self.x.shape
        ids, w = self.ids.clone(), self.w.clone()
        if fault == "renormalized_weights":
            w = w / w.sum(1, keepdim=True).clamp(min=1e-30)
        if fault == "swapped_topk_weights":
            w[0, [0, 1]] = w[0, [1, 0]].clone()
        if fault == "neighbour_expert":
            ids[0, 0] = (ids[0, 0] + 1) % self.w13.shape[0]
        g1 = 128 if lay.scheme.startswith("fp8_1x128") else k
        a = _fp8_groups(torch, self.x, g1, self.ue8m0)[0] if self.fp8 else self.x.to(torch.bfloat16).float()
        chunks = [(0, m)] if variant != "chunks_of_32" else [(s, min(s + 32, m)) for s in range(0, m, 32)]
        out = torch.zeros(m, k, device=self.dev)
        for s0, s1 in chunks:
            tok, slot = torch.nonzero(ids[s0:s1] >= 0, as_tuple=True)
            tok = tok + s0
            ex = ids[tok, slot]
            y = self._mlp(a[tok], ex, self.w13, self.w2, gemm, fault, variant, lay.weights)
            contrib = w[tok, slot][:, None] * y.float()
            if variant == "reverse_topk":
                for j in range(ids.shape[1] - 1, -1, -1):
                    sel = slot == j
                    out.index_add_(0, tok[sel], contrib[sel])
            elif ep is not None:
                owner = torch.from_numpy(np.array(ep.owner, np.int64)).to(self.dev)[ex]
                for r in range(ep.ep_size):
                    sel = owner == r
                    part = torch.zeros(m, k, device=self.dev)
                    part.index_add_(0, tok[sel], contrib[sel])
                    out += part
            else:
                out.index_add_(0, tok, contrib)
        if self.shared is not None:
            zero = torch.zeros(m, dtype=torch.int64, device=self.dev)
            out = out + self._mlp(a, zero, self.shared[0], self.shared[1], gemm, None, variant,
                                  cfg.shared_experts.as_weights()).float()
        res = out.to(torch.bfloat16)
        if fault == "rz_output_store":
            res = _toward_zero(torch, out, "bfloat16").to(torch.bfloat16)
        if fault == "last_bit_noise":
            flat = res.view(torch.int16).reshape(-1)
            gen = torch.Generator(device="cpu").manual_seed(1)
            idx = torch.randperm(flat.numel(), generator=gen)[: max(1, flat.numel() // 200)].to(self.dev)
            flat[idx] ^= 1
        return res

    def _mlp(self, a, ex, w13, w2, gemm, fault, variant, weights):
        torch = self.torch
        lay, cfg = self.lay, self.lay.config
        n = w2.shape[2]
        kind1 = "split_k" if variant == "split_k" else gemm
        k_cut = a.shape[1] - 128 if fault == "skipped_last_k_block" else None
        if fault == "rz_gemm1_store":  # FP32 GEMM1, then a truncating bf16 store
            h = _toward_zero(torch, self._gemm(a, w13, ex, kind1, out_dtype=torch.float32), "bfloat16")
        else:
            h = self._gemm(a, w13, ex, kind1, self.busiest, k_cut).float()
        if weights.b13 is not None:
            h = h + torch.from_numpy(np.asarray(weights.b13, np.float32)).to(self.dev)[ex]
        h = h.to(torch.bfloat16).float()
        layout = weights.w13_layout
        if layout == "interleaved":
            gate, up = h[:, 0::2], h[:, 1::2]
        elif layout == "up_gate":
            up, gate = h[:, :n], h[:, n:]
        else:
            gate, up = h[:, :n], h[:, n:]
        if fault == "gate_up_swapped":
            sel = (ex == self.busiest)[:, None]
            gate, up = torch.where(sel, up, gate), torch.where(sel, gate, up)
        if cfg.activation == "silu_and_mul":
            x = torch.nn.functional.silu(gate) * up
        elif cfg.activation == "gelu_and_mul":
            x = torch.nn.functional.gelu(gate, approximate="tanh" if fault == "tanh_gelu" else "none") * up
        else:
            gc = gate.clamp(max=7.0)
            x = (up.clamp(-7.0, 7.0) + 1) * gc * torch.sigmoid(1.702 * gc)
        if cfg.act_out_dtype is not None or not self.fp8:
            x = _toward_zero(torch, x, "bfloat16") if fault == "rz_intermediate" and not self.fp8 else \
                x.to(torch.bfloat16).float()
        if self.fp8:
            x = _fp8_groups(torch, x, 128 if lay.scheme.startswith("fp8_1x128") else n, self.ue8m0,
                            toward_zero=fault == "rz_intermediate")[0]
        w2u = w2
        if fault == "halved_w2_scale_block":
            w2u = w2.clone()  # the 128x128 block holding the busiest expert's first nonzero weight (exact-regime
            nz = torch.nonzero(w2[self.busiest])  # w2 is sparse: a block of zeros halved would change nothing)
            r0, c0 = (int(v) // 128 * 128 for v in nz[0]) if nz.shape[0] else (0, 0)
            w2u[self.busiest, r0:r0 + 128, c0:c0 + 128] *= 0.5
        stored = self.gemm2_store or fault == "second_gemm2_store"
        y = self._gemm(x, w2u, ex, gemm, out_dtype=None if stored else torch.float32).float()
        if weights.b2 is not None:
            y = y + torch.from_numpy(np.asarray(weights.b2, np.float32)).to(self.dev)[ex]
        return y.to(torch.bfloat16) if stored else y
