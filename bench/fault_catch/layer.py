"""The planted-fault study's honest layer in torch eager (``bench/bench_fault_catch.py`` describes it), the steps
its internal faults and honest variants replace (:class:`Hooks`), and the lists of faults and honest variants."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bench.fault_catch.cases import (LAYERS, Case, dropped_last_slot, expert_map_last_rank, gate_up_swapped,
                                     halved_w2_scale_block, ids_stride_off_by_one, k_scale_off_by_one,
                                     last_bit_noise, neighbour_expert, renormalized_weights, scale_grid_transposed,
                                     skip_last_k_block, swapped_topk_weights, ue8m0_exponent_bias_off_by_one,
                                     w2_scale_row_off_by_one)


# ------------------------------------------------------------------------------------------------ the torch layer


@dataclass(frozen=True)
class Hooks:
    """Steps of :class:`TorchLayer` an internal fault or an honest variant replaces (None: the honest step)."""

    gemm_sum: str = "fp32"  # how K-block partials (FP8) or K chunks (bf16) are summed: fp32, reverse, split, bf16
    quant: str = "honest"  # a1/a2: honest, amax_skips_last, group_offset, ue8m0_floor
    a2: str = "fp8"  # fp8, none (kept bf16), per_token, neighbour_scale, e5m2
    act: str = "honest"  # honest, tanh_gelu, bf16_store, rz_store, weight_first
    gemm2_store: str = "rne"  # rne, rz
    out_store: str = "rne"  # rne, rz
    reduce: str = "fp32"  # fp32, reverse, bf16, by_rank
    rows: str = "honest"  # honest, swizzle_partial_tile, padding_leak
    chunk: int | None = None  # tokens per chunk


def _rz_bf16(torch, x):
    """float32 -> bf16 rounding toward zero (truncate the low 16 bits)."""
    b = x.float().contiguous().view(torch.int32) & torch.tensor(-65536, dtype=torch.int32, device=x.device)
    return b.view(torch.float32).to(torch.bfloat16)


class TorchLayer:
    """The honest layer in torch on ``device`` (``bench/bench_fault_catch.py``'s docstring); ``run(case, hooks)`` ->
    bf16 ``[M, K]``."""

    def __init__(self, device: str, ranks: int):
        import torch

        self.torch, self.dev, self.ranks = torch, torch.device(device), ranks
        self._cache: dict = {}

    def _weight(self, w, fp8: bool):
        key = id(w)
        hit = self._cache.get(key)
        if hit is not None and hit[0] is w:
            return hit[1]
        torch = self.torch
        if fp8:
            codes = torch.from_numpy(np.array(w.codes)).view(torch.float8_e4m3fn).to(self.dev).float()
            scales = torch.from_numpy(np.asarray(w.scale_values(), np.float32).copy()).to(self.dev)
            val = (codes, scales)
        else:
            val = torch.from_numpy(np.ascontiguousarray(w).view(np.int16)).view(torch.bfloat16).to(self.dev).float()
        self._cache[key] = (w, val)
        return val

    # -- FP8 quantization (DeepGEMM's rule: amax.clamp(1e-4), sf = amax / 448, x * (1 / sf), torch's E4M3 cast)
    def _quant(self, x, ue8m0: bool, hooks: Hooks, group: int = 128, fmt: str = "e4m3"):
        torch = self.torch
        m, k = x.shape
        xg = x.reshape(m, k // group, group)
        if hooks.quant == "group_offset":  # the amax of group j read over columns 128j+1 .. 128j+128
            shifted = torch.cat([x[:, 1:], torch.zeros(m, 1, device=x.device)], 1).reshape(m, k // group, group)
            amax = shifted.abs().amax(-1, keepdim=True)
        elif hooks.quant == "amax_skips_last":
            amax = xg[..., :-1].abs().amax(-1, keepdim=True)
        else:
            amax = xg.abs().amax(-1, keepdim=True)
        fmax = 448.0 if fmt == "e4m3" else 57344.0
        sf = amax.clamp(min=1e-4) / torch.tensor(fmax, device=x.device)
        if ue8m0:
            mant, ex = torch.frexp(sf)
            up = (mant != 0.5).to(ex.dtype)
            if hooks.quant == "ue8m0_floor":
                up = torch.zeros_like(ex)
            sf = torch.ldexp(torch.ones_like(sf), ex - 1 + up)
        dt = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
        codes = (xg * (1.0 / sf)).to(dt).float()
        return codes.reshape(m, k), sf.reshape(m, k // group)

    def _gemm(self, a, a_s, w, fp8: bool, hooks: Hooks):
        """``a [R, K]`` (codes, or bf16 values) times ``w`` ``[N, K]`` -> float32 ``[R, N]``."""
        torch = self.torch
        if fp8:
            codes, ws = w
            r, k = a.shape
            nb = k // 128
            parts = torch.bmm(a.reshape(r, nb, 128).transpose(0, 1),
                              codes.reshape(-1, nb, 128).permute(1, 2, 0))  # [nb, R, N], FP32 block sums
            sw = ws.repeat_interleave(128, 0)[: codes.shape[0]].T  # [nb, N]
            parts = parts * a_s.T[:, :, None] * sw[:, None, :]
            order = range(nb)
            if hooks.gemm_sum == "reverse":
                order = range(nb - 1, -1, -1)
            if hooks.gemm_sum == "split":  # two halves of K, each summed, then added
                h = nb // 2
                lo = torch.zeros_like(parts[0])
                hi = torch.zeros_like(parts[0])
                for i in range(h):
                    lo = lo + parts[i]
                for i in range(h, nb):
                    hi = hi + parts[i]
                return hi + lo
            acc = torch.zeros_like(parts[0])
            for i in order:
                acc = (acc + parts[i]).to(torch.bfloat16).float() if hooks.gemm_sum == "bf16" else acc + parts[i]
            return acc
        k = a.shape[1]
        if hooks.gemm_sum in ("split", "reverse"):
            h = k // 2
            lo, hi = a[:, :h] @ w[:, :h].T, a[:, h:] @ w[:, h:].T
            return lo + hi if hooks.gemm_sum == "split" else hi + lo
        if hooks.gemm_sum == "bf16":  # a bf16 accumulator: 32-column chunks added in bf16
            acc = torch.zeros(a.shape[0], w.shape[0], device=a.device)
            for s in range(0, k, 32):
                acc = (acc + a[:, s:s + 32] @ w[:, s:s + 32].T).to(torch.bfloat16).float()
            return acc
        return a @ w.T

    def _act(self, h, activation: str, hooks: Hooks):
        torch = self.torch
        n = h.shape[1] // 2
        gate, up = h[:, :n], h[:, n:]
        if activation == "gelu_and_mul":
            x = torch.nn.functional.gelu(gate, approximate="tanh" if hooks.act == "tanh_gelu" else "none") * up
        else:
            x = torch.nn.functional.silu(gate) * up
        return x

    def run(self, case: Case, hooks: Hooks = Hooks()):
        torch = self.torch
        m, k = case.hidden.shape
        x = torch.from_numpy(case.hidden).to(self.dev)
        ids = torch.from_numpy(case.topk_ids.astype(np.int64)).to(self.dev)
        tw = torch.from_numpy(case.topk_weights.astype(np.float32)).to(self.dev)
        out = torch.zeros(m, k, device=self.dev)
        step = hooks.chunk or max(m, 1)
        for s0 in range(0, m, step):
            s1 = min(s0 + step, m)
            out[s0:s1] = self._chunk(case, x[s0:s1], ids[s0:s1], tw[s0:s1], hooks)
        if hooks.out_store == "rz":
            return _rz_bf16(torch, out)
        return out.to(torch.bfloat16)

    def _chunk(self, case: Case, x, ids, tw, hooks: Hooks):
        torch = self.torch
        m, k = x.shape
        top = ids.shape[1]
        if case.fp8:
            a, a_s = self._quant(x, case.ue8m0, hooks)
        else:
            a, a_s = x, None
        tok, slot = torch.nonzero(ids >= 0, as_tuple=True)
        ex = ids[tok, slot]
        y = torch.zeros(tok.numel(), k, device=self.dev)
        experts = sorted(set(ex.tolist()))
        rows_of = {e: torch.nonzero(ex == e).flatten() for e in experts}
        extra = []  # (token, slot weight, y row) of leaking padding rows
        for e in experts:
            sel = rows_of[e]
            toks = tok[sel]
            ae = a[toks]
            if hooks.act == "weight_first":  # the router weight applied to the input rows before GEMM1
                ae = x[toks] * tw[toks, slot[sel]][:, None]
                if case.fp8:
                    ae, ase = self._quant(ae, case.ue8m0, hooks)
                else:
                    ae, ase = ae.to(torch.bfloat16).float(), None
            else:
                ase = a_s[toks] if a_s is not None else None
            w13 = self._weight(case.weights.w13[e], case.fp8)
            w2 = self._weight(case.weights.w2[e], case.fp8)
            h = self._gemm(ae, ase, w13, case.fp8, hooks).to(torch.bfloat16).float()
            if hooks.rows == "swizzle_partial_tile" and e == self._tile_expert(case, 64):
                full = (h.shape[0] // 64) * 64
                h = torch.cat([h[:full], h[full:].flip(0)])
            xa = self._act(h, case.activation, hooks)
            declared_act = case.options.get("act_out_dtype") is not None or not case.fp8
            if hooks.act == "rz_store":
                xa = _rz_bf16(torch, xa).float()
            elif declared_act or hooks.act == "bf16_store":
                xa = xa.to(torch.bfloat16).float()
            if case.fp8:
                if hooks.a2 == "none":
                    xq, xs = xa.to(torch.bfloat16).float(), None
                elif hooks.a2 == "per_token":
                    xq, xs = self._quant(xa, case.ue8m0, hooks, group=xa.shape[1])
                    xs = xs.repeat_interleave(xa.shape[1] // 128, 1)
                elif hooks.a2 == "neighbour_scale":  # codes with each group's scale, GEMM2 with the next one's
                    xq, xs = self._quant(xa, case.ue8m0, hooks)
                    xs = torch.cat([xs[:, 1:], xs[:, -1:]], 1)
                elif hooks.a2 == "e5m2":
                    xq, xs = self._quant(xa, case.ue8m0, hooks, fmt="e5m2")
                else:
                    xq, xs = self._quant(xa, case.ue8m0, hooks)
                if xs is None:  # no re-quantization: a bf16 GEMM2 against the dequantized weights
                    codes, ws = w2
                    wd = codes * ws.repeat_interleave(128, 0)[: codes.shape[0]].repeat_interleave(128, 1)[:, : codes.shape[1]]
                    ye = xq @ wd.T
                else:
                    ye = self._gemm(xq, xs, w2, True, hooks)
            else:
                ye = self._gemm(xa, None, w2, False, hooks)
            ye = _rz_bf16(torch, ye).float() if hooks.gemm2_store == "rz" else ye.to(torch.bfloat16).float()
            y[sel] = ye
            if hooks.rows == "padding_leak" and e == self._tile_expert(case, 16):
                pad = (-sel.numel()) % 16  # padding rows hold the last real row; scattered to its token again
                last = sel[-1]
                extra += [(tok[last], tw[tok[last], slot[last]], ye[-1])] * pad
        w = tw[tok, slot][:, None]
        if hooks.act == "weight_first":
            w = torch.ones_like(w)
        contrib = w * y
        out = torch.zeros(m, k, device=self.dev)
        if hooks.reduce == "bf16":
            out = out.to(torch.bfloat16)
            for j in range(top):
                sel = slot == j
                out.index_add_(0, tok[sel], contrib[sel].to(torch.bfloat16))
            out = out.float()
        elif hooks.reduce in ("reverse", "by_rank"):
            if hooks.reduce == "reverse":
                groups = [slot == j for j in range(top - 1, -1, -1)]
            else:
                e_all = len(case.weights.w13)
                per = -(-e_all // self.ranks)
                groups = [(ex // per) == r for r in range(self.ranks)]
            for sel in groups:
                out.index_add_(0, tok[sel], contrib[sel])
        else:
            out.index_add_(0, tok, contrib)
        for t, wt, row in extra:
            out[t] += wt * row
        return out

    @staticmethod
    def _tile_expert(case: Case, tile: int) -> int:
        """The busiest expert whose row count is not a multiple of ``tile`` (it has a partial last tile)."""
        rows = case.expert_rows()
        for e in np.argsort(-rows, kind="stable"):
            if rows[e] % tile:
                return int(e)
        return int(np.argmax(rows))


# ------------------------------------------------------------------------------------------------ faults, variants


@dataclass(frozen=True)
class Variant:
    """A planted fault or an honest variant: ``edit`` changes the kernel's inputs (``Case -> Case``), ``post`` its
    output, ``hooks`` a step of the torch layer. Input/output variants (no hooks) wrap any honest kernel."""

    name: str
    layers: tuple
    what: str
    edit: object = None
    post: object = None
    hooks: Hooks | None = None

    @property
    def level(self) -> str:
        return "internal" if self.hooks is not None else "inputs"


FP8 = ("fp8",)
FP8_ALL = ("fp8", "fp8_ue8m0")
ALL = tuple(LAYERS)


def faults(shape: dict) -> list:
    ranks = shape["ranks"]
    H = Hooks
    return [
        Variant("skip_last_k_block", FP8, "GEMM1 skips the last 128-column K block (busiest expert)", skip_last_k_block),
        Variant("halved_w2_scale_block", FP8, "one 128x128 w2 scale block halved (busiest expert)", halved_w2_scale_block),
        Variant("swapped_topk_weights", FP8, "top-k weights of slots 0 and 1 swapped (token 0)", swapped_topk_weights),
        Variant("last_bit_noise", FP8, "last bit flipped in 0.5% of the bf16 outputs", post=last_bit_noise),
        Variant("gate_up_swapped", FP8, "gate and up halves swapped (busiest expert)", gate_up_swapped),
        Variant("k_scale_off_by_one", FP8, "GEMM1 reads the next K block's weight scale (busiest expert)",
                k_scale_off_by_one),
        Variant("w2_scale_row_off_by_one", FP8, "GEMM2 reads the next 128-row block's weight scale (busiest expert)",
                w2_scale_row_off_by_one),
        Variant("scale_grid_transposed", FP8, "w13 scale grid read transposed (busiest expert)", scale_grid_transposed),
        Variant("renormalized_weights", FP8, "router weights renormalised when they should not be", renormalized_weights),
        Variant("neighbour_expert", FP8, "token 0, slot 0 routed to the neighbouring expert", neighbour_expert),
        Variant("expert_map_last_rank", FP8, f"expert map off by one on the last of {ranks} EP ranks",
                lambda c: expert_map_last_rank(c, ranks)),
        Variant("dropped_last_slot", FP8, "the last token loses its last top-k slot", dropped_last_slot),
        Variant("ids_stride_off_by_one", FP8, "slot 1 reads the previous token's expert id (last 8 tokens)",
                ids_stride_off_by_one),
        Variant("weight_before_activation", FP8, "router weight applied to GEMM1's input, not the output",
                hooks=H(act="weight_first")),
        Variant("swizzle_partial_tile", FP8, "rows of a partial 64-row tile swizzled (reversed) after GEMM1",
                hooks=H(rows="swizzle_partial_tile")),
        Variant("padding_rows_leak", FP8, "padding rows of a partial 16-row tile leak into the top-k sum",
                hooks=H(rows="padding_leak")),
        Variant("bf16_topk_sum", FP8, "top-k sum accumulated in bf16", hooks=H(reduce="bf16")),
        Variant("rz_output_store", FP8, "output stored round-toward-zero instead of to nearest even",
                hooks=H(out_store="rz")),
        Variant("rz_gemm2_store", FP8, "GEMM2 output stored round-toward-zero", hooks=H(gemm2_store="rz")),
        Variant("a2_not_requantized", FP8, "intermediate kept in bf16 (no FP8 re-quantization)", hooks=H(a2="none")),
        Variant("a2_per_token_scale", FP8, "intermediate quantized with one scale per token, not per 128",
                hooks=H(a2="per_token")),
        Variant("a2_neighbour_group_scale", FP8, "GEMM2 reads the intermediate's next 128-group scale",
                hooks=H(a2="neighbour_scale")),
        Variant("a2_e5m2", FP8, "intermediate quantized to E5M2 instead of E4M3", hooks=H(a2="e5m2")),
        Variant("amax_skips_last_column", FP8, "activation scales: the amax misses each group's last column",
                hooks=H(quant="amax_skips_last")),
        Variant("quant_group_offset", FP8, "activation scales: groups read one column late", hooks=H(quant="group_offset")),
        Variant("bf16_k_block_sum", FP8, "GEMM K-block partial sums accumulated in bf16", hooks=H(gemm_sum="bf16")),
        Variant("ue8m0_rounded_down", ("fp8_ue8m0",), "UE8M0 activation scales rounded down instead of up",
                hooks=H(quant="ue8m0_floor")),
        Variant("ue8m0_bias_off_by_one", ("fp8_ue8m0",), "w13 UE8M0 scales decoded with bias 128 (busiest expert)",
                ue8m0_exponent_bias_off_by_one),
        Variant("tanh_gelu", ("bf16_gelu",), "erf GELU computed as tanh GELU", hooks=H(act="tanh_gelu")),
        Variant("bf16_accumulation", ("bf16_gelu",), "GEMMs accumulate in bf16 (32-column chunks)",
                hooks=H(gemm_sum="bf16")),
        Variant("rz_activation_store", ("bf16_gelu",), "activation stored round-toward-zero", hooks=H(act="rz_store")),
    ]


def honest(shape: dict) -> list:
    H = Hooks
    return [
        Variant("torch eager", ALL, "the honest layer", hooks=H()),
        Variant("split-K GEMMs", ALL, "every GEMM's K in two halves, summed", hooks=H(gemm_sum="split")),
        Variant("K blocks reversed", ALL, "GEMM K blocks summed in reverse order", hooks=H(gemm_sum="reverse")),
        Variant("top-k sum reversed", ALL, "top-k sum in reverse slot order", hooks=H(reduce="reverse")),
        Variant("EP shards", ALL, f"experts on {shape['ranks']} ranks, combined rank by rank", hooks=H(reduce="by_rank")),
        Variant("chunked tokens", ALL, f"tokens in chunks of {shape['chunk']}", hooks=H(chunk=shape["chunk"])),
        Variant("activation stored in bf16", FP8_ALL, "the activation stored in bf16 before the re-quantization",
                hooks=H(act="bf16_store")),
    ]
