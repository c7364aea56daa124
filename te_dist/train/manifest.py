"""A checkpoint's manifest (``meta.json``): what makes a step directory whole, and the check of it.

Why checksums: DCP files carry none, so a flipped bit in a shard loads silently (the optimizer
state turns to noise) and a truncated one fails deep inside torch without naming the file.
``meta.json`` lists every file of the step directory with its size and sha256, beside the step,
the run id and the resolved config, and carries a sha256 of its own content. It is written last,
inside a temporary directory that is renamed into place only afterwards (checkpoint.py), so a
``step_NNNNNN`` directory is whole or absent; verification re-reads every file and names the
first one that differs. Every problem is a :class:`CheckpointError` whose message is one line.

    meta.json = {"format": 2, "step": 20, "run_id": "...", "world_size": 2, "ep": 2,
                 "model": {...}, "config": {...}, "losses": {...}, "recipe": ..., "recipe_key": ...,
                 "files": {"__0_0.distcp": {"size": N, "sha256": "..."}, ".metadata": {...}, ...},
                 "meta_sha256": sha256 of the canonical JSON of everything else}
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Optional

from .config import ConfigError

__all__ = [
    "CheckpointError",
    "META",
    "FORMAT",
    "step_of",
    "list_checkpoints",
    "file_digest",
    "write_manifest",
    "read_manifest",
    "verify_checkpoint",
    "select_checkpoint",
]

META = "meta.json"
FORMAT = 2  # 1: no checksums (cannot be verified, so never resumed)
_STEP_DIR = re.compile(r"^step_(\d{6,})$")
_REQUIRED = {"format": int, "step": int, "run_id": str, "world_size": int, "ep": int, "model": dict,
             "config": dict, "files": dict, "meta_sha256": str}
_CHUNK = 1 << 22
SKIP_HINT = "--skip-invalid resumes from the newest checkpoint that verifies"


class CheckpointError(ConfigError):
    """A checkpoint that must not be loaded. ``path`` is the offending file; the message is one line."""

    def __init__(self, path, problem: str):
        self.path, self.problem = Path(path), problem
        super().__init__(f"{path}: {problem}")


def step_of(path) -> Optional[int]:
    """The step of a ``step_NNNNNN`` directory name, else None (temporary and other entries)."""
    match = _STEP_DIR.match(Path(path).name)
    return int(match.group(1)) if match else None


def list_checkpoints(root) -> list:
    """``step_*`` directories directly under ``root``, oldest first (whether or not they verify)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=step_of)


def file_digest(path) -> dict:
    """``{"size", "sha256"}`` of a file, read in chunks."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def _self_digest(body: dict) -> str:
    canonical = json.dumps({k: v for k, v in body.items() if k != "meta_sha256"}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def fsync_dir(path) -> None:
    """Make a rename or a new entry in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory, meta: dict, files: dict) -> dict:
    """Write ``meta.json`` (atomically, fsynced) into ``directory``; returns what was written."""
    directory = Path(directory)
    body = dict(meta, format=FORMAT, files=files)
    body["meta_sha256"] = _self_digest(body)
    tmp = directory / (META + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(body, indent=1, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(directory / META)
    fsync_dir(directory)
    return body


def read_manifest(directory) -> dict:
    """The parsed ``meta.json`` of ``directory``, after checking its shape and its own checksum."""
    path = Path(directory) / META
    if not path.is_file():
        raise CheckpointError(path, "missing (a checkpoint directory without its manifest is incomplete)")
    try:
        body = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(path, f"not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise CheckpointError(path, f"must hold a JSON object, holds {type(body).__name__}")
    if body.get("format") != FORMAT:
        raise CheckpointError(path, f"format {body.get('format')!r}, expected {FORMAT} (a checkpoint without "
                                    f"checksums, written by an older te_dist, cannot be verified)")
    for key, kind in _REQUIRED.items():
        if not isinstance(body.get(key), kind) or isinstance(body.get(key), bool):
            raise CheckpointError(path, f"field {key!r} must be a {kind.__name__}, got {body.get(key)!r}")
    if body["meta_sha256"] != _self_digest(body):
        raise CheckpointError(path, "its own checksum does not match its content (the file was changed after the save)")
    for name, entry in body["files"].items():
        if (not isinstance(entry, dict) or not isinstance(entry.get("size"), int)
                or not isinstance(entry.get("sha256"), str) or "/" in name or name in (META, "")):
            raise CheckpointError(path, f"bad entry for file {name!r}: {entry!r}")
    return body


def verify_checkpoint(directory) -> dict:
    """The manifest of ``directory`` once every file matches it; raises CheckpointError naming the file."""
    directory = Path(directory)
    meta = read_manifest(directory)
    step = step_of(directory)
    if step is not None and meta["step"] != step:
        raise CheckpointError(directory / META, f"records step {meta['step']} but lies in {directory.name} "
                                                f"(a manifest from another checkpoint)")
    listed = meta["files"]
    for name in sorted(listed):
        path, want = directory / name, listed[name]
        if not path.is_file():
            raise CheckpointError(path, "missing (meta.json lists it)")
        size = path.stat().st_size
        if size != want["size"]:
            raise CheckpointError(path, f"{size} bytes, meta.json records {want['size']} (truncated or overwritten)")
        if file_digest(path)["sha256"] != want["sha256"]:
            raise CheckpointError(path, "checksum mismatch (the content changed after the save)")
    extra = sorted(p.name for p in directory.iterdir() if p.name not in listed and p.name != META)
    if extra:
        raise CheckpointError(directory / extra[0], "not part of the checkpoint (meta.json does not list it)")
    return meta


def select_checkpoint(source, *, skip_invalid: bool = False) -> tuple:
    """``(step dir, manifest, notes)`` of the checkpoint to resume from ``source``.

    ``source`` is a step directory (used as given), or a ``checkpoints`` directory or an output
    directory (its newest checkpoint). The newest checkpoint must verify; with ``skip_invalid`` a
    failing one is passed over for the next older one (each skip is a line in ``notes``).
    Returns ``(None, None, [])`` when ``source`` holds no step directory at all.
    """
    source = Path(source)
    if not source.is_dir():
        raise CheckpointError(source, "no such checkpoint or output directory")
    if step_of(source) is not None or (source / META).is_file():
        return source, verify_checkpoint(source), []
    root = source / "checkpoints" if (source / "checkpoints").is_dir() else source
    notes = []
    for candidate in reversed(list_checkpoints(root)):
        try:
            return candidate, verify_checkpoint(candidate), notes
        except CheckpointError as exc:
            if not skip_invalid:
                raise CheckpointError(exc.path, f"{exc.problem}; {SKIP_HINT}") from None
            notes.append(f"skipped {candidate.name}: {exc}")
    if notes:
        raise CheckpointError(root, f"no checkpoint there verifies ({'; '.join(notes)})")
    return None, None, []
