"""Text as byte-level tokens (vocabulary 256, nothing to download), tokenized once into a token file.

    .txt    the file's bytes, as they are (UTF-8 text gives its UTF-8 bytes)
    .jsonl  each line's "text" field, UTF-8 encoded, every document followed by a NUL byte
            (the end-of-text token; blank lines are skipped)

The tokens go to ``<cache_dir>/<stem>-<digest of the text's path>.bin`` (flat little-endian
uint16, so the file is itself a valid ``--data.path``), with a stamp ``<same>.json`` beside it:
the text's size, modification time and SHA-256, and the token count. A run reuses the token file
while the text's size and time are those of the stamp (when they differ, the content digest
decides) and rebuilds it when the text changed. It is built into a temporary file and renamed,
under a lock, so ranks that start together build it once and nobody reads half of one.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from .token_files import DataError, cache_name, check_readable

__all__ = ["tokenize_text", "END_OF_TEXT", "FORMAT"]

END_OF_TEXT = b"\0"  # separates the documents of a .jsonl file
FORMAT = "bytes-v1"  # changes whenever the tokenization does: older cache entries are rebuilt
_READ_BYTES = 1 << 24


def _stamp(path: Path, digest: str, num_tokens: int) -> dict:
    st = path.stat()
    return {"format": FORMAT, "source": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "sha256": digest, "num_tokens": num_tokens}


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_READ_BYTES):
            h.update(block)
    return h.hexdigest()


def _still_valid(path: Path, tokens: Path, stamp_path: Path) -> bool:
    """Whether the cached tokens were made from the text as it is now (refreshing a stale time stamp)."""
    try:
        stamp = json.loads(stamp_path.read_text())
        st = path.stat()
        if stamp.get("format") != FORMAT or tokens.stat().st_size != 2 * stamp["num_tokens"]:
            return False
        if (stamp["size"], stamp["mtime_ns"]) == (st.st_size, st.st_mtime_ns):
            return True
        if stamp["size"] != st.st_size or stamp["sha256"] != _file_digest(path):
            return False
        _write_atomic(stamp_path, json.dumps(_stamp(path, stamp["sha256"], stamp["num_tokens"])).encode())
        return True  # touched, not changed
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def _txt_blocks(path: Path, digest):
    with open(path, "rb") as f:
        while block := f.read(_READ_BYTES):
            digest.update(block)
            yield block


def _jsonl_blocks(path: Path, digest):
    pending, size = [], 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            digest.update(line)
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except ValueError as exc:
                raise DataError(path, f"line {lineno} is not valid JSON ({exc})") from None
            if not isinstance(doc, dict) or "text" not in doc:
                raise DataError(path, f"line {lineno} has no \"text\" field")
            if not isinstance(doc["text"], str):
                raise DataError(path, f"line {lineno}: \"text\" is a {type(doc['text']).__name__}, not a string")
            encoded = doc["text"].encode("utf-8", errors="surrogatepass") + END_OF_TEXT
            pending.append(encoded)
            size += len(encoded)
            if size >= _READ_BYTES:
                yield b"".join(pending)
                pending, size = [], 0
    if pending:
        yield b"".join(pending)


def _build(path: Path, tokens: Path, stamp_path: Path) -> None:
    digest = hashlib.sha256()
    blocks = _jsonl_blocks(path, digest) if path.suffix.lower() == ".jsonl" else _txt_blocks(path, digest)
    tmp = tokens.with_name(f".{tokens.name}.{os.getpid()}.tmp")
    num_tokens = 0
    try:
        with open(tmp, "wb") as out:
            for block in blocks:
                np.frombuffer(block, dtype=np.uint8).astype("<u2").tofile(out)
                num_tokens += len(block)
        tmp.replace(tokens)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _write_atomic(stamp_path, json.dumps(_stamp(path, digest.hexdigest(), num_tokens)).encode())


def tokenize_text(path: Path, cache_dir: Path) -> tuple:
    """(token file, "reused" or "built") for the text file ``path`` (module docstring)."""
    check_readable(path)
    tokens = cache_dir / cache_name(path, ".bin")
    stamp_path = tokens.with_suffix(".json")
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        lock = open(tokens.with_suffix(".lock"), "a+b")
    except OSError as exc:
        raise DataError(path, f"cannot write its token cache in {cache_dir} ({exc.strerror}); set data.cache_dir") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if _still_valid(path, tokens, stamp_path):
            return tokens, "reused"
        try:
            _build(path, tokens, stamp_path)
        except OSError as exc:
            raise DataError(path, f"tokenizing it into {tokens} failed ({exc.strerror or exc})") from None
    return tokens, "built"
