"""Pre-tokenized token files, read through a memory map: ``.bin`` (flat tokens) and ``.npy``.

A ``.bin`` file is what nanoGPT's ``prepare.py`` and Megatron's GPT datasets write: the tokens
back to back, no header, little-endian ``uint16`` (``uint32`` for vocabularies above 65,536,
``data.token_dtype``). A ``.npy`` file carries its dtype and shape in its header; any integer
dtype in C order is read as one flat sequence.

Why a fresh map per read: the pages a map has touched count in the process's resident memory
for as long as the map lives, so a long run over a large file would grow by every page it ever
sampled. Mapping, copying a batch's windows out and unmapping keeps a rank flat however large
the file (the kernel's page cache still keeps hot pages). The one full pass over the file (the
largest token, the unigram entropy) reads fixed-size chunks for the same reason.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from .config import ConfigError

__all__ = ["DataError", "TokenFile", "TokenStats", "open_token_file", "check_readable", "token_stats", "cache_name"]

_SCAN_CHUNK = 1 << 22  # tokens per read of the full pass (32 MiB as int64 at most)
_MAX_COUNTED_VOCAB = 1 << 20  # largest token for which the unigram counts are kept (8 MiB of counts)


class DataError(ConfigError):
    """A data file that cannot be trained on: one line naming the file and the problem (exit 2)."""

    def __init__(self, path, problem: str):
        super().__init__(f"data.path {path}: {problem}")
        self.path, self.problem = str(path), problem


def check_readable(path: Path) -> int:
    """The file's size in bytes; DataError when it is missing, not a file, empty or unreadable."""
    if not path.exists():
        raise DataError(path, "no such file")
    if not path.is_file():
        raise DataError(path, "not a regular file")
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as exc:
        raise DataError(path, f"cannot be read ({exc.strerror or type(exc).__name__})") from None
    size = path.stat().st_size
    if size == 0:
        raise DataError(path, "the file is empty")
    return size


@dataclass(frozen=True)
class TokenFile:
    """Where the tokens of a file lie: ``num_tokens`` elements of ``dtype`` from byte ``offset`` on."""

    path: str
    dtype: str  # numpy dtype string, byte order included ("<u2")
    offset: int
    num_tokens: int

    def _map(self) -> np.memmap:
        return np.memmap(self.path, dtype=np.dtype(self.dtype), mode="r", offset=self.offset, shape=(self.num_tokens,))

    def read_windows(self, starts, length: int) -> np.ndarray:
        """Tokens [len(starts), length] (int64): the window of ``length`` tokens at each start."""
        out = np.empty((len(starts), length), dtype=np.int64)
        tokens = self._map()
        try:
            for row, start in enumerate(starts):
                out[row] = tokens[int(start) : int(start) + length]
        finally:
            del tokens  # unmapped here: the pages it touched leave this process's resident memory
        return out

    def chunks(self, chunk_tokens: int = _SCAN_CHUNK):
        """The tokens in order, as arrays of at most ``chunk_tokens`` (plain reads, no map)."""
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            left = self.num_tokens
            while left:
                chunk = np.fromfile(f, dtype=np.dtype(self.dtype), count=min(left, chunk_tokens))
                if not len(chunk):
                    raise DataError(self.path, f"ends {left} tokens early (was it truncated while being read?)")
                left -= len(chunk)
                yield chunk


def open_token_file(path: Path, token_dtype: str) -> TokenFile:
    """Check a ``.bin`` or ``.npy`` file's layout (not its values) and say where its tokens lie."""
    size = check_readable(path)
    if path.suffix.lower() == ".npy":
        return _open_npy(path, size)
    itemsize = np.dtype(token_dtype).itemsize
    if size % itemsize:
        hint = " (a uint8 or text file? text goes in a .txt file)" if itemsize == 2 else ""
        raise DataError(path, f"{size} bytes is not a whole number of {token_dtype} tokens ({itemsize} bytes each){hint}; "
                              f"is data.token_dtype right?")
    return TokenFile(str(path), np.dtype(token_dtype).newbyteorder("<").str, 0, size // itemsize)


def _open_npy(path: Path, size: int) -> TokenFile:
    try:
        with open(path, "rb") as f:
            major, _ = np.lib.format.read_magic(f)
            read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            shape, fortran_order, dtype = read_header(f)
            offset = f.tell()
    except (ValueError, OSError, EOFError) as exc:
        raise DataError(path, f"not a valid .npy file ({exc})") from None
    if dtype.kind not in "iu":
        raise DataError(path, f"holds {dtype} values; token ids must be integers")
    if fortran_order and len(shape) > 1:
        raise DataError(path, f"is a Fortran-order array of shape {shape}; save the tokens as one flat C-order array")
    num_tokens = math.prod(shape)
    if offset + num_tokens * dtype.itemsize > size:
        raise DataError(path, f"is truncated: its header promises {num_tokens} {dtype} tokens, the file holds "
                              f"{(size - offset) // dtype.itemsize}")
    if num_tokens == 0:
        raise DataError(path, "holds no tokens")
    return TokenFile(str(path), dtype.str, offset, num_tokens)


@dataclass(frozen=True)
class TokenStats:
    """What one full pass over a token file finds."""

    num_tokens: int
    min_token: int
    max_token: int
    unigram_entropy: Optional[float]  # nats per token of the token frequencies (None for a huge vocabulary)


def scan_tokens(tokens: TokenFile, *, chunk_tokens: int = _SCAN_CHUNK) -> TokenStats:
    """Range and unigram entropy of every token, read ``chunk_tokens`` at a time."""
    lo, hi, counts = None, None, np.zeros(0, dtype=np.int64)
    for chunk in tokens.chunks(chunk_tokens):
        c_lo, c_hi = int(chunk.min()), int(chunk.max())
        lo = c_lo if lo is None else min(lo, c_lo)
        hi = c_hi if hi is None else max(hi, c_hi)
        if counts is not None and lo >= 0 and hi < _MAX_COUNTED_VOCAB:
            c = np.bincount(chunk.astype(np.intp, copy=False), minlength=len(counts))
            c[: len(counts)] += counts
            counts = c
        else:
            counts = None  # a negative or huge token: no unigram entropy (the checks still run)
    entropy = None
    if counts is not None:
        p = counts[counts > 0] / tokens.num_tokens
        entropy = float(-(p * np.log(p)).sum())
    return TokenStats(tokens.num_tokens, lo, hi, entropy)


def cache_name(path: Path, suffix: str) -> str:
    """A cache file's name for ``path``: its stem and a digest of its absolute path (two files of
    the same name in different folders never share an entry)."""
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    return f"{path.stem}-{digest}{suffix}"


def _identity(tokens: TokenFile) -> dict:
    st = os.stat(tokens.path)
    return {"path": str(Path(tokens.path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "dtype": tokens.dtype, "offset": tokens.offset}


def token_stats(tokens: TokenFile, cache_dir: Optional[Path]) -> TokenStats:
    """The stats of ``tokens``, from ``cache_dir`` while the file is unchanged (size, mtime, layout),
    else from a full pass (saved there for the ranks and the next run; an unwritable cache is skipped)."""
    identity = _identity(tokens)
    entry = cache_dir / cache_name(Path(tokens.path), ".stats.json") if cache_dir is not None else None
    if entry is not None and entry.is_file():
        try:
            saved = json.loads(entry.read_text())
            if saved.get("identity") == identity:
                return TokenStats(**saved["stats"])
        except (ValueError, TypeError, KeyError, OSError):
            pass  # a damaged entry is recomputed
    stats = scan_tokens(tokens)
    if entry is not None:
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            tmp = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"identity": identity, "stats": asdict(stats)}))
            tmp.replace(entry)
        except OSError:
            pass
    return stats
