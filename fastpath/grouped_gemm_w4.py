"""Grouped GEMMs with 4-bit weights and bf16 activations (W4A16) on the GPU: MXFP4, NVFP4 and INT4 groups.

The contiguous-layout contract of :mod:`fastpath.grouped_gemm` (DeepGEMM's): ``d[r] = a[r] @ W[m_indices[r]].T``
for rows ``r`` of ``a [M_sum, K]``, -1 marks padding rows (output unspecified), each expert's rows start on
a multiple of the row tile; the masked layout runs the same kernel over ``E x max_m`` rows. The weights
are :class:`W4Experts`: packed codes ``uint8 [E, N, K/2]`` (element ``2i`` in the low nibble,
:func:`moeref.formats.pack_nibbles`) with the scheme's own scales, decoded in the kernel's K loop:

* ``"mxfp4"`` (OCP MX; gpt-oss checkpoints, :func:`W4Experts.from_gptoss`): E2M1 codes, one E8M0 code per
  32 along K, ``w = e2m1 * 2^(s - 127)``;
* ``"nvfp4"``: E2M1 codes, one UE4M3 code per 16 along K (rows per scale 1, or 16 for TransformerEngine's
  16x16 weight tiles), times a per-expert FP32 global decode factor, ``w = e2m1 * ue4m3 * g``;
* ``"int4"``: signed INT4 codes (two's complement nibbles, :func:`moeref.quant.int4_group`) or unsigned
  codes with integer zero points (``symmetric=False``, GPTQ), one FP32 scale per ``group`` along K,
  ``w = (q - zp) * s``.

What the kernel computes, and the profile it declares (``PROFILE_OF``: ``BF16_OUTPUT`` for bf16
activations, as the bf16 Triton kernel; its ``contiguous_tree`` model, :func:`moeref.compare.gemm_error_bound`):

* MXFP4: ``e2m1 * 2^(s-127)`` is built as FP32 bits (:func:`_e2m1_scaled_f32`: integer operations, no
  rounding, no subnormal) and cast to the activations' dtype; both steps are exact
  (two significant bits times a power of two) whenever the value is a normal bf16, which
  :meth:`W4Experts.from_quantized` checks (codes 2..252 for every block with a nonzero element; all-zero
  blocks get code 127, the same zeros). So the tensor core multiplies the exact weight values: products
  exact, FP32 accumulation over K, the one rounding is the bf16 output store.
* NVFP4: ``e2m1 * ue4m3`` (at most 6 significant bits, magnitudes 2^-10..2688) is exact in bf16; the
  global factor is NOT applied per element (``ue4m3 * g`` has up to 28 bits) but once to the FP32
  accumulator of the expert's tile, as ``(acc * g_mul) / g_div`` (correctly rounded: two FP32 roundings),
  where the FP32 pair is the anchor's own number: ``(g, 1)`` for a decode scale, ``(1, S_enc)`` for an
  encode scale, ``(A, 2688)`` for an amax (TransformerEngine), chosen so that ``g_mul / g_div`` rounds to
  the reference's float64 factor (|relative difference| <= 2^-53). The profile's model allows two FP32
  scale multiplications per product on a node inside one scale block (here the whole K range), whose
  ``gamma(2, 2^-24)`` exceeds ``2 * 2^-24`` by far more than 2^-53: covered.
* INT4: ``(q - zp) * s`` is not a bf16 value, so the scale is applied per group like DeepGEMM's promotion:
  per K tile (``block_k`` divides the group) ``part = tl.dot(a, q - zp)`` (exact small integers, FP32
  accumulation), then ``acc += part * s[n]`` in FP32. Each scaled node is a contiguous K range inside one
  scale block: the same model.

* FP8 E4M3 activations with 1x128 FP32 scales (W4A8; in the layer ``w4_activations="float8_e4m3fn"``, profile
  ``BF16_OUTPUT_FP32_ACT`` since the activation is then quantized from FP32, not stored in bf16): the codes are
  widened exactly to bf16, one ``tl.dot`` per K tile (``block_k`` divides 128) whose FP32 result is multiplied
  by the row's activation scale (and, INT4, the group scale) and added in FP32: again a scaled node inside
  one scale block, two FP32 roundings at most.

Tiles (:class:`W4Tiles`, :class:`W4TileRule`): ``swap_ab`` computes each tile as ``W @ a^T`` (the decoded
weights become the register operand of Hopper's WGMMA, the rows its narrow side, 16 at decode); the products,
the K order and the chain of MMAs over K are those of ``a @ W^T``: on an H100 (2026-11-24) both orientations and
the former kernel gave bit-identical outputs at gpt-oss shapes. A ``block_k`` dividing K drops the K masks, so the
codes and scales load asynchronously (cp.async) and the decode stays in registers
(``bench/studies/w4_sass_census.py`` shows the compiled loop).

Bias: FP32 ``[E, N]`` added to the accumulator before the store (as :mod:`fastpath.grouped_gemm`).
Activations: bf16 (the W4A16 kernels), or float32 (then ``tl.dot`` runs in IEEE FP32, never TF32: the
profile is ``FP32_ACCUM`` with the output stored in float32). fp16 activations are refused (MXFP4 values
exceed fp16's range). Under ``TRITON_INTERPRET=1`` (CI) the interpreter's dot of bf16 inputs is not the
hardware's, so the CPU tests use float32 activations: the kernel then decodes the weights to float32 (the
same exact values) and checks the decoding, tiling, scale indexing and epilogue against the exact reference.

Entry points (stable): :class:`W4Experts` (``from_quantized``, ``from_gptoss``), :func:`w4_supports`,
:func:`grouped_gemm_w4_contiguous`, :func:`grouped_gemm_w4_masked`, :data:`PROFILE_OF`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import triton
import triton.language as tl

from moeref._interop import triton_interpreted
from moeref.gemm.stacked import experts_to_stack

from .grouped_gemm import GemmTiles

__all__ = ["W4_KINDS", "W4Experts", "W4Tiles", "W4TileRule", "PROFILE_OF", "w4_supports",
           "grouped_gemm_w4_contiguous", "grouped_gemm_w4_masked", "DEFAULT_W4_TILE_RULE", "rows_per_expert"]

W4_KINDS = ("mxfp4", "nvfp4", "int4")
_FMT = {"mxfp4": 0, "nvfp4": 1, "int4": 2}
PROFILE_OF = {("triton", "mxfp4"): "BF16_OUTPUT", ("triton", "nvfp4"): "BF16_OUTPUT",
              ("triton", "int4"): "BF16_OUTPUT"}
"""The :mod:`moeref.compare` profile each (implementation, weight kind) declares for bf16 activations
(float32 activations: ``FP32_ACCUM`` with float32 stores)."""



@dataclass(frozen=True)
class W4Tiles(GemmTiles):
    """:class:`fastpath.grouped_gemm.GemmTiles` with ``swap_ab`` on by default: compute each tile transposed
    (``W @ a^T``: the decoded weights are the MMA's register operand, the rows its narrow side)."""

    swap_ab: bool = True


@dataclass(frozen=True)
class W4TileRule:
    """The tile when none is given, from ``r``, the average number of real rows per expert (``expected_m``):
    the first of ``swap_tiles`` (computed transposed, ascending ``block_m``) whose ``block_m >= r``, else
    ``large``, computed transposed for the weight kinds in ``large_swap_kinds``. The defaults are the fastest
    measured tiles of docs/data/moe_device_h100_w4.json (H100, 2026-11-24; docs/moe-gpu.md gives the reading)."""

    swap_tiles: tuple = (W4Tiles(16, 128, 64, 4, 4), W4Tiles(32, 128, 64, 4, 4), W4Tiles(64, 128, 64, 4, 3))
    large: W4Tiles = W4Tiles(128, 128, 64, 8, 3, swap_ab=False)
    large_swap_kinds: tuple = ("int4",)

    def __post_init__(self):
        ms = [t.block_m for t in self.swap_tiles]
        if not self.swap_tiles or ms != sorted(set(ms)) or not all(t.swap_ab for t in self.swap_tiles):
            raise ValueError(f"swap_tiles must be swap_ab tiles of strictly increasing block_m; got {self.swap_tiles}")
        if not set(self.large_swap_kinds) <= set(W4_KINDS):
            raise ValueError(f"large_swap_kinds must be among {W4_KINDS}; got {self.large_swap_kinds}")

    def tiles(self, rows_per_expert: float, kind: str) -> W4Tiles:
        """The tile for ``rows_per_expert`` rows per expert on average of ``kind`` weights (a host number)."""
        if kind not in W4_KINDS:
            raise ValueError(f"kind must be one of {W4_KINDS}; got {kind!r}")
        for t in self.swap_tiles:
            if rows_per_expert <= t.block_m:
                return t
        return replace(self.large, swap_ab=kind in self.large_swap_kinds)


DEFAULT_W4_TILE_RULE = W4TileRule()
"""The rule :func:`grouped_gemm_w4_contiguous` applies when no tiles are given."""
_INTERPRETER_TILES = W4Tiles(16, 32, 32, 1, 1)


@dataclass(frozen=True, eq=False)
class W4Experts:
    """4-bit expert weights ``[E, N, K]`` as the kernel reads them (torch tensors on one device).

    Attributes:
        kind: ``"mxfp4"``, ``"nvfp4"`` or ``"int4"``.
        codes: uint8 ``[E, N, K/2]``, two codes a byte, element ``2i`` in the low nibble.
        scales: ``[E, ceil(N/scale_rows), ceil(K/group)]``: uint8 E8M0 codes (mxfp4), uint8 UE4M3 codes
            (nvfp4), float32 (int4).
        group: K elements per scale (32, 16, the INT4 group size).
        scale_rows: rows (N) per scale (1; 16 for NVFP4 16x16 weight tiles).
        k: logical K (even).
        global_mul, global_div: float32 ``[E]`` (nvfp4): the decode factor is ``global_mul / global_div``.
        zero_points: uint8 ``[E, N, ceil(K/group)]`` (int4 with unsigned codes), else None (signed codes).
    """

    kind: str
    codes: torch.Tensor
    scales: torch.Tensor
    group: int
    scale_rows: int
    k: int
    global_mul: torch.Tensor | None = None
    global_div: torch.Tensor | None = None
    zero_points: torch.Tensor | None = None

    def __post_init__(self):
        if self.kind not in W4_KINDS:
            raise ValueError(f"kind must be one of {W4_KINDS}; got {self.kind!r}")
        if self.codes.dtype != torch.uint8 or self.codes.dim() != 3:
            raise ValueError(f"codes must be uint8 [E, N, K/2]; got {self.codes.dtype} {tuple(self.codes.shape)}")
        e, n, kb = (int(d) for d in self.codes.shape)
        if self.k % 2 or kb != self.k // 2:
            raise ValueError(f"codes must hold K/2 = {self.k // 2} bytes a row (K = {self.k} even); got {kb}")
        grid = (e, -(-n // self.scale_rows), -(-self.k // self.group))
        if tuple(self.scales.shape) != grid:
            raise ValueError(f"scales must have the grid {grid}; got {tuple(self.scales.shape)}")
        want = torch.float32 if self.kind == "int4" else torch.uint8
        if self.scales.dtype != want:
            raise ValueError(f"{self.kind} scales must be {want}; got {self.scales.dtype}")
        if self.kind == "nvfp4" and (self.global_mul is None or self.global_div is None):
            raise ValueError("nvfp4 weights need global_mul and global_div (float32 [E])")
        if self.zero_points is not None and (self.kind != "int4" or tuple(self.zero_points.shape) != grid):
            raise ValueError(f"zero_points are int4 only, shaped {grid}")

    @property
    def shape(self) -> tuple:
        """``(E, N, K)``."""
        return (int(self.codes.shape[0]), int(self.codes.shape[1]), self.k)

    @property
    def num_experts(self) -> int:
        return int(self.codes.shape[0])

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def to(self, device) -> "W4Experts":
        mv = (lambda t: None if t is None else t.to(device))
        return replace(self, codes=mv(self.codes), scales=mv(self.scales), global_mul=mv(self.global_mul),
                       global_div=mv(self.global_div), zero_points=mv(self.zero_points))

    def select(self, experts) -> "W4Experts":
        """The experts ``experts`` (an EP shard), in that order."""
        idx = torch.as_tensor([int(e) for e in experts], dtype=torch.long, device=self.device)
        pick = (lambda t: None if t is None else t.index_select(0, idx))
        return replace(self, codes=pick(self.codes), scales=pick(self.scales), global_mul=pick(self.global_mul),
                       global_div=pick(self.global_div), zero_points=pick(self.zero_points))

    @classmethod
    def from_quantized(cls, tensors, device="cuda") -> "W4Experts":
        """Stack per-expert :class:`moeref.quant.QuantizedTensor` s ``[N, K]`` of one 4-bit scheme
        (:func:`moeref.quant.mxfp4`, :func:`moeref.quant.nvfp4` / ``nvfp4_weight``,
        :func:`moeref.quant.int4_group`; :func:`moeref.moe.quantize_weights` makes them).
        ``ValueError`` for anything else, and for MXFP4 scales whose weights leave bf16's normal range."""
        tensors = experts_to_stack(tensors)
        first = tensors[0]
        kind, group, rows = _kind_of(first)
        n, k = (int(d) for d in first.shape)
        if k % 2:
            raise ValueError(f"K = {k} is odd: 4-bit codes are packed two a byte (pad K)")
        codes = torch.from_numpy(np.stack([np.asarray(t.codes, np.uint8) for t in tensors]))
        sc = np.stack([np.asarray(t.scales) for t in tensors])
        gm = gd = zp = None
        if kind == "mxfp4":
            sc = _checked_e8m0(codes, torch.from_numpy(sc.astype(np.uint8))).numpy()
        elif kind == "nvfp4":
            sc = sc.astype(np.uint8)
            if np.any(sc > 0x7E):
                raise ValueError("NVFP4 scale codes above 0x7E (NaN or a sign bit) have no kernel here")
            pairs = np.array([_global_pair(float(t.global_scale)) for t in tensors], np.float32)
            gm, gd = torch.from_numpy(pairs[:, 0].copy()), torch.from_numpy(pairs[:, 1].copy())
        else:
            sc = sc.astype(np.float32)
            if first.zero_points is not None:
                zp = torch.from_numpy(np.stack([np.asarray(t.zero_points) for t in tensors]).astype(np.uint8))
        out = cls(kind, codes, torch.from_numpy(np.ascontiguousarray(sc)), group, rows, k, gm, gd, zp)
        return out.to(device)

    @classmethod
    def from_gptoss(cls, blocks, scales, device="cuda") -> "W4Experts":
        """MXFP4 experts from a gpt-oss checkpoint's ``*_blocks [E, rows, K/32, 16]`` and ``*_scales
        [E, rows, K/32]`` (uint8; :mod:`moeref.layouts.gptoss`: the flat layout cut into 16-byte blocks,
        so this is a reshape). gate_up rows stay interleaved (``w13_layout="interleaved"``)."""
        from moeref.layouts import from_gptoss_mxfp4

        codes, sc = from_gptoss_mxfp4(_host(blocks), _host(scales))
        codes_t = torch.from_numpy(codes).to(device)
        k = int(codes.shape[-1]) * 2
        return cls("mxfp4", codes_t, _checked_e8m0(codes_t, torch.from_numpy(sc).to(device)), 32, 1, k)


def _host(x) -> np.ndarray:
    return x.cpu().numpy() if torch.is_tensor(x) else np.asarray(x)


def _kind_of(q) -> tuple[str, int, int]:
    s = q.scheme
    blk = tuple(int(b) for b in q.block_shape)
    bk = blk[-1]
    rows = blk[0] if len(blk) == 2 else 1
    if s.element == "e2m1" and s.scale_format == "ue8m0" and rows == 1 and q.global_scale is None:
        return "mxfp4", bk, 1
    if s.element == "e2m1" and s.scale_format == "ue4m3" and q.global_scale is not None and rows in (1, 16):
        return "nvfp4", bk, rows
    if s.element in ("int4", "uint4") and s.scale_format == "fp32" and rows == 1 and q.channel_scales is None:
        if (s.element == "uint4") != (q.zero_points is not None):
            raise ValueError(f"{s.name}: unsigned INT4 codes need zero points (and signed ones have none)")
        return "int4", bk, 1
    raise ValueError(f"scheme {s.name} (element {s.element}, scale {s.scale_format}, block {blk}) has no W4A16 "
                     f"kernel; accepted: MXFP4 (E8M0 / 32), NVFP4 (UE4M3 / 16 + global), INT4 groups (FP32 scales)")


def _checked_e8m0(codes: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """E8M0 codes with all-zero blocks set to 127 (their values stay 0); ``ValueError`` where a block with a
    nonzero element has a code outside 2..252 (its values would not be normal bf16 numbers: no exact decode).
    torch ops on the codes' device."""
    e, n, kb = (int(d) for d in codes.shape)
    nb = int(sc.shape[-1])
    mag = (codes & 0x77) != 0  # a nonzero magnitude in either nibble
    mag = torch.nn.functional.pad(mag, (0, nb * 16 - kb))
    nonzero = mag.reshape(e, n, nb, 16).any(dim=-1)
    bad = nonzero & ((sc < 2) | (sc > 252))
    if bool(bad.any()):
        i = tuple(int(v) for v in torch.nonzero(bad)[0])
        raise ValueError(f"E8M0 scale code {int(sc[i])} at {i} makes weights outside bf16's normal range "
                         "(codes 2..252 decode exactly); no exact W4A16 decode")
    return torch.where(nonzero, sc, torch.full_like(sc, 127))


def _global_pair(g: float) -> tuple[float, float]:
    """FP32 ``(g_mul, g_div)`` with ``g_mul / g_div`` rounding to the float64 decode factor ``g``."""
    if not (np.isfinite(g) and g > 0):
        raise ValueError(f"NVFP4 global decode factor {g!r} must be positive and finite")
    for mul, div in ((np.float32(g), np.float32(1)), (np.float32(1), np.float32(1.0 / g)),
                     (np.float32(g * 2688.0), np.float32(2688))):
        if np.isfinite(mul) and np.isfinite(div) and mul > 0 and float(mul) / float(div) == g:
            return float(mul), float(div)
    raise ValueError(f"the NVFP4 global decode factor {g!r} is neither an FP32 value, the reciprocal of one, "
                     "nor an FP32 amax / 2688: no FP32 epilogue reproduces it")


@triton.jit
def _e2m1_scaled_f32(c, sexp):
    """float32 value of E2M1 codes ``c`` (int32 0..15) times ``2^(s - 127)``, given ``sexp = (s - 1) << 23``
    (int32, E8M0 code ``s`` in 2..252; ``s = 127``: the plain E2M1 value), built bit by bit: no float
    arithmetic, so no rounding, no flush to zero. Magnitude code ``m = c & 7`` (exponent ``m >> 1``,
    mantissa bit ``m & 1``): for ``m >= 2`` the value ``(1 + (m & 1)/2) 2^((m >> 1) - 1) 2^(s - 127)`` has the
    FP32 exponent field ``(m >> 1) + s - 1`` (2..254) and the top mantissa bit ``m & 1``, i.e. the bits
    ``(m << 22) + ((s - 1) << 23)``; ``m = 1`` (0.5, E2M1's subnormal) is ``2^(s - 128)``: exponent field
    ``s - 1`` >= 1, mantissa 0, i.e. ``(s - 1) << 23``; ``m = 0`` is zero; bit 3 is the sign (bit 31)."""
    m = c & 7
    mag = tl.where(m >= 2, (m << 22) + sexp, tl.where(m == 1, sexp, 0))
    return (mag | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _ue4m3_f32(c):
    """float32 value of UE4M3 codes ``c`` (int32 0..126): ``m 2^-9`` (e = 0), ``(8 + m) 2^(e - 10)``."""
    e = c >> 3
    m = c & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    return tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)


@triton.jit
def _per_byte(x, BLOCK_N: tl.constexpr, KG: tl.constexpr, GROUP: tl.constexpr):
    """``[BLOCK_N, KG]`` per-group values repeated over the group's ``GROUP / 2`` bytes: ``[BLOCK_N, KG * GROUP / 2]``."""
    return tl.reshape(tl.broadcast_to(x[:, :, None], (BLOCK_N, KG, GROUP // 2)), (BLOCK_N, KG * (GROUP // 2)))


@triton.jit
def _w4_kernel(a_ptr, sa_ptr, w_ptr, s_ptr, zp_ptr, gm_ptr, gd_ptr, d_ptr, m_idx_ptr, bias_ptr, M, N, K,
               stride_am, stride_sam, stride_we, stride_wn, stride_se, stride_sn, stride_dm,
               FMT: tl.constexpr, GROUP: tl.constexpr, SCALE_ROWS: tl.constexpr, HAS_ZP: tl.constexpr,
               A_FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               K_ITERS: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, DOT_T: tl.constexpr,
               PROMOTE: tl.constexpr, SWAP_AB: tl.constexpr):
    # IEEE: float32 operands (DOT_T) and an IEEE FP32 dot (float32 activations; FP8 ones under the interpreter);
    # PROMOTE: a scale along K outside the weight values (INT4 groups, FP8 activations): a fresh dot per tile;
    # SWAP_AB: the tile is computed transposed, acc [BLOCK_N, BLOCK_M] = W [BLOCK_N, BLOCK_K] @ a^T: the
    # decoded weights are the dot's first operand (Hopper's WGMMA reads it from registers) and BLOCK_M
    # (the rows, few at decode) is the MMA's narrow N side. The same products and K order either way.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    row0 = pid_m * BLOCK_M
    e = tl.load(m_idx_ptr + row0)
    if e < 0:  # a tile of padding rows
        return
    e64 = e.to(tl.int64)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    ks = tl.arange(0, BLOCK_K)
    kb = tl.arange(0, BLOCK_K // 2)
    a_base = a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :]
    w_base = w_ptr + e64 * stride_we + cols[:, None].to(tl.int64) * stride_wn + kb[None, :]
    # E2M1 scales: a [BLOCK_N, BLOCK_K / GROUP] tile (contiguous: it loads asynchronously like the codes), its
    # per-group factor broadcast to the bytes [BLOCK_N, BLOCK_K / 2] (GROUP / 2 bytes a group)
    KG: tl.constexpr = BLOCK_K // GROUP if FMT != 2 else 1
    s_base = (s_ptr + e64 * stride_se + (cols // SCALE_ROWS)[:, None].to(tl.int64) * stride_sn
              + tl.arange(0, KG)[None, :])
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kgroups = (K + GROUP - 1) // GROUP
    for it in range(K_ITERS):
        k0 = it * BLOCK_K
        if EVEN_K:  # BLOCK_K divides K: no K masks, so the loads vectorise and pipeline (cp.async)
            a = tl.load(a_base + k0, mask=rmask[:, None], other=0.0).to(DOT_T)
            byte = tl.load(w_base + k0 // 2, mask=cmask[:, None], other=0).to(tl.int32)
        else:
            a = tl.load(a_base + k0, mask=rmask[:, None] & ((k0 + ks) < K)[None, :], other=0.0).to(DOT_T)
            byte = tl.load(w_base + k0 // 2, mask=cmask[:, None] & ((k0 + 2 * kb) < K)[None, :], other=0).to(tl.int32)
        lo = byte & 15
        hi = byte >> 4
        if FMT == 2:  # INT4: exact small integers; the group scale multiplies the tile's partial sum
            if HAS_ZP:
                zp = tl.load(zp_ptr + e64 * stride_se + cols.to(tl.int64) * stride_sn + k0 // GROUP,
                             mask=cmask, other=0).to(tl.int32)[:, None]
                vlo = (lo - zp).to(tl.float32)
                vhi = (hi - zp).to(tl.float32)
            else:
                vlo = (lo - ((lo & 8) << 1)).to(tl.float32)
                vhi = (hi - ((hi & 8) << 1)).to(tl.float32)
        else:
            sc = tl.load(s_base + k0 // GROUP, mask=cmask[:, None] & ((k0 // GROUP + tl.arange(0, KG)) < kgroups)[None, :],
                         other=127).to(tl.int32)
            if FMT == 0:  # E8M0: e2m1 * 2^(s - 127) in the bits, s in 2..252 where a code is nonzero (host check)
                sexp = _per_byte((sc - 1) << 23, BLOCK_N, KG, GROUP)
                vlo = _e2m1_scaled_f32(lo, sexp)
                vhi = _e2m1_scaled_f32(hi, sexp)
            else:  # UE4M3 (NVFP4): e2m1 * ue4m3, exact in FP32 (6 significant bits); the global factor waits
                f = _per_byte(_ue4m3_f32(sc), BLOCK_N, KG, GROUP)
                vlo = _e2m1_scaled_f32(lo, 126 << 23) * f
                vhi = _e2m1_scaled_f32(hi, 126 << 23) * f
        w = tl.reshape(tl.interleave(vlo.to(DOT_T), vhi.to(DOT_T)), (BLOCK_N, BLOCK_K))
        if PROMOTE:
            if SWAP_AB:
                if IEEE:
                    part = tl.dot(w, tl.trans(a), input_precision="ieee")
                else:
                    part = tl.dot(w, tl.trans(a))
            else:
                if IEEE:
                    part = tl.dot(a, tl.trans(w), input_precision="ieee")
                else:
                    part = tl.dot(a, tl.trans(w))
            if FMT == 2:
                s_n = tl.load(s_ptr + e64 * stride_se + cols.to(tl.int64) * stride_sn + k0 // GROUP, mask=cmask,
                              other=0.0)
                if SWAP_AB:
                    part = part * s_n[:, None]
                else:
                    part = part * s_n[None, :]
            if A_FP8:  # 1x128 activation scales (FP32), BLOCK_K divides 128
                s_r = tl.load(sa_ptr + rows.to(tl.int64) * stride_sam + k0 // 128, mask=rmask, other=0.0)
                if SWAP_AB:
                    part = part * s_r[None, :]
                else:
                    part = part * s_r[:, None]
            acc += part
        elif SWAP_AB:
            if IEEE:
                acc = tl.dot(w, tl.trans(a), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, tl.trans(a), acc)
        else:
            if IEEE:
                acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(w), acc)
    if FMT == 1:  # NVFP4 global decode factor g_mul / g_div, correctly rounded
        acc = tl.math.div_rn(acc * tl.load(gm_ptr + e), tl.load(gd_ptr + e))
    if SWAP_AB:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + e64 * N + cols, mask=cmask, other=0.0)[:, None]
        tl.store(d_ptr + rows[None, :].to(tl.int64) * stride_dm + cols[:, None],
                 acc.to(d_ptr.dtype.element_ty), mask=cmask[:, None] & rmask[None, :])
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + e64 * N + cols, mask=cmask, other=0.0)[None, :]
        tl.store(d_ptr + rows[:, None].to(tl.int64) * stride_dm + cols[None, :],
                 acc.to(d_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


def w4_supports(impl: str = "triton", a=None, w: W4Experts | None = None, *, a_scales=None, alignment=None,
                **_) -> tuple[bool, str]:
    """Whether ``impl`` runs these operands here, and why not (no other implementation is tried)."""
    if impl != "triton":
        return False, f"4-bit weights have only the 'triton' grouped GEMM here; got {impl!r}"
    if a is not None:
        if a.device.type == "cpu" and not triton_interpreted():
            return False, "a is a CPU tensor and TRITON_INTERPRET=1 is not set"
        if a.dtype not in (torch.bfloat16, torch.float32, torch.float8_e4m3fn):
            return False, f"activations must be bfloat16 (W4A16), float8_e4m3fn (W4A8, 1x128 FP32 scales) or float32; got {a.dtype}"
        if a.dtype == torch.float8_e4m3fn and (a_scales is None or a_scales.dtype != torch.float32):
            return False, "FP8 activations need a_scales FP32 [M, ceil(K/128)] (1x128 blocks)"
    if w is not None:
        if not isinstance(w, W4Experts):
            return False, f"weights must be fastpath.grouped_gemm_w4.W4Experts; got {type(w).__name__}"
        if a is not None and w.device != a.device:
            return False, f"weights on {w.device} but activations on {a.device}"
        if w.kind == "int4" and w.group % 16:
            return False, f"INT4 groups must be a multiple of 16 columns (one tl.dot per group); got {w.group}"
        if w.kind != "int4" and w.group not in (16, 32):
            return False, f"{w.kind} scale groups of {w.group} have no kernel (16 or 32)"
    if alignment is not None and alignment % 64 and alignment not in (16, 32):
        return False, f"the row tiles need an alignment that is a multiple of 64, or 16 or 32; got {alignment}"
    return True, "ok"


def rows_per_expert(m_sum: int, num_experts: int, alignment: int, expected_m: int | None = None) -> float:
    """The ``r`` of :class:`W4TileRule` for a contiguous layout of ``m_sum`` rows: ``expected_m`` when given
    (the caller's host count, e.g. ``ceil(M * top_k / E)``), else the least average the layout allows (each
    expert with rows pads fewer than ``alignment`` of them: ``(m_sum - E * (alignment - 1)) / E``, at least 1;
    the worst-case buffer of a capturable layer gives ``M * top_k / E`` this way). Shapes only: no host sync."""
    if expected_m is not None:
        return float(expected_m)
    return max(1.0, (m_sum - num_experts * (alignment - 1)) / max(num_experts, 1))


def _tiles_for(w: W4Experts, a: torch.Tensor, tiles: GemmTiles | None, alignment: int,
               expected_m: int | None = None) -> W4Tiles:
    if tiles is not None and tiles.tile_loop:
        raise ValueError(f"the tile-loop options of GemmTiles belong to the FP8/float grouped GEMM; the 4-bit kernel "
                         f"takes block sizes, warps, stages and swap_ab; got {tiles}")
    if tiles is None:
        r = rows_per_expert(int(a.shape[0]), w.num_experts, alignment, expected_m)
        tiles = _INTERPRETER_TILES if a.device.type == "cpu" else DEFAULT_W4_TILE_RULE.tiles(r, w.kind)
    t = tiles if isinstance(tiles, W4Tiles) else W4Tiles(tiles.block_m, tiles.block_n, tiles.block_k,
                                                          tiles.num_warps, tiles.num_stages)
    if alignment % t.block_m:
        t = replace(t, block_m=64 if alignment % 64 == 0 else 16)
    bk = t.block_k
    if w.kind == "int4":
        bk = min(bk, w.group)
        while w.group % bk:
            bk //= 2
    elif bk % w.group:
        raise ValueError(f"block_k = {bk} must be a multiple of the {w.kind} scale group ({w.group})")
    if bk < 16:
        raise ValueError(f"block_k = {bk} is below tl.dot's 16")
    return replace(t, block_k=bk)


def grouped_gemm_w4_contiguous(a: torch.Tensor, w: W4Experts, m_indices: torch.Tensor, *, impl: str = "triton",
                               a_scales=None, out_dtype=torch.bfloat16, alignment: int = 128, out=None,
                               tiles: GemmTiles | None = None, bias=None,
                               expected_m: int | None = None) -> torch.Tensor:
    """``d [M_sum, N] = a @ W[m_indices].T`` per row, ``W`` decoded from ``w`` (padding rows unspecified).

    Args:
        a: ``[M_sum, K]`` bfloat16, float8_e4m3fn with ``a_scales`` FP32 ``[M_sum, ceil(K/128)]`` (W4A8: the
            codes widened exactly to bf16, one dot per K tile, times the row's block scale in FP32), or
            float32 (IEEE FP32 dot).
        w: :class:`W4Experts` ``[E, N, K]`` on ``a``'s device.
        m_indices: int ``[M_sum]``, -1 padding; each expert's rows start on a multiple of ``alignment``.
        bias: optional float ``[E, N]``, added in FP32 before the store.
        tiles: the launch tiles; None: :data:`DEFAULT_W4_TILE_RULE` of :func:`rows_per_expert` (``expected_m``:
            the average real rows per expert, a host int, as DeepGEMM's masked ``expected_m``).
    """
    ok, why = w4_supports(impl, a, w, a_scales=a_scales, alignment=alignment)
    if not ok:
        raise ValueError(f"grouped GEMM {impl!r} with 4-bit weights cannot run: {why}")
    m, k = (int(d) for d in a.shape)
    e, n, kw = w.shape
    if kw != k:
        raise ValueError(f"a has K={k} but the weights have K={kw}")
    if m_indices.numel() != m:
        raise ValueError(f"m_indices has {m_indices.numel()} entries but a has {m} rows")
    if bias is not None and tuple(bias.shape) != (e, n):
        raise ValueError(f"bias must have shape ({e}, {n}); got {tuple(bias.shape)}")
    d = out if out is not None else torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return d
    t = _tiles_for(w, a, tiles, alignment, expected_m)
    fp8 = a.dtype == torch.float8_e4m3fn
    if fp8 and 128 % t.block_k:
        raise ValueError(f"FP8 activations need block_k dividing 128 (one activation scale a tile); got {t.block_k}")
    a = a.contiguous()
    dummy = torch.empty(1, dtype=torch.float32, device=a.device)
    sc = w.scales.contiguous()
    zp = w.zero_points.contiguous() if w.zero_points is not None else dummy
    gm = w.global_mul if w.global_mul is not None else dummy
    gd = w.global_div if w.global_div is not None else dummy
    bias_t = bias.to(torch.float32).contiguous() if bias is not None else dummy
    grid = (triton.cdiv(n, t.block_n), triton.cdiv(m, t.block_m))
    sa = a_scales.contiguous() if fp8 else dummy
    ieee = a.dtype == torch.float32 or (fp8 and a.device.type == "cpu")
    _w4_kernel[grid](a, sa, w.codes, sc, zp, gm, gd, d, m_indices.to(torch.int32).contiguous(), bias_t, m, n, k,
                     a.stride(0), sa.stride(0) if fp8 else 0, w.codes.stride(0), w.codes.stride(1), sc.stride(0),
                     sc.stride(1), d.stride(0),
                     FMT=_FMT[w.kind], GROUP=w.group, SCALE_ROWS=w.scale_rows, HAS_ZP=w.zero_points is not None,
                     A_FP8=fp8, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                     K_ITERS=triton.cdiv(k, t.block_k), EVEN_K=k % t.block_k == 0, HAS_BIAS=bias is not None,
                     IEEE=ieee, DOT_T=tl.float32 if ieee else tl.bfloat16, PROMOTE=w.kind == "int4" or fp8,
                     SWAP_AB=t.swap_ab,
                     num_warps=t.num_warps, num_stages=t.num_stages)
    return d


def grouped_gemm_w4_masked(a: torch.Tensor, w: W4Experts, masked_m: torch.Tensor, *, impl: str = "triton",
                           a_scales=None, out_dtype=torch.bfloat16, tiles: GemmTiles | None = None,
                           bias=None, expected_m: int | None = None) -> torch.Tensor:
    """DeepGEMM's masked layout: ``d[e, i] = a[e, i] @ W[e].T`` for ``i < masked_m[e]`` (rows past it
    unspecified); ``a [E, max_m, K]``, ``max_m`` a multiple of 16. The contiguous kernel over the
    ``E * max_m`` rows with each row's expert (-1 past ``masked_m``)."""
    e, max_m, k = (int(d) for d in a.shape)
    n = w.shape[1]
    pos = torch.arange(max_m, device=a.device)
    m_idx = torch.where(pos[None, :] < masked_m.to(a.device)[:, None],
                        torch.arange(e, device=a.device)[:, None], -1).reshape(-1).to(torch.int32)
    sa = None if a_scales is None else a_scales.reshape(e * max_m, -1)
    d = grouped_gemm_w4_contiguous(a.reshape(e * max_m, k), w, m_idx, impl=impl, a_scales=sa, out_dtype=out_dtype,
                                   alignment=max_m, tiles=tiles, bias=bias, expected_m=expected_m)
    return d.reshape(e, max_m, n)
