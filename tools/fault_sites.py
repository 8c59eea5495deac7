"""Where a thread's minor page faults happen: the faulting instruction's and the faulted address's
mapping (library, ``[heap]``, anonymous), sampled by the kernel's ``perf_event_open`` on this thread.
Linux only; no privilege beyond ``perf_event_paranoid <= 2`` (user-space faults only: a fault the
kernel takes while copying for a system call is counted by ``getrusage`` but not sampled here).

Used by ``tools/bench_step_accounting.py --fault-sites``::

    with FaultSites() as sites:
        step()
    print(sites.table())

WHY: ``getrusage`` counts the faults of a call but not where they come from; a per-call fault count
that differs between two copies of the same compiled code needs the mapping it touches to be explained.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import mmap
import os
import platform
import struct
from typing import Any

_PERF_TYPE_SOFTWARE = 1
_PERF_COUNT_SW_PAGE_FAULTS_MIN = 5
_PERF_SAMPLE_IP = 1 << 0
_PERF_SAMPLE_ADDR = 1 << 3
_PERF_RECORD_LOST = 2
_PERF_RECORD_SAMPLE = 9
#: ``perf_event_open``'s system call number by machine
_SYS_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}
_PERF_EVENT_IOC_ENABLE = 0x2400
_PERF_EVENT_IOC_DISABLE = 0x2401
_DATA_PAGES = 256  # a power of two: 1 MiB of samples between two drains


class _Attr(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint32), ("size", ctypes.c_uint32), ("config", ctypes.c_uint64),
                ("sample_period", ctypes.c_uint64), ("sample_type", ctypes.c_uint64),
                ("read_format", ctypes.c_uint64), ("flags", ctypes.c_uint64),
                ("wakeup_events", ctypes.c_uint32), ("bp_type", ctypes.c_uint32),
                ("bp_addr", ctypes.c_uint64), ("bp_len", ctypes.c_uint64)]  # fmt: skip


_DISABLED, _EXCLUDE_KERNEL, _EXCLUDE_HV = 1 << 0, 1 << 5, 1 << 6


def _mappings() -> tuple[list[int], list[tuple[int, str]]]:
    """``/proc/self/maps`` as sorted starts and ``(end, name)`` pairs."""
    starts, rest = [], []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            lo, hi = (int(v, 16) for v in parts[0].split("-"))
            name = parts[5].strip() if len(parts) > 5 else ""
            starts.append(lo)
            rest.append((hi, os.path.basename(name) if name.startswith("/") else name or f"anon {parts[1]}"))
    return starts, rest


def _where(address: int, starts: list[int], rest: list[tuple[int, str]]) -> str:
    i = bisect.bisect_right(starts, address) - 1
    if i >= 0 and address < rest[i][0]:
        return rest[i][1]
    return "unmapped now"


class FaultSites:
    """Samples every user-space minor fault of the calling thread while enabled (a context manager;
    re-entrant enables add up).  ``sites``: a counter of ``(instruction's mapping, address's mapping)``."""

    def __init__(self) -> None:
        attr = _Attr(type=_PERF_TYPE_SOFTWARE, size=ctypes.sizeof(_Attr), config=_PERF_COUNT_SW_PAGE_FAULTS_MIN,
                     sample_period=1, sample_type=_PERF_SAMPLE_IP | _PERF_SAMPLE_ADDR,
                     flags=_DISABLED | _EXCLUDE_KERNEL | _EXCLUDE_HV, wakeup_events=0)  # fmt: skip
        number = _SYS_PERF_EVENT_OPEN.get(platform.machine())
        if number is None:
            raise OSError(f"perf_event_open: no system call number known for {platform.machine()}")
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.syscall(number, ctypes.byref(attr), 0, -1, -1, 0)
        if fd < 0:
            raise OSError(ctypes.get_errno(), f"perf_event_open: {os.strerror(ctypes.get_errno())}")
        self._fd = fd
        self._libc = libc
        self._page = mmap.PAGESIZE
        self._buf = mmap.mmap(fd, self._page * (1 + _DATA_PAGES), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._tail = 0
        self.sites: collections.Counter[tuple[str, str]] = collections.Counter()
        self.lost = 0
        self._raw: list[tuple[int, int]] = []

    def __enter__(self) -> FaultSites:
        self._libc.ioctl(self._fd, _PERF_EVENT_IOC_ENABLE, 0)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._libc.ioctl(self._fd, _PERF_EVENT_IOC_DISABLE, 0)
        self._drain()

    def _drain(self) -> None:
        head = struct.unpack_from("Q", self._buf, 1024)[0]  # data_head of perf_event_mmap_page
        size = self._page * _DATA_PAGES
        data = self._page
        tail = self._tail
        while tail < head:
            offset = data + tail % size
            header = bytes(self._buf[offset:offset + 8]) if offset + 8 <= data + size else \
                bytes(self._buf[offset:data + size]) + bytes(self._buf[data:data + 8 - (data + size - offset)])
            kind, _misc, length = struct.unpack("IHH", header)
            if length == 0:
                break
            body_start = tail + 8
            body = bytearray()
            for k in range(length - 8):
                body.append(self._buf[data + (body_start + k) % size])
            if kind == _PERF_RECORD_SAMPLE and len(body) >= 16:
                self._raw.append(struct.unpack_from("QQ", body))
            elif kind == _PERF_RECORD_LOST and len(body) >= 16:
                self.lost += struct.unpack_from("QQ", body)[1]
            tail += length
        self._tail = tail
        struct.pack_into("Q", self._buf, 1024 + 8, tail)  # data_tail
        if self._raw:
            starts, rest = _mappings()
            for ip, addr in self._raw:
                self.sites[(_where(ip, starts, rest), _where(addr, starts, rest))] += 1
            self._raw.clear()

    def table(self, top: int = 10) -> str:
        lines = [f"{n:8d}  instruction in {ip_map}, address in {addr_map}" for (ip_map, addr_map), n in
                 self.sites.most_common(top)]  # fmt: skip
        if self.lost:
            lines.append(f"{self.lost:8d}  samples lost")
        return "\n".join(lines) or "(no user-space faults sampled)"

    def close(self) -> None:
        self._buf.close()
        os.close(self._fd)
