"""Every fast path as a decode-sized call (issue 20): the cases of ``bench/bench_latency_gpu.py`` and of
the CUDA-graph capture test (``tests/test_fastpath_graph_capture_gpu.py``), and the tools both use.

A :class:`Case` makes its inputs for ``M`` tokens once (``make``), then ``fast(state)`` is the fast
path's call (what a decode step issues: ``validate=False``, no host sync) and ``torch(state)`` the same
operation in torch eager (None where the benches have none). Quantization cases come from
:func:`bench.bench_quant_gpu.kernels` (input ``M x K`` bfloat16, fused kernels ``M x 2K``); dispatch
cases route ``M`` tokens to ``top_k`` of ``E`` experts (DeepSeek-V3: 256 experts, 8 per token, hidden
7168) with torch baselines from :mod:`bench.bench_dispatch_gpu`; the capacity layouts (masked,
batched) use 32 experts so that their ``[E, max_m, K]`` buffers stay small at M = 512.

Tools: :func:`tensors` (every tensor of a result, for bit-for-bit comparison), :func:`capture` (one
call captured in a CUDA graph), :func:`record_launches` (the Triton launches one call makes) and
:func:`empty_launcher` (the floor: an empty Triton kernel launched with each launch's arguments).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

E_ROUTED, TOP_K, E_CAPACITY, HIDDEN = 256, 8, 32, 7168


@dataclass(frozen=True)
class Case:
    name: str
    group: str  # "quant" or "dispatch"
    make: Callable[[int], Any]  # M -> state
    fast: Callable[[Any], Any]  # state -> result
    torch: Callable[[Any], Any] | None  # state -> result (torch eager), or None


def quant_cases(device="cuda", K: int = HIDDEN) -> list[Case]:
    from bench.bench_quant_gpu import kernels

    out = []
    for name, (make, run, _nbytes, tfn) in kernels(device).items():
        out.append(Case(name, "quant", lambda M, make=make: make(M, K), lambda s, run=run: run(*s),
                        None if tfn is None else (lambda s, tfn=tfn: tfn(*s))))
    return out


def _routing(M: int, E: int, k: int, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.rand(M, E, generator=g, device=device).argsort(dim=1)[:, :k].int().contiguous()
    w = torch.rand(M, k, generator=g, device=device)
    return ids, w / w.sum(1, keepdim=True)


def dispatch_cases(device="cuda", K: int = HIDDEN, E: int = E_ROUTED, k: int = TOP_K,
                   E_cap: int = E_CAPACITY) -> list[Case]:
    import fastpath.dispatch as F
    from bench import bench_dispatch_gpu as B

    def routed(M, E_=E):
        ids, w = _routing(M, E_, k, device)
        x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
        return dict(M=M, ids=ids, w=w, x=x)

    def permuted(M):
        s = routed(M)
        p = F.moe_permute(s["x"], s["ids"], E, validate=False)
        s.update(y=p.hidden, inv=p.inv_permuted_idx, off=p.expert_first_token_offset)
        return s

    def contiguous(M):
        s = routed(M)
        c = F.to_contiguous(s["x"], s["ids"], E, 128, m_sum="worst_case", validate=False)
        s.update(a=c.a, src=c.src)
        return s

    bs = 64
    return [
        Case("moe_align_block_size (block 64)", "dispatch", routed,
             lambda s: F.moe_align_block_size(s["ids"], bs, E, validate=False),
             lambda s: B.eager_align(s["ids"], bs, E)),
        Case("expert_counts", "dispatch", routed, lambda s: F.expert_counts(s["ids"], E, validate=False),
             lambda s: torch.bincount(s["ids"].reshape(-1), minlength=E)),
        Case("expert_first_token_offset", "dispatch", routed,
             lambda s: F.expert_first_token_offset(s["ids"], E, validate=False), None),
        Case("moe_permute (bf16 rows)", "dispatch", routed,
             lambda s: F.moe_permute(s["x"], s["ids"], E, validate=False),
             lambda s: B.eager_permute(s["x"], s["ids"], E)),
        Case("moe_unpermute (bf16)", "dispatch", permuted,
             lambda s: F.moe_unpermute(s["y"], s["w"], s["inv"], s["off"], out_dtype=torch.bfloat16),
             lambda s: B.eager_unpermute(s["y"], s["w"], s["inv"], s["off"]).to(torch.bfloat16)),
        Case("to_contiguous (align 128, worst-case m_sum)", "dispatch", routed,
             lambda s: F.to_contiguous(s["x"], s["ids"], E, 128, m_sum="worst_case", validate=False),
             lambda s: B.eager_contiguous(s["x"], s["ids"], E, 128)),
        Case("weight_and_reduce (contiguous rows)", "dispatch", contiguous,
             lambda s: F.weight_and_reduce(s["a"], s["src"], s["w"], s["M"], validate=False), None),
        Case(f"to_masked ({E_cap} experts, max_m = M, expected_m given)", "dispatch",
             lambda M: routed(M, E_cap),
             lambda s: F.to_masked(s["x"], s["ids"], E_cap, s["M"], expected_m=max(1, s["M"] * k // E_cap),
                                   validate=False),
             lambda s: B.eager_masked(s["x"], s["ids"], E_cap, s["M"])),
        Case(f"to_batched ({E_cap} experts, M tokens per dispatcher)", "dispatch", lambda M: routed(M, E_cap),
             lambda s: F.to_batched(s["x"], s["ids"], E_cap, s["M"], 1, validate=False), None),
    ]


def all_cases(device="cuda") -> list[Case]:
    return quant_cases(device) + dispatch_cases(device)


# ----------------------------------------------------------------------------------------- tools
def tensors(result) -> list[torch.Tensor]:
    """Every tensor of a fast path's result (a tensor, a tuple/list, or a result dataclass), in order."""
    if torch.is_tensor(result):
        return [result]
    if isinstance(result, (tuple, list)):
        return [t for r in result for t in tensors(r)]
    if dataclasses.is_dataclass(result):
        return [t for f in dataclasses.fields(result) for t in tensors(getattr(result, f.name))]
    return []


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (NaN payloads and signed zeros included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def capture(fn: Callable[[], Any], *, calls: int = 1, pool=None):
    """(graph, result): ``fn`` warmed up on a side stream, then ``calls`` back-to-back calls captured in
    one CUDA graph (in the memory ``pool`` if given); ``result`` is the last call's, whose tensors
    ``graph.replay()`` rewrites."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        for _ in range(calls):
            out = fn()
    return g, out


@dataclass(frozen=True)
class Launch:
    kernel: str
    grid: tuple
    values: tuple  # the non-constexpr arguments, in parameter order
    constexprs: tuple  # the constexpr arguments' values, in parameter order
    options: dict  # launch options given (num_warps, num_stages, maxnreg, ...)


def record_launches(fn: Callable[[], Any]) -> tuple[Any, list[Launch]]:
    """Call ``fn`` once with Triton's ``JITFunction.run`` wrapped: (its result, every launch it made:
    grid, the values of the kernel's non-constexpr and constexpr parameters, the launch options).
    The fast paths' cached launcher is off meanwhile (its hits bypass ``JITFunction.run``)."""
    from triton.runtime.jit import JITFunction

    with uncached():
        return _record(fn, JITFunction)


@contextlib.contextmanager
def uncached():
    """Every fast-path launch through ``kernel[grid]`` (``fastpath._host.LAUNCH_CACHE_ON = False``)."""
    from fastpath import _host

    old = _host.LAUNCH_CACHE_ON
    _host.LAUNCH_CACHE_ON = False
    try:
        yield
    finally:
        _host.LAUNCH_CACHE_ON = old


def before_variant(case: "Case", state) -> Callable[[], Any]:
    """The call as the fast paths made it before issue 20's host changes, for an A/B in the same
    rounds: launches through ``kernel[grid]``, and for dispatch the three-kernel sort head."""
    import fastpath._dispatch_sort as D  # where the sort head is chosen

    def call():
        old = D.SMALL_SORT_CHUNKS
        D.SMALL_SORT_CHUNKS = 0
        try:
            with uncached():
                return case.fast(state)
        finally:
            D.SMALL_SORT_CHUNKS = old
    return call


def _record(fn, JITFunction):
    launches: list[Launch] = []
    orig = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if not warmup:
            names = [p.name for p in self.params]
            bound = dict(zip(names, args))
            bound.update({k_: v for k_, v in kwargs.items() if k_ in names})
            for p in self.params:
                if p.name not in bound and p.has_default:
                    bound[p.name] = p.default
            vals = tuple(bound[p.name] for p in self.params if not p.is_constexpr)
            cons = tuple(bound[p.name] for p in self.params if p.is_constexpr)
            opts = {k_: v for k_, v in kwargs.items() if k_ not in names}
            g = grid(bound) if callable(grid) else tuple(grid)
            launches.append(Launch(self.fn.__name__, tuple(int(x) for x in g), vals, cons, opts))
        return orig(self, *args, grid=grid, warmup=warmup, **kwargs)

    JITFunction.run = run
    try:
        out = fn()
    finally:
        JITFunction.run = orig
    return out, launches


_EMPTY: dict[tuple[int, int], Any] = {}


def _empty_kernel(n: int, c: int):
    """``@triton.jit def _empty(a0, .., a{n-1}, c0: tl.constexpr, .., c{c-1}: tl.constexpr): pass``
    (written to a file: Triton reads the source)."""
    if (n, c) not in _EMPTY:
        d = tempfile.mkdtemp(prefix="moeref_empty_")
        params = ", ".join([f"a{i}" for i in range(n)] + [f"c{i}: tl.constexpr" for i in range(c)])
        name = f"_empty_{n}_{c}"
        path = os.path.join(d, f"{name}.py")
        with open(path, "w") as fh:
            fh.write(f"import triton\nimport triton.language as tl\n\n\n@triton.jit\ndef {name}({params}):\n    pass\n")
        spec = importlib.util.spec_from_file_location(f"_moeref{name}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _EMPTY[(n, c)] = getattr(mod, name)
    return _EMPTY[(n, c)]


def _empty_call(l_: Launch):
    k_ = _empty_kernel(len(l_.values), len(l_.constexprs))
    kw = {f"c{i}": v for i, v in enumerate(l_.constexprs)}
    kw.update(l_.options)
    return k_, kw


def empty_launcher(launches: list[Launch]) -> Callable[[], None]:
    """The floor of a call: for each of its Triton launches, an empty Triton kernel launched through
    ``kernel[grid](...)`` on the same grid with the same arguments (same count, types and values,
    constexprs and launch options included: the same binding and specialization work)."""
    plan = [(*_empty_call(l_), l_.grid, l_.values) for l_ in launches]

    def floor():
        for k_, kw, grid, vals in plan:
            k_[grid](*vals, **kw)
    return floor


def direct_launcher(launches: list[Launch]) -> Callable[[], None]:
    """The floor through a cached launcher: each empty kernel compiled once, then launched by its
    ``CompiledKernel.run`` with the arguments (no binding, specialization or cache lookup per call):
    what a fast path with a per-shape cached launcher would pay."""
    from triton.runtime import driver

    plan = []
    for l_ in launches:
        k_, kw = _empty_call(l_)
        compiled = k_[l_.grid](*l_.values, **kw)
        plan.append((compiled, l_.grid + (1,) * (3 - len(l_.grid)), l_.values + l_.constexprs))

    def floor():
        stream = driver.active.get_current_stream(driver.active.get_current_device())
        for c, (g0, g1, g2), vals in plan:
            c.run(g0, g1, g2, stream, c.function, c.packed_metadata, None, None, None, *vals)
    return floor
