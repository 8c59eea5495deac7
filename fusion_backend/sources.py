"""The fingerprint of this package's source files: the part of every persistent key that must change
with the code (the decision cache's keys, Inductor's cache key of a graph holding fused ops).

A file is fingerprinted by its path, size and modification time, as Python's own bytecode cache tells
a changed source: an edit, a checkout and an install each give the files new times, and one installed
version gives every process the same fingerprint, so a second process finds what the first cached.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path


# NOTE: stat, not hash: a warm process pays the fingerprint in its first compile; reading and hashing
# the ~140 files (1.5 MB) of the package and its pattern families took 12 ms on a 2-core CPU machine,
# their ``stat`` 3 ms (``python -c "import time, fusion_backend.patterns; from fusion_backend.runtime
# import decision as d; t = time.perf_counter(); d._environment(); print(time.perf_counter() - t)"``).
@functools.cache
def fingerprint(root: Path) -> str:
    """Hex SHA-256 over ``source_stats(root)`` (computed once per process and folder)."""
    digest = hashlib.sha256()
    for relative, size, mtime_ns in source_stats(root):
        digest.update(f"{relative}:{size}:{mtime_ns}\n".encode())
    return digest.hexdigest()


def source_stats(root: Path) -> list[tuple[str, int, int]]:
    """(path relative to ``root``, size, modification time in ns) of every ``.py`` file under ``root``
    (``__pycache__`` folders skipped), sorted by path."""
    found = []
    pending = [(root, "")]
    while pending:
        folder, prefix = pending.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    if entry.name != "__pycache__":
                        pending.append((Path(entry.path), f"{prefix}{entry.name}/"))
                elif entry.name.endswith(".py") and entry.is_file():
                    stat = entry.stat()
                    found.append((f"{prefix}{entry.name}", stat.st_size, stat.st_mtime_ns))
    return sorted(found)
