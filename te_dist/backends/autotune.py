"""Measured grouped-GEMM choices: the first call of a shape bucket times the candidates, the fastest is kept.

Why: the static table (``selection.py`` for the backend, ``cutlass_kernels/heuristics.py`` for the
tile) was fitted to the shapes it was swept on; on other shapes it can lose to ``torch._grouped_mm``.
Timing the few candidates once per bucket costs milliseconds and then holds for the whole run,
and the answer is never slower than torch's kernel on the GPU it was measured on (torch is a
candidate wherever it can run).

Flow of one CUDA call (``choose``; forced backends and CPU calls never get here)::

    TE_DIST_TUNE=0 (read when the tuner is made) or configure(enabled=False) -> None: the static table
    key = bucket_key(...) in the device's table         -> the first allowed choice of its ranking
    miss, measuring allowed (not capturing, not deterministic, budget left, the file's lock free)
        -> reload the file (another rank of the node may have measured it), else time every
           candidate on the caller's stream (each writes a fresh output: the caller's tensors
           are only read), keep the ranking, write the file atomically; what that left
           undecided is settled on the bucket's next calls (``live_settling``: the call is run
           through the returned ``Settling``), then the file is written again
    otherwise                                           -> None: the static table decides

Bucket key: direction, dtype, out dtype, E, K and N exactly, the rows per expert rounded up to a
power of two, whether the host sizes are unequal (ragged), whether they were given at all (the
loop needs them), plus the device (name and SM count) through the table the key is looked up in.

Budget: at most ``bucket_ms`` per bucket (past it only by the first candidate's probe; the first call
gets ``1 - LIVE_SHARE`` of it where live settling is on, its live calls the rest, as regret) and
``total_ms`` per process; once spent, misses take the static table. Charged: the wall time from the
miss to the timing (building the runners, reading the file, the loop's first call), then the larger of
every call made (timed, warm-up or heat) at its measured ms plus the sleeps queued between rounds, and
the wall time; no round starts once the wall time since the miss plus that round plus what followed
the measurement (ranking, file write: ``save_ms``, the slowest of the last 32) would pass the bucket
(``bucket_timing.measure``). The loop is a candidate only where its first call's library plans are
predicted to fit in a quarter of the bucket (``LoopPlans``).

Persistence: one JSON file per (device, SM count, torch version, kernel sources) in
``<kernel cache>/autotune/`` (``$TE_DIST_CACHE``), written whole or not at all (temp file, fsync,
rename) under the kernel cache's per-key lock; a torn or foreign file is ignored with a warning.

Ranks: where a run must be deterministic across ranks (``configure(deterministic=True)`` or
``torch.use_deterministic_algorithms``) no rank measures on its own and the table is used only
after ``te_dist.distributed.agree_tuned_choices(group)`` gave every rank rank 0's entries. A
collective inside a miss could hang: ranks of an EP group see different rows per expert, so
different buckets miss on different ranks.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Tuple

import torch

from .bucket_timing import Budget, CudaClock, as_clock, measure
from .live_settling import Ratios, Settling, undecided
from .loop_plans import LoopPlans
from .selection import Problem, why_not

__all__ = [
    "ENV",
    "Choice",
    "LIVE_SHARE",
    "Settings",
    "Settling",
    "MissContext",
    "Autotuner",
    "bucket_rows",
    "bucket_key",
    "key_text",
    "parse_key",
    "choice_name",
    "parse_choice",
    "allowed",
    "candidates",
    "choose",
    "configure",
    "reset",
    "tuner",
]

ENV = "TE_DIST_TUNE"  # "0" turns measured choices off (the static table decides every call)
FILE_VERSION = 1
# Misses over which the slowest post-measurement time (ranking, file write) stays reserved: the write
# took 0.1-0.7 ms on the H200 host, with stalls of 2-2.7 ms in 5 of 288 (the sweep of 2026-12-03).
SAVE_WINDOW = 32
# Of a bucket's budget, what its first call leaves to live settling (``live_settling``): a bucket whose
# first call cannot decide goes on timing its undecided candidates on the run's next calls, where a
# sample costs only its excess over the fastest.
LIVE_SHARE = 0.3
Choice = Tuple[str, Optional[int]]  # (backend, CUTLASS tile config or None)
Key = tuple  # (direction, dtype, out_dtype, E, K, N, rows bucket, ragged, host sizes)
LOOP: Choice = ("loop", None)


@dataclass
class Settings:
    """What ``configure`` sets; ``enabled`` also needs ``TE_DIST_TUNE`` unset or not "0"."""

    enabled: bool = True
    deterministic: bool = False
    bucket_ms: float = 50.0
    total_ms: float = 2000.0
    persist: bool = True
    directory: Optional[Path] = None  # default: <kernel cache dir>/autotune
    settle_live: bool = True  # a bucket the first call could not decide is settled on its next calls


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


_last_ragged = (None, False)  # (the last sizes tuple, its answer): one entry, replaced whole


def _ragged(group_sizes) -> bool:
    """Not all group sizes equal. The six GEMMs of one MLP step ask for the same sizes tuple, so its
    answer is kept (by identity: a tuple cannot change); the scan of 64 sizes costs ~0.5 µs."""
    global _last_ragged
    if group_sizes is None:
        return False
    last = _last_ragged
    if last[0] is group_sizes:
        return last[1]
    ragged = len(group_sizes) > 1 and group_sizes.count(group_sizes[0]) != len(group_sizes)
    if isinstance(group_sizes, tuple):
        _last_ragged = (group_sizes, ragged)
    return ragged


def bucket_key(p: Problem, group_sizes=None) -> Key:
    """The bucket of one call (``p.k``/``p.n``: the contraction and output columns, as selection sees them)."""
    return (p.direction, p.dtype, p.out_dtype, p.num_groups, p.k, p.n, bucket_rows(p.num_rows, p.num_groups),
            _ragged(group_sizes), group_sizes is not None)


def key_text(key: Key) -> str:
    """A key as the file stores it: ``fwd|bfloat16|bfloat16|E8|K4096|N14336|m256|ragged|host``."""
    d, dt, odt, e, k, n, m, ragged, host = key
    name = lambda t: str(t).replace("torch.", "")  # noqa: E731
    return (f"{d}|{name(dt)}|{name(odt)}|E{e}|K{k}|N{n}|m{m}|{'ragged' if ragged else 'even'}|"
            f"{'host' if host else 'device'}")


def parse_key(text: str) -> Key:
    d, dt, odt, e, k, n, m, ragged, host = text.split("|")
    dtype = lambda s: getattr(torch, s) if isinstance(getattr(torch, s, None), torch.dtype) else None  # noqa: E731
    if d not in ("fwd", "dgrad", "wgrad") or dtype(dt) is None or dtype(odt) is None or ragged not in ("ragged", "even"):
        raise ValueError(f"not a bucket key: {text!r}")
    return (d, dtype(dt), dtype(odt), int(e[1:]), int(k[1:]), int(n[1:]), int(m[1:]), ragged == "ragged", host == "host")


def allowed(choice: Choice, p: Problem) -> bool:
    """A stored choice that this call may not use: the loop while capturing a CUDA graph."""
    return not (choice[0] == "loop" and (p.capturing or not p.sizes_on_host))


def candidates(p: Problem, static: Choice, *, cutlass_ok: bool, torch_ok: bool, group_sizes=None,
               built: Callable[[int], bool] = lambda config: False, configs: Iterable[int] = (),
               loop_ok: bool = True) -> List[Choice]:
    """What to time, in order: the static choice, torch, the other built tiles, the loop (host
    sizes given, not capturing: it would read the offsets otherwise, and ``loop_ok``: its first call
    fits the bucket, ``LoopPlans``)."""
    out = [static]
    if why_not("torch", p, cutlass_built=cutlass_ok, torch_grouped=torch_ok) is None:
        out.append(("torch", None))
    if why_not("cutlass", p, cutlass_built=cutlass_ok, torch_grouped=torch_ok) is None:
        out += [("cutlass", c) for c in configs if built(c)]
    if group_sizes is not None and not p.capturing and loop_ok:
        out.append(LOOP)
    return list(dict.fromkeys(out))  # the static choice is listed once



class MissContext(NamedTuple):
    """What a miss needs from the caller: the static choice, a runner per candidate
    (``run(choice)`` -> a no-argument callable making one call), and what can run."""

    static: Choice
    run: Callable[[Choice], Callable[[], object]]
    cutlass_ok: bool
    torch_ok: bool
    configs: Tuple[int, ...] = ()
    built: Callable[[int], bool] = lambda config: False


class _Table:
    """The choices of one device identity: key -> ranking (fastest first) and the measured ms."""

    def __init__(self, path: Optional[Path]):
        self.path = path
        self.ranking: Dict[Key, Tuple[Choice, ...]] = {}
        self.ms: Dict[Key, Dict[str, float]] = {}
        self.settling: Dict[Key, Settling] = {}  # buckets whose next calls time their undecided candidates
        self.file_stamp = None  # (mtime_ns, size) of the file last read
        self._encoded: Dict[Key, Tuple[tuple, dict, str]] = {}  # key -> (ranking, ms, its JSON text)

    def put(self, key: Key, timings: Dict[Choice, float]) -> None:
        self.ranking[key] = tuple(sorted(timings, key=timings.get))
        self.ms[key] = {choice_name(c): round(ms, 6) for c, ms in timings.items()}

    def to_entries(self) -> dict:
        return {key_text(k): {"ranking": [choice_name(c) for c in r], "ms": self.ms.get(k, {})}
                for k, r in self.ranking.items() if r}

    def entries_json(self) -> str:
        """:meth:`to_entries` as compact JSON text. The file is rewritten on every miss, inside the
        bucket's 50 ms, so each entry is encoded once and its text reused while its ranking and ms
        are unchanged (compared by value: whoever replaced them, the text follows)."""
        parts = []
        for key, ranking in self.ranking.items():
            if not ranking:
                continue
            ms = self.ms.get(key, {})
            done = self._encoded.get(key)
            if done is None or done[0] != ranking or done[1] != ms:
                entry = {"ms": ms, "ranking": [choice_name(c) for c in ranking]}
                text = f"{json.dumps(key_text(key))}:{json.dumps(entry, separators=(',', ':'), sort_keys=True)}"
                done = self._encoded[key] = (ranking, dict(ms), text)
            parts.append(done[2])
        parts.sort()
        return "{" + ",".join(parts) + "}"

    def merge_entries(self, entries: dict) -> None:
        for text, entry in entries.items():
            key = parse_key(text)
            self.ranking[key] = tuple(parse_choice(n) for n in entry["ranking"])
            self.ms[key] = {str(n): float(v) for n, v in entry.get("ms", {}).items()}


class Autotuner:
    """Owner of the measured tables, the settings and the budget of one process (``tuner()``).

    ``identity(device_index) -> (device name, SM count)``, ``timer`` and ``file_tag`` are
    injectable so the selection logic runs on CPU in tests."""

    def __init__(self, settings: Optional[Settings] = None, *, timer=None,
                 identity: Optional[Callable[[int], Tuple[str, int]]] = None, file_tag: Optional[str] = None):
        self.settings = settings or Settings()
        self.budget = Budget(self.settings.bucket_ms, self.settings.total_ms)
        self.timer = CudaClock() if timer is None else as_clock(timer)
        self._identity = identity or _cuda_identity
        self._file_tag = file_tag
        self._by_index: Dict[int, _Table] = {}
        self._by_identity: Dict[Tuple[str, int], _Table] = {}
        self.agreed = False  # set by agree_tuned_choices: every rank holds rank 0's entries
        # Read once, when the process's tuner is made (its first CUDA call) or reset: a lookup
        # of os.environ cost about as much as the rest of the hot path together.
        self.env_enabled = os.environ.get(ENV, "1").strip() != "0"
        self._lock = threading.Lock()
        self._warned = set()
        self.loop_plans = LoopPlans()
        self.ratios = Ratios()  # each candidate's recent time over its bucket's fastest: a guess for the untimed
        self.save_ms = 1.0  # wall ms from a measurement's end to its miss's end (ranking, file write),
        # the slowest of the last SAVE_WINDOW misses: reserved in the next bucket's budget
        self._recent_saves = collections.deque(maxlen=SAVE_WINDOW)
        self.measured_at = 0.0  # perf_counter at the last measurement's end
        self.last_miss_ms: Optional[float] = None  # wall ms of the last miss that measured (benchmarks)

    # ------------------------------------------------------------------ the hot path

    def choose(self, p: Problem, device_index: int, group_sizes,
               context: Callable[[], "MissContext"]) -> Optional[Choice]:
        """The measured choice for this call, or None where the static table decides. ``context``
        is called on a miss only (it builds the candidates' runners)."""
        if not self.enabled:
            return None
        table = self._by_index.get(device_index)
        if table is None:
            table = self._table(device_index)
        # bucket_key, inlined: this runs on every CUDA call (benchmarks/autotune_overhead.py)
        n = p.num_groups
        m = -(-p.num_rows // n) if n > 0 else p.num_rows
        gs = group_sizes
        last = _last_ragged
        key = (p.direction, p.dtype, p.out_dtype, n, p.k, p.n, 0 if m <= 0 else 1 << (m - 1).bit_length(),
               last[1] if last[0] is gs else _ragged(gs), gs is not None)
        ranking = table.ranking.get(key)
        if ranking is None:
            return self._miss(p, key, table, group_sizes, context)
        if not ranking or (not self.agreed and (self.settings.deterministic or _deterministic_algorithms())):
            return None  # () marks a bucket with nothing to choose from
        if table.settling and not p.capturing:
            settling = table.settling.get(key)
            if settling is not None:  # the caller runs this call through it (Settling.call)
                return settling
        first = ranking[0]
        if first[0] != "loop" or (p.sizes_on_host and not p.capturing):  # allowed(), inlined
            return first
        return self.choose_from(ranking, p)

    @property
    def enabled(self) -> bool:
        return self.settings.enabled and self.env_enabled

    def deterministic(self) -> bool:
        return self.settings.deterministic or _deterministic_algorithms()

    # ------------------------------------------------------------------ a miss

    def _miss(self, p, key, table, group_sizes, context) -> Optional[Choice]:
        if p.capturing or self.deterministic() or self.budget.left() <= 0:
            return None
        started = time.perf_counter()
        ctx = context()
        new = self.loop_plans.new_shapes(p, group_sizes) if group_sizes is not None else set()
        cands = candidates(p, ctx.static, cutlass_ok=ctx.cutlass_ok, torch_ok=ctx.torch_ok, group_sizes=group_sizes,
                           built=ctx.built, configs=ctx.configs,
                           loop_ok=self.loop_plans.fits(new, self.budget.for_bucket()))
        if len(cands) < 2:  # nothing to choose: remember it, so later calls skip this work
            table.ranking[key] = ()
            return None
        measure_ = lambda: self._measure(p, key, table, cands, ctx.run, started, new)  # noqa: E731
        if table.path is None:
            return measure_()
        from .cutlass_backend import kernels_module  # the kernel cache's lock and atomic writer

        cache = kernels_module().cache
        try:
            with cache.try_locked(table.path) as mine:
                self._reload(table)  # another rank of the node may have measured this bucket meanwhile
                if key in table.ranking:
                    return self.choose_from(table.ranking[key], p)
                if not mine:  # that rank is measuring now: the static table for this call
                    return None
                choice = measure_()
                self._save(table, cache, since=self.measured_at)
                self.last_miss_ms = (time.perf_counter() - started) * 1e3
            return choice
        except OSError as exc:  # no lock file (read-only or missing directory): measure, keep in memory
            self._warn(table.path, f"te_dist autotune: cannot use {table.path} ({exc}); choices stay in memory")
            table.path = None
            if key in table.ranking:
                return self.choose_from(table.ranking[key], p)
            return measure_()

    def choose_from(self, ranking, p) -> Optional[Choice]:
        return next((c for c in ranking if allowed(c, p)), None)

    def _measure(self, p, key, table, cands, run, started: float, new: set) -> Optional[Choice]:
        """Time ``cands`` within what is left of the bucket since ``started`` (the miss's start), less
        the file write still to come. The loop's first call (its library plans) is made before the
        timing, as one sample read at once (not a candidate's estimate), and observed by ``loop_plans``."""
        runs = [(c, run(c)) for c in cands]
        if LOOP in cands:  # one call on the clock, read at once: its GPU time is in the wall time too
            t = time.perf_counter()
            try:
                handle = self.timer.sample(runs[cands.index(LOOP)][1], 1)
                host_ms = (time.perf_counter() - t) * 1e3
                self.timer.read(handle)
            except Exception:  # noqa: BLE001 - a candidate that fails on this shape cannot win
                runs, host_ms = [r for r in runs if r[0] != LOOP], (time.perf_counter() - t) * 1e3
            self.loop_plans.observe(new, host_ms)
        save_ms = self.save_ms if table.path is not None else 0.0
        elapsed = (time.perf_counter() - started) * 1e3 + save_ms
        live = self.settings.settle_live and hasattr(self.timer, "call")
        before = self.budget.spent_ms
        timings = measure(runs, self.budget, self.timer, elapsed,
                          reserve_ms=LIVE_SHARE * self.settings.bucket_ms if live else 0.0)
        self.measured_at = time.perf_counter()
        self.last_miss_ms = (self.measured_at - started) * 1e3
        if not timings:
            return None
        table.put(key, timings)
        self.ratios.observe(key[0], timings)
        contenders = undecided(timings, [c for c, _ in runs]) if live else []
        # what is left of the bucket after this miss (charged with its file write still to come) and
        # the settled ranking's write
        allowance = min(self.settings.bucket_ms - (self.budget.spent_ms - before) - save_ms, self.budget.left())
        if contenders and allowance > 0:
            table.settling[key] = Settling(
                contenders, {c: timings[c] for c in contenders if c in timings}, allowance, self.timer,
                charge=self._charge, done=lambda ranking, ms: self._settled(table, key, ranking, ms),
                guesses=self.ratios.guesses(key[0], [c for c in contenders if c not in timings]))
        return self.choose_from(table.ranking[key], p)

    def _charge(self, ms: float) -> None:
        self.budget.spent_ms += ms

    def _settled(self, table: _Table, key: Key, ranking: list, ms: dict) -> None:
        """A bucket's live calls decided: its sampled candidates lead the ranking (fastest first), the
        rest keep the first call's order; the file is rewritten (its wall time charged too)."""
        started = time.perf_counter()
        table.settling.pop(key, None)
        self.ratios.observe(key[0], ms)
        first = table.ranking.get(key, ())
        table.ranking[key] = tuple(ranking) + tuple(c for c in first if c not in ranking)
        table.ms[key] = {**table.ms.get(key, {}), **{choice_name(c): round(v, 6) for c, v in ms.items()}}
        if table.path is not None:
            try:
                self._save_unless_locked(table)
            except OSError as exc:
                self._warn(table.path, f"te_dist autotune: cannot use {table.path} ({exc}); choices stay in memory")
                table.path = None
        self._charge((time.perf_counter() - started) * 1e3)

    # ------------------------------------------------------------------ tables and files

    def _table(self, device_index: int) -> _Table:
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
        directory = self.settings.directory
        if directory is None:
            from .cutlass_backend import kernels_module

            directory = kernels_module().build.cache_dir() / "autotune"
        tag = self._file_tag if self._file_tag is not None else _versions_tag()
        digest = hashlib.sha256(f"{ident[0]}\0{ident[1]}\0{tag}".encode()).hexdigest()[:16]
        slug = "".join(ch if ch.isalnum() else "_" for ch in ident[0]).strip("_") or "device"
        return Path(directory) / f"{slug}-sm{ident[1]}-{digest}.json"

    def _reload(self, table: _Table) -> None:
        """Merge the file's entries when it changed since last read; a bad file is warned about and ignored."""
        path = table.path
        if path is None:
            return
        try:
            st = path.stat()
        except OSError:
            return
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == table.file_stamp:
            return
        table.file_stamp = stamp
        try:
            data = json.loads(path.read_text())
            if data.get("version") != FILE_VERSION:
                raise ValueError(f"version {data.get('version')!r}, expected {FILE_VERSION}")
            entries = data["entries"]
            fresh = _Table(None)
            fresh.merge_entries(entries)  # parse all before adopting any: a bad entry adopts nothing
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            self._warn(path, f"te_dist autotune: ignoring the unreadable tuning file {path} ({exc}); "
                             "it is rewritten at the next measurement")
            return
        for key, ranking in fresh.ranking.items():
            table.ranking.setdefault(key, ranking)
            table.ms.setdefault(key, fresh.ms.get(key, {}))
        table.entries_json()  # encode what the file brought now, on the miss's clock, not in the save after it

    def _save(self, table: _Table, cache, since: Optional[float] = None) -> None:
        """Write the table (merged with the file, re-read just before under the lock) atomically;
        ``since``: the measurement's end, from which ``save_ms`` is taken."""
        text = f'{{"entries":{table.entries_json()},"torch":{json.dumps(torch.__version__)},"version":{FILE_VERSION}}}'
        try:
            cache.write_atomic(table.path, text.encode())
            if since is not None:
                self._recent_saves.append((time.perf_counter() - since) * 1e3)
                self.save_ms = max(self._recent_saves)
            st = table.path.stat()
            table.file_stamp = (st.st_mtime_ns, st.st_size)
        except OSError as exc:
            self._warn(table.path, f"te_dist autotune: cannot write {table.path} ({exc}); choices stay in memory")

    def _warn(self, path, message: str) -> None:
        if path not in self._warned:
            self._warned.add(path)
            warnings.warn(message, stacklevel=4)

    # ------------------------------------------------------------------ ahead of time, and across ranks

    def table_for(self, device_index: int) -> _Table:
        return self._by_index.get(device_index) or self._table(device_index)

    def save(self, device_index: int) -> Optional[Path]:
        """Write the device's table now (the CLI); returns its path (None when not persisting)."""
        table = self.table_for(device_index)
        if table.path is None:
            return None
        self._save_unless_locked(table)
        return table.path

    def _save_unless_locked(self, table: _Table) -> None:
        """Merge the file and write the table, unless another rank holds the file's lock now."""
        from .cutlass_backend import kernels_module

        cache = kernels_module().cache
        with cache.try_locked(table.path) as mine:
            if mine:
                self._reload(table)
                self._save(table, cache)

    def export(self) -> dict:
        """Every table as {"<name>|sm<count>": entries} (what agree_tuned_choices sends)."""
        return {f"{name}|sm{sms}": t.to_entries() for (name, sms), t in sorted(self._by_identity.items())}

    def adopt(self, exported: dict) -> None:
        """Replace the in-memory tables by ``exported`` (rank 0's) and mark them agreed."""
        tables = {}
        for ident_text, entries in exported.items():
            name, _, sms = ident_text.rpartition("|sm")
            table = _Table(None)
            table.merge_entries(entries)
            tables[(name, int(sms))] = table
        with self._lock:
            for ident, table in self._by_identity.items():  # keep the paths, drop the entries
                table.ranking, table.ms, table.settling = {}, {}, {}
                other = tables.pop(ident, None)
                if other is not None:
                    table.ranking, table.ms = other.ranking, other.ms
            self._by_identity.update(tables)
            self.agreed = True


_deterministic_algorithms = torch.are_deterministic_algorithms_enabled


def _cuda_identity(index: int) -> Tuple[str, int]:
    props = torch.cuda.get_device_properties(index)
    return props.name, props.multi_processor_count


_TAG: dict = {}


def _versions_tag() -> str:
    """torch version + a digest of the kernel sources and tiles (a change of either starts a new file)."""
    tag = _TAG.get("tag")
    if tag is None:
        from .cutlass_backend import kernels_module

        ck = kernels_module()
        cut = ck.find_cutlass()
        h = hashlib.sha256(ck.build.SOURCE.read_bytes())
        h.update(repr(sorted(ck.heuristics.TILES.items())).encode())
        h.update(str(cut[2] if cut else "no-cutlass").encode())
        tag = _TAG["tag"] = f"torch {torch.__version__} kernels {h.hexdigest()[:16]}"
    return tag


# ---------------------------------------------------------------------- the process's tuner

_TUNER: Dict[str, Autotuner] = {}


def tuner() -> Autotuner:
    t = _TUNER.get("t")
    if t is None:
        t = _TUNER["t"] = Autotuner()
    return t


def choose(*args, **kwargs) -> Optional[Choice]:
    """``tuner().choose(...)`` (see Autotuner.choose)."""
    return tuner().choose(*args, **kwargs)


def configure(*, enabled: Optional[bool] = None, deterministic: Optional[bool] = None,
              bucket_ms: Optional[float] = None, total_ms: Optional[float] = None, persist: Optional[bool] = None,
              directory=None, settle_live: Optional[bool] = None) -> Settings:
    """Change the process's settings (a config file's ``kernels`` section lands here); returns them."""
    t = tuner()
    s = t.settings
    for name, value in (("enabled", enabled), ("deterministic", deterministic), ("persist", persist),
                        ("settle_live", settle_live)):
        if value is not None:
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, received {value!r}")
            setattr(s, name, value)
    for name, value in (("bucket_ms", bucket_ms), ("total_ms", total_ms)):
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a non-negative number of milliseconds, received {value!r}")
            setattr(s, name, float(value))
            setattr(t.budget, name, float(value))
    if directory is not None:
        s.directory = Path(directory)
        t._by_index.clear()
        t._by_identity.clear()
    return s


def reset(autotuner: Optional[Autotuner] = None) -> Autotuner:
    """Start over with fresh settings, budget and tables (or install ``autotuner``, for tests)."""
    _TUNER["t"] = autotuner or Autotuner()
    return _TUNER["t"]
