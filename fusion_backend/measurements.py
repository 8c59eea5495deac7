"""The one cache of measured answers: what a region's decision, a whole graph's check and an op's
per-call path choice measured, kept in this process and in ``$FUSION_CACHE_DIR/measurements.json`` so
that a later process times nothing it was answered before.

Contract:
  * A key is ``key(kind, parts)``: the digest of ``parts`` (JSON-able) with the kind and this
    machine's ``environment()`` (GPU, torch and Triton versions, a fingerprint of this package's
    sources and of the pattern families'), so an answer measured elsewhere, or by other code, is
    never reused.  Callers put in ``parts`` everything else the time depends on.
  * An entry is a JSON object; ``kind`` says whose it is (``"region"``, ``"graph"``, ``"impl"``); one
    without a ``kind`` is dropped when the file is read.  A reader passes ``valid`` to ignore entries
    it cannot use (malformed, another kind); the next measurement under the key replaces them.
  * The file is one JSON object ``{"schema": SCHEMA, "entries": {key: entry}}``, rewritten atomically
    on every store (a concurrent reader never sees half a file; the last writer of two processes may
    drop the other's newest entry, which only costs a measurement).  A file that does not parse or has
    another schema is ignored and replaced by the next store; nothing here ever raises on I/O.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("fusion_backend.measurements")

#: Version of the file's layout and of what a key means; another version is ignored.
SCHEMA = 1
FILE = "measurements.json"

Entry = dict[str, Any]

_lock = threading.Lock()
_memory: dict[str, Entry] = {}
#: The file's path -> (its identity when parsed: path, size, mtime; its entries).
_parsed: dict[str, tuple[tuple[str, int, int], dict[str, Entry]]] = {}


@functools.cache
def environment() -> str:
    """GPU, torch, Triton and fingerprints of this package's sources and of the pattern families' (a
    changed kernel, op or pattern must not reuse old times)."""
    import triton

    from . import sources

    # the pattern families live outside the package folder (top-level patterns/, see pyproject.toml);
    # found, not imported
    families = importlib.util.find_spec(f"{__package__}.patterns")
    roots = [Path(__file__).resolve().parent]
    if families is not None and families.origin:
        roots.append(Path(families.origin).resolve().parent)
    fingerprints = " ".join(sources.fingerprint(root)[:16] for root in roots)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return f"{device}|torch {torch.__version__}|triton {triton.__version__}|sources {fingerprints}"


def digest(parts: Mapping[str, Any]) -> str:
    """A stable digest of JSON-able ``parts`` (``repr`` for anything else)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()


def key(kind: str, parts: Mapping[str, Any]) -> str:
    """The key of a ``kind`` of answer to ``parts`` measured on this machine (module docstring)."""
    return digest({"kind": kind, "environment": environment(), **parts})


def lookup(key: str, cache_dir: Path, valid: Callable[[Entry], bool] = lambda entry: True) -> Entry | None:
    """The entry under ``key``, from this process or the file, if ``valid`` accepts it; else None."""
    with _lock:
        entry = _memory.get(key)
        if entry is None:
            entry = _load(cache_dir).get(key)
    return entry if isinstance(entry, dict) and valid(entry) else None


def entries(cache_dir: Path) -> dict[str, Entry]:
    """Every entry known: the file's, then this process's (which win)."""
    with _lock:
        return {**_load(cache_dir), **_memory}


def store(key: str, entry: Entry, cache_dir: Path) -> None:
    """Keep ``entry`` under ``key``, in this process and in the file."""
    with _lock:
        _memory[key] = entry
        path = cache_dir / FILE
        try:
            every = {**_load(cache_dir), key: entry}
            cache_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps({"schema": SCHEMA, "entries": every}, indent=1, sort_keys=True))
            tmp.replace(path)
        except OSError as exc:
            log.debug("measurement cache %s not written: %s", path, exc)


def remember(key: str, entry: Entry) -> None:
    """Keep ``entry`` under ``key`` in this process only (e.g. an answer read from the file)."""
    with _lock:
        _memory[key] = entry


def forget_in_memory() -> None:
    """Drop the in-process answers (the file stays): the next lookup reads the file, as a new process would."""
    with _lock:
        _memory.clear()
        _parsed.clear()


def _load(cache_dir: Path) -> dict[str, Entry]:
    """The file's entries (none when it is missing, corrupt or of another schema).  Parsed again only
    when the file changed (its size and modification time): a settle looks up every region of a
    large graph.  Called with ``_lock`` held."""
    path = cache_dir / FILE
    try:
        stat = path.stat()
    except OSError:
        return {}
    identity = (str(path), stat.st_size, stat.st_mtime_ns)
    parsed = _parsed.get(str(path))
    if parsed is not None and parsed[0] == identity:
        return parsed[1]
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("entries"), dict):
        return {}
    found = {k: v for k, v in data["entries"].items() if isinstance(v, dict) and isinstance(v.get("kind"), str)}
    _parsed[str(path)] = (identity, found)
    return found
