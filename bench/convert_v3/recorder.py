"""The DeepSeek-V3-sized conversion's record: the run's JSON and its progress lines (:class:`Recorder`), rewritten
after every stage, every shard and every heartbeat, so that a run stopped from outside still says where its time
went."""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager

class Recorder:
    """The run's JSON (``res``) and its progress lines on stdout: the JSON is rewritten (a temporary file, then
    renamed: a reader never sees half of it) after every stage, after every shard of a conversion, and every
    ``heartbeat`` seconds while a stage runs (with the stage times gathered so far), so that a run stopped from
    outside (a time limit) still says where its time went. ``res["current"]`` is the layer in progress, moved to
    ``res["layers"]`` when it is complete."""

    def __init__(self, path: str | None, res: dict, heartbeat: float = 10.0):
        import threading

        self.path, self.res, self.t0 = path, res, time.perf_counter()
        self._lock = threading.Lock()
        self._live = None  # (stage name, StageTimes or None, key in current, start)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(heartbeat,), name="convert-v3-heartbeat",
                                        daemon=True)
        self._thread.start()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def save(self) -> None:
        if self.path is None:
            return
        with self._lock:
            self.res["elapsed_seconds"] = round(self.elapsed(), 3)
            text = json.dumps(self.res, indent=1)
            tmp = self.path + ".partial"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, self.path)

    def start_layer(self, layer: int) -> dict:
        row = {"layer": layer, "stages": {}}
        self.res["current"] = row
        return row

    def _snapshot(self, times, key) -> None:
        cur = self.res.get("current")
        if times is not None and key and cur is not None:
            cur[key] = times.as_json()

    def note(self, line: str, times=None, key: str | None = None) -> None:
        """Print ``line`` (with the run's elapsed time) and rewrite the JSON, ``times`` (a StageTimes) stored under
        ``current[key]`` first."""
        self._snapshot(times, key)
        print(f"[{self.elapsed():6.1f} s] {line}", flush=True)
        self.save()

    @contextmanager
    def stage(self, name: str, times=None, key: str | None = None):
        """Time the block as stage ``name`` of the current layer (``current["stages"][name]``), its StageTimes
        ``times`` stored under ``current[key]``; a progress line and the JSON after it, and every heartbeat
        while it runs."""
        cur = self.res.get("current")
        t0 = time.perf_counter()
        self._live = (name, times, key, t0)
        try:
            yield
        finally:
            self._live = None
            dt = time.perf_counter() - t0
            if cur is not None:
                cur["stages"][name] = round(dt, 4)
            self.note(f"  layer {cur['layer'] if cur else '-'}: {name} {dt:.2f} s" + _top(times), times, key)

    def _beat(self, every: float) -> None:
        while not self._stop.wait(every):
            live = self._live
            if live is None:
                continue
            name, times, key, t0 = live
            try:
                self.note(f"  ... {name} running for {time.perf_counter() - t0:.0f} s" + _top(times), times, key)
            except (OSError, ValueError, RuntimeError):  # a heartbeat never stops the run
                pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _top(times, n: int = 6) -> str:
    """``"; read 1.2 s, quantize 0.8 s, ..."``: the ``n`` longest stages of a StageTimes so far."""
    if times is None:
        return ""
    sec = times.as_json()["seconds"]
    if not sec:
        return ""
    return "; " + ", ".join(f"{k} {v:.2f} s" for k, v in sorted(sec.items(), key=lambda kv: -kv[1])[:n])
