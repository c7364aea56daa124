"""Measured grouped-GEMM choices: per device, the ms of each candidate per shape bucket.

The decision rule (``decide.pick_measured``) reads a bucket's entry through the one hook of the call path,
``tuner().entry(...)``, which on a CUDA call's miss times the candidates (``decide.candidates``) within the bucket's
budget; ``te-dist tune`` does the same ahead of a run. Entries persist in a file per device, so a later process starts
warm. docs/kernels.md "Measured entries" has the bucket key, the timing, the file and the switch
(``te_dist.settings.tune``: ``TE_DIST_TUNE=0``, ``configure(enabled=False)``).

Ranks: where a run must be deterministic across ranks (``configure(deterministic=True)`` or
``torch.use_deterministic_algorithms``) no rank measures and the entries are used only once
``te_dist.distributed.agree_tuned_choices(group)`` gave every rank rank 0's (``adopt``): a collective
inside a miss could hang, since ranks of an EP group miss different buckets.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from statistics import median_low
from time import perf_counter
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import settings as _settings
from .decide import Choice, Problem, capture_underway

__all__ = ["ROUNDS", "TunerSettings", "Tuner", "CudaClock", "bucket_rows", "bucket_key", "key_text", "parse_key",
           "choice_name", "parse_choice", "time_runs", "tuner", "configure", "reset"]

FILE_VERSION = 2
ROUNDS = 5
SAMPLE_MS, MAX_CALLS = 0.5, 10  # a sample makes about this much GPU work, in 1..MAX_CALLS calls
Key = tuple


@dataclass
class TunerSettings:
    """How a tuner measures (``configure`` sets them); whether it measures at all is the switchboard's
    ``te_dist.settings.tune``."""

    deterministic: bool = False
    bucket_ms: float = 50.0
    total_ms: float = 2000.0
    persist: bool = True
    directory: Optional[Path] = None  # default: <kernel cache dir>/autotune


def choice_name(choice: Choice) -> str:
    return choice[0] if choice[1] is None else f"{choice[0]}:{choice[1]}"


def parse_choice(name: str) -> Choice:
    backend, _, config = name.partition(":")
    if backend not in ("cutlass", "torch", "loop") or (config and not config.isdigit()):
        raise ValueError(f"not a grouped-GEMM choice: {name!r}")
    return backend, (int(config) if config else None)


def bucket_rows(num_rows: int, num_groups: int) -> int:
    """Average rows per expert rounded up to a power of two (0 when there are none)."""
    m = -(-num_rows // max(num_groups, 1))
    return 0 if m <= 0 else 1 << (m - 1).bit_length()


def bucket_key(p: Problem, group_sizes=None) -> Key:
    ragged = group_sizes is not None and len(group_sizes) > 1 and group_sizes.count(group_sizes[0]) != len(group_sizes)
    return (p.direction, p.dtype, p.out_dtype, p.num_groups, p.k, p.n, bucket_rows(p.num_rows, p.num_groups), ragged,
            group_sizes is not None, p.epilogue)


def key_text(key: Key) -> str:
    """A key as the file stores it: ``fwd|bfloat16|bfloat16|E8|K4096|N14336|m256|ragged|host|plain``."""
    d, dt, odt, e, k, n, m, ragged, host, epilogue = key
    name = lambda t: str(t).replace("torch.", "")  # noqa: E731
    return (f"{d}|{name(dt)}|{name(odt)}|E{e}|K{k}|N{n}|m{m}|{'ragged' if ragged else 'even'}|"
            f"{'host' if host else 'device'}|{'epilogue' if epilogue else 'plain'}")


def parse_key(text: str) -> Key:
    d, dt, odt, e, k, n, m, ragged, host, epilogue = text.split("|")
    dtype = lambda s: getattr(torch, s) if isinstance(getattr(torch, s, None), torch.dtype) else None  # noqa: E731
    if (d not in ("fwd", "dgrad", "wgrad") or dtype(dt) is None or dtype(odt) is None or ragged not in ("ragged", "even")
            or host not in ("host", "device") or epilogue not in ("epilogue", "plain")):
        raise ValueError(f"not a bucket key: {text!r}")
    return (d, dtype(dt), dtype(odt), int(e[1:]), int(k[1:]), int(n[1:]), int(m[1:]), ragged == "ragged",
            host == "host", epilogue == "epilogue")


class CudaClock:
    """Samples queued on the current stream between two events (``sample``), read later (``read``)."""

    def sample(self, fn: Callable[[], object], calls: int):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        return start, end, calls

    def read(self, handle) -> float:
        start, end, calls = handle
        end.synchronize()
        return start.elapsed_time(end) / calls


class _CallClock:
    """A clock over ``timer(fn, calls) -> ms per call``, which times at once (tests)."""

    def __init__(self, timer):
        self.sample, self.read = timer, lambda ms: ms


def time_runs(runs: Sequence[Tuple[Choice, Callable[[], object]]], clock, budget_ms: float) -> Dict[Choice, float]:
    """{choice: median ms per call} of the runs timed within ``budget_ms`` of wall time (module doc).
    A run that raises is left out."""
    t0 = perf_counter()
    if budget_ms <= 0:
        return {}
    live = []
    for choice, fn in runs:
        try:
            fn()  # untimed: a first call's one-off costs are not the kernel's
            live.append((choice, fn))
        except Exception:  # noqa: BLE001 - a candidate that fails on this shape cannot win
            pass
    if not live:
        return {}
    probe = clock.read(clock.sample(live[0][1], 1))
    calls = max(1, min(MAX_CALLS, int(SAMPLE_MS / max(probe, 1e-6))))
    samples: Dict[Choice, List[float]] = {c: [] for c, _ in live}
    samples[live[0][0]].append(probe)
    for rnd in range(ROUNDS):
        planned = sum(calls * (median_low(s) if s else probe) for s in samples.values())
        if (perf_counter() - t0) * 1e3 + planned > budget_ms:
            break
        order = live[rnd % len(live):] + live[:rnd % len(live)]
        handles = [(c, clock.sample(fn, calls)) for c, fn in order]
        for c, h in handles:
            samples[c].append(clock.read(h))
    return {c: median_low(s) for c, s in samples.items() if s}


class _Table:
    """One device's entries: key -> {choice: ms}; ``path`` None keeps them in memory."""

    def __init__(self, path: Optional[Path]):
        self.path, self.ms, self.stamp = path, {}, None

    def entries(self) -> dict:
        return {key_text(k): {choice_name(c): round(v, 6) for c, v in ms.items()} for k, ms in self.ms.items() if ms}

    def merge(self, entries: dict) -> None:
        """Add a file's entries (all parsed before any is taken: a bad entry takes nothing)."""
        parsed = {parse_key(t): {parse_choice(n): float(v) for n, v in e.items()} for t, e in entries.items()}
        for key, ms in parsed.items():
            self.ms.setdefault(key, ms)


class Tuner:
    """Owner of one process's measured entries, settings and budget (``tuner()``). ``timer``,
    ``identity(device_index) -> (name, SM count)`` and ``file_tag`` are injectable for CPU tests."""

    def __init__(self, settings: Optional[TunerSettings] = None, *, timer=None, identity=None,
                 file_tag: Optional[str] = None):
        self.settings = settings or TunerSettings()
        self.clock = CudaClock() if timer is None else _CallClock(timer)
        self._identity = identity or _cuda_identity
        self._file_tag = file_tag
        self._by_index: Dict[int, _Table] = {}
        self._by_identity: Dict[Tuple[str, int], _Table] = {}
        self.spent_ms = 0.0
        self.agreed = False  # set by adopt: every rank holds rank 0's entries
        self._lock = threading.Lock()
        self._warned: set = set()
        self.runners: Dict[tuple, Callable] = {}  # the call path's memo (entry._runner); emptied with the tables

    def remember(self, key, run: Callable) -> Callable:
        """``run``, kept under ``key`` (None: not) in the call path's memo; past 4096 entries it starts over."""
        if key is not None:
            self.runners = self.runners if len(self.runners) < 4096 else {}
            self.runners[key] = run
        return run

    @property
    def enabled(self) -> bool:
        """Measuring is on (``te_dist.settings.tune``)."""
        return _settings.current().tune

    def deterministic(self) -> bool:
        return self.settings.deterministic or torch.are_deterministic_algorithms_enabled()

    def entry(self, p: Problem, device_index: int, group_sizes, runs: Optional[Callable[[], list]] = None
              ) -> Optional[dict]:
        """The bucket's {choice: ms}, measured now on a miss where allowed (``runs()`` builds the candidates' (choice,
        zero-argument call) pairs; None: never measure); None where there is none to use."""
        table = self._by_index.get(device_index) or self.table_for(device_index)
        key = bucket_key(p, group_sizes)
        ms = table.ms.get(key)
        if ms is None and runs is not None:
            ms = self._miss(p, key, table, runs)
        if not ms or (not self.agreed and self.deterministic()):
            return None
        return ms

    def _miss(self, p: Problem, key: Key, table: _Table, runs) -> Optional[dict]:
        if self.deterministic() or self.spent_ms >= self.settings.total_ms or p.capturing or capture_underway():
            return None
        started = perf_counter()
        pairs = runs()
        if len(pairs) < 2:  # nothing to choose between: remembered, so later calls skip this work
            table.ms[key] = {}
            return None
        if table.path is None:
            return self._measure(table, key, pairs, started)
        cache = _kernels().cache
        try:
            with cache.try_locked(table.path) as mine:
                self._reload(table)  # another rank of the node may have measured it meanwhile
                if key in table.ms or not mine:  # not mine: that rank measures now; the static rule for this call
                    return table.ms.get(key)
                ms = self._measure(table, key, pairs, started)
                self._save(table, cache)
                return ms
        except OSError as exc:  # no lock file (read-only or missing directory): keep the entries in memory
            self._warn(table.path, f"te_dist autotune: cannot use {table.path} ({exc}); choices stay in memory")
            table.path = None
            return table.ms.get(key) or self._measure(table, key, pairs, started)

    def _measure(self, table: _Table, key: Key, pairs, started: float) -> dict:
        budget = min(self.settings.bucket_ms, self.settings.total_ms - self.spent_ms)
        ms = time_runs(pairs, self.clock, budget - (perf_counter() - started) * 1e3)
        self.spent_ms += (perf_counter() - started) * 1e3
        table.ms[key] = ms if len(ms) > 1 else {}  # one candidate timed compares nothing: the static rule
        return table.ms[key]

    # ------------------------------------------------------------------ tables and files

    def table_for(self, device_index: int) -> _Table:
        with self._lock:
            table = self._by_index.get(device_index)
            if table is None:
                ident = self._identity(device_index)
                table = self._by_identity.get(ident)
                if table is None:
                    table = self._by_identity[ident] = _Table(self._path(ident))
                    self._reload(table)
                self._by_index[device_index] = table
            return table

    def _path(self, ident: Tuple[str, int]) -> Optional[Path]:
        if not self.settings.persist:
            return None
        directory = self.settings.directory or _kernels().build.cache_dir() / "autotune"
        tag = self._file_tag if self._file_tag is not None else _versions_tag()
        digest = hashlib.sha256(f"{ident[0]}\0{ident[1]}\0{tag}".encode()).hexdigest()[:16]
        slug = "".join(ch if ch.isalnum() else "_" for ch in ident[0]).strip("_") or "device"
        return Path(directory) / f"{slug}-sm{ident[1]}-{digest}.json"

    def _reload(self, table: _Table) -> None:
        """Merge the file's entries when it changed since last read; a bad file is warned about and ignored."""
        try:
            st = table.path.stat() if table.path is not None else None
        except OSError:
            return
        if st is None or (st.st_mtime_ns, st.st_size) == table.stamp:
            return
        table.stamp = (st.st_mtime_ns, st.st_size)
        try:
            data = json.loads(table.path.read_text())
            if data.get("version") != FILE_VERSION:
                raise ValueError(f"version {data.get('version')!r}, expected {FILE_VERSION}")
            table.merge(data["entries"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            self._warn(table.path, f"te_dist autotune: ignoring the unreadable tuning file {table.path} ({exc}); "
                                   "it is rewritten at the next measurement")

    def _save(self, table: _Table, cache) -> None:
        text = json.dumps({"entries": table.entries(), "torch": torch.__version__, "version": FILE_VERSION},
                          sort_keys=True, separators=(",", ":"))
        try:
            cache.write_atomic(table.path, text.encode())
            st = table.path.stat()
            table.stamp = (st.st_mtime_ns, st.st_size)
        except OSError as exc:
            self._warn(table.path, f"te_dist autotune: cannot write {table.path} ({exc}); choices stay in memory")

    def save(self, device_index: int) -> Optional[Path]:
        """Write the device's table now, merged with the file (the tune CLI); its path, or None."""
        table = self.table_for(device_index)
        if table.path is None:
            return None
        cache = _kernels().cache
        with cache.try_locked(table.path) as mine:
            if mine:
                self._reload(table)
                self._save(table, cache)
        return table.path

    def _warn(self, path, message: str) -> None:
        if path not in self._warned:
            self._warned.add(path)
            warnings.warn(message, stacklevel=4)

    # ------------------------------------------------------------------ across ranks

    def export(self) -> dict:
        """Every table as {"<name>|sm<count>": entries} (what agree_tuned_choices sends)."""
        return {f"{name}|sm{sms}": t.entries() for (name, sms), t in sorted(self._by_identity.items())}

    def adopt(self, exported: dict) -> None:
        """Replace the in-memory entries by ``exported`` (rank 0's) and mark them agreed."""
        tables = {}
        for ident_text, entries in exported.items():
            name, _, sms = ident_text.rpartition("|sm")
            tables[(name, int(sms))] = table = _Table(None)
            table.merge(entries)
        with self._lock:
            for ident, table in self._by_identity.items():  # keep the paths, replace the entries
                table.ms = tables.pop(ident).ms if ident in tables else {}
            self._by_identity.update(tables)
            self.agreed, self.runners = True, {}


def _kernels():
    from .cutlass_backend import kernels_module  # the kernel cache's lock, atomic writer and directory

    return kernels_module()


def _cuda_identity(index: int) -> Tuple[str, int]:
    props = torch.cuda.get_device_properties(index)
    return props.name, props.multi_processor_count


@functools.lru_cache(maxsize=None)
def _versions_tag() -> str:
    """torch version + a digest of the kernel sources and tiles (a change of either starts a new file)."""
    ck = _kernels()
    cut = ck.find_cutlass()
    h = hashlib.sha256(ck.build.SOURCE.read_bytes())
    h.update(repr(sorted(ck.heuristics.CONFIGS.items())).encode())
    h.update(str(cut[2] if cut else "no-cutlass").encode())
    return f"torch {torch.__version__} kernels {h.hexdigest()[:16]}"


_TUNER: Dict[str, Tuner] = {}


def tuner() -> Tuner:
    return _TUNER.get("t") or reset()


def configure(*, enabled: Optional[bool] = None, deterministic: Optional[bool] = None,
              bucket_ms: Optional[float] = None, total_ms: Optional[float] = None, persist: Optional[bool] = None,
              directory=None) -> TunerSettings:
    """Change the process's tuner settings; returns them. ``enabled`` sets ``te_dist.settings.tune``
    for the rest of the process (``te_dist.settings.override(tune=...)`` sets it for a while)."""
    flags, budgets = dict(deterministic=deterministic, persist=persist), dict(bucket_ms=bucket_ms, total_ms=total_ms)
    for name, value in dict(enabled=enabled, **flags).items():
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, received {value!r}")
    for name, value in budgets.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise ValueError(f"{name} must be a non-negative number of milliseconds, received {value!r}")
    t = tuner()
    s = t.settings
    if enabled is not None:
        _settings.set_for_process(tune=enabled)
    for name, value in {**flags, **budgets}.items():
        if value is not None:
            setattr(s, name, float(value) if name in budgets else value)
    if directory is not None:
        s.directory = Path(directory)
        t._by_index.clear()
        t._by_identity.clear()
        t.runners = {}
    return s


def reset(new: Optional[Tuner] = None) -> Tuner:
    """Start over with fresh tuner settings, budget and tables (or install ``new``, for tests);
    ``te_dist.settings.tune`` stays as it is."""
    _TUNER["t"] = new or Tuner()
    return _TUNER["t"]
