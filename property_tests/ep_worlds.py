"""The process groups the expert-parallel property suites run on: one parameter per backend and size.

``gloo-4`` (CPU processes; CI), ``nccl-2`` and ``nccl-4`` (one GPU per rank). A NCCL world needs CUDA
and as many GPUs as ranks; otherwise its tests skip, saying why. ``MOEREF_EP_BACKENDS`` (comma-separated
ids, e.g. ``nccl-2,nccl-4``) restricts the parameters, so a GPU run need not repeat the gloo examples.
Each example draws its world size 1..ranks and runs on the first ranks of the world
(:meth:`moeref.distributed.LocalWorld.run` with ``world_size=``).
"""
from __future__ import annotations

import os

import pytest

from moeref.distributed import LocalWorld

WORLDS = {"gloo-4": ("gloo", 4), "nccl-2": ("nccl", 2), "nccl-4": ("nccl", 4)}
NCCL_TIMEOUT_S = 120.0
GLOO_TIMEOUT_S = 20.0


def selected() -> list[str]:
    """The world ids to parametrise with (``MOEREF_EP_BACKENDS`` or all)."""
    chosen = os.environ.get("MOEREF_EP_BACKENDS")
    if not chosen:
        return list(WORLDS)
    ids = [c.strip() for c in chosen.split(",") if c.strip()]
    unknown = [c for c in ids if c not in WORLDS]
    if unknown:
        raise ValueError(f"MOEREF_EP_BACKENDS names {unknown}; accepted: {', '.join(WORLDS)}")
    return ids


def gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def skip_reason(world_id: str) -> str | None:
    """Why the world cannot run here (None: it can)."""
    backend, ranks = WORLDS[world_id]
    if backend == "nccl" and gpus() < ranks:
        return f"{world_id}: NCCL with {ranks} ranks needs {ranks} CUDA GPUs; this machine has {gpus()}"
    return None


def world_fixture(request):
    """Body of a module-scoped fixture parametrised with :func:`selected`: yields ``(world, ranks)``.
    The gloo world is the process-wide shared one; a NCCL world lives for the module."""
    world_id = request.param
    why = skip_reason(world_id)
    if why:
        pytest.skip(why)
    backend, ranks = WORLDS[world_id]
    if backend == "gloo":
        yield LocalWorld.shared(ranks, timeout_s=GLOO_TIMEOUT_S), ranks
        return
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (device notes)
    world = LocalWorld(ranks, backend="nccl", timeout_s=NCCL_TIMEOUT_S)
    try:
        yield world, ranks
    finally:
        world.close()
