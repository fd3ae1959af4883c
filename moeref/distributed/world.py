"""A persistent group of local worker processes for running EP code without torchrun (tests, notebooks).

:class:`LocalWorld` spawns ``world_size`` processes once, joins them in a torch.distributed group
(gloo on CPU by default) and then runs any number of tasks on them: ``world.run(fn, *args)`` calls
``fn(group, *args)`` on every rank (``group``: an :class:`~moeref.distributed.EPGroup`) and returns
the per-rank results, rank order. The expensive part (process start, ``import torch``, rendezvous)
is paid once, so a property test can run many Hypothesis examples in one process group.

``world_size=w`` on a call runs on ranks ``0..w-1`` only, in a subgroup made at start-up
(``new_group(range(w))``), so one world serves every smaller world size.

Failures are reported with the rank: an exception on a rank becomes :class:`RankError` (rank,
type, message and the remote traceback), a worker that exits or does not answer within the call's
timeout becomes :class:`RankError` too, and the world is then closed (it cannot be trusted).

``fn`` and its arguments must be picklable (module-level functions), as for any ``spawn``.
"""
from __future__ import annotations

import atexit
import os
import tempfile
import time
import traceback
from dataclasses import dataclass

from .._checks import check_choice, check_positive_int

__all__ = ["LocalWorld", "RankError"]


_SHARED: dict = {}


def _close_shared() -> None:
    for world in _SHARED.values():
        world.close()
    _SHARED.clear()


class RankError(RuntimeError):
    """A task failed on some ranks: ``failures`` maps rank -> (exception type name, message, traceback)."""

    def __init__(self, failures: dict):
        self.failures = dict(failures)
        lines = [f"rank {r}: {t}: {m}" for r, (t, m, _) in sorted(self.failures.items())]
        super().__init__("; ".join(lines))


@dataclass(frozen=True)
class _Failure:
    type_name: str
    message: str
    traceback: str
    exception: object = None


def _worker(rank: int, world_size: int, init_file: str, backend: str, timeout_s: float, conn) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import datetime

    import torch
    import torch.distributed as dist

    from ..gemm.exact import set_num_threads
    from .group import ep_group

    torch.set_num_threads(1)
    set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    td = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=td)
    groups = {world_size: ep_group(None, timeout_s=timeout_s)}
    for w in range(1, world_size):
        pg = dist.new_group(list(range(w)), timeout=td)
        if rank < w:
            groups[w] = ep_group(pg, timeout_s=timeout_s)
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        fn, args, kwargs, w = msg
        if rank >= w:
            conn.send(("ok", None))
            continue
        try:
            conn.send(("ok", fn(groups[w], *args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - reported to the parent with the rank
            try:
                import pickle

                pickle.dumps(e)
                exc = e
            except Exception:
                exc = None
            conn.send(("error", _Failure(type(e).__name__, str(e), traceback.format_exc(), exc)))
    try:
        dist.destroy_process_group()
    except Exception:  # pragma: no cover - best effort at shutdown
        pass
    conn.close()
    os._exit(0)  # skip the interpreter's teardown of torch (seconds per process on a busy machine)


class LocalWorld:
    """``world_size`` local processes in one process group (module docstring).

    Args:
        world_size: number of processes (ranks).
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank).
        timeout_s: the process group's collective timeout (a collective a peer never joins fails
            after this long: :class:`~moeref.distributed.EPTimeoutError`).
        start_timeout_s: how long start-up may take.
    """

    def __init__(self, world_size: int, *, backend: str = "gloo", timeout_s: float = 60.0,
                 start_timeout_s: float = 120.0):
        import multiprocessing as mp

        self.world_size = check_positive_int(world_size, "world_size")
        self.backend = check_choice(backend, ("gloo", "nccl"), "backend")
        self.timeout_s = float(timeout_s)
        fd, self._init_file = tempfile.mkstemp(prefix="moeref_ep_")
        os.close(fd)
        os.unlink(self._init_file)  # FileStore creates it
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        for r in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, self.world_size, self._init_file, backend, self.timeout_s, child),
                            daemon=True, name=f"moeref-ep-rank{r}")
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        self._closed = False
        self._collect(start_timeout_s, "start-up")

    def _collect(self, timeout_s: float, what: str) -> list:
        deadline = time.monotonic() + timeout_s
        results, failures = [None] * self.world_size, {}
        for r, (conn, proc) in enumerate(zip(self._conns, self._procs)):
            while True:
                if conn.poll(min(0.2, max(deadline - time.monotonic(), 0))):
                    try:
                        status, value = conn.recv()
                    except EOFError:
                        status, value = "dead", None
                    break
                if not proc.is_alive():
                    status, value = "dead", None
                    break
                if time.monotonic() >= deadline:
                    status, value = "timeout", None
                    break
            if status == "ok" or status == "ready":
                results[r] = value
            elif status == "error":
                failures[r] = value
            elif status == "dead":
                proc.join(1.0)
                failures[r] = _Failure("ProcessExit", f"worker exited (exit code {proc.exitcode}) during {what}", "")
            else:
                failures[r] = _Failure("TimeoutError", f"no answer within {timeout_s:g} s during {what}", "")
        if any(f.type_name in ("ProcessExit", "TimeoutError") for f in failures.values()):
            self.close(force=True)
        if failures:
            err = RankError({r: (f.type_name, f.message, f.traceback) for r, f in failures.items()})
            err.exceptions = {r: f.exception for r, f in failures.items()}
            raise err
        return results

    def run(self, fn, *args, world_size: int | None = None, timeout_s: float | None = None, **kwargs) -> list:
        """``fn(group, *args, **kwargs)`` on ranks ``0..world_size-1`` (default: all); per-rank results
        (None for ranks outside). Raises :class:`RankError` naming every failing rank; its
        ``exceptions`` maps rank -> the original exception where it could be pickled."""
        if self._closed:
            raise RuntimeError("this LocalWorld is closed (a worker died or timed out, or close() was called)")
        w = self.world_size if world_size is None else check_positive_int(world_size, "world_size")
        if w > self.world_size:
            raise ValueError(f"world_size={w} is larger than this LocalWorld ({self.world_size} ranks)")
        for conn in self._conns:
            conn.send((fn, args, kwargs, w))
        limit = 2 * self.timeout_s + 30.0 if timeout_s is None else float(timeout_s)
        return self._collect(limit, f"{getattr(fn, '__name__', 'task')}")[:w]

    def close(self, force: bool = False) -> None:
        """Stop the workers (``force``: terminate without asking)."""
        if self._closed:
            return
        self._closed = True
        for conn, proc in zip(self._conns, self._procs):
            if not force and proc.is_alive():
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for proc in self._procs:
            proc.join(0.1 if force else 10.0)
            if proc.is_alive():
                proc.terminate()
                proc.join(5.0)
        for conn in self._conns:
            conn.close()
        if os.path.exists(self._init_file):
            os.unlink(self._init_file)

    @classmethod
    def shared(cls, world_size: int, *, backend: str = "gloo", timeout_s: float = 60.0) -> "LocalWorld":
        """A process-wide world of these parameters, started on first use, reused by later calls (so
        several test modules in one process pay the start-up once), restarted if it was closed, and
        closed when the interpreter exits."""
        key = (int(world_size), backend, float(timeout_s))
        world = _SHARED.get(key)
        if world is None or world._closed:
            world = _SHARED[key] = cls(world_size, backend=backend, timeout_s=timeout_s)
            if len(_SHARED) == 1:
                atexit.register(_close_shared)
        return world

    def __enter__(self) -> "LocalWorld":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close(force=True)
        except Exception:
            pass
