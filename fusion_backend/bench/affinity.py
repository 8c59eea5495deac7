"""Keep the benchmark on the CPUs next to its GPU: one NUMA node, chosen before anything is allocated.

WHY: a whole network's step is often host-bound (its host time per step above its kernels' time), so
its reading measures the host as much as the code.  On a host whose allowed CPUs span several NUMA nodes, the scheduler moves the process between
them; Python objects (a compiled graph's wrapper code, its kernel launchers) live in the memory of the
node that was current when they were created, so two callables compiled at different moments can run at
different speeds for a whole run although they are the same code.  Pinning the process (and the compile
workers it starts, which inherit the mask) to the node of the GPU keeps every object local to the CPU
that runs it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

_SYS = Path("/sys")


def _cpu_list(text: str) -> set[int]:
    """``"0-3,8,10-11"`` → ``{0, 1, 2, 3, 8, 10, 11}`` (the kernel's cpulist format).

    >>> sorted(_cpu_list("0-2,5"))
    [0, 1, 2, 5]
    """
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _node_cpus(sys_root: Path) -> dict[int, set[int]]:
    nodes = {}
    for node in sorted((sys_root / "devices/system/node").glob("node[0-9]*")):
        try:
            nodes[int(node.name[4:])] = _cpu_list((node / "cpulist").read_text())
        except (OSError, ValueError):
            continue
    return nodes


def _gpu_node(device: torch.device, sys_root: Path) -> int | None:
    """The NUMA node the GPU's PCI device reports, or ``None`` (unknown, or -1: no affinity)."""
    try:
        props = torch.cuda.get_device_properties(device)
        bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        node = int((sys_root / "bus/pci/devices" / bus / "numa_node").read_text())
    except (AttributeError, OSError, ValueError, RuntimeError):
        return None
    return node if node >= 0 else None


def pin_to_device_node(device: torch.device, sys_root: Path = _SYS) -> str:
    """Restrict this process's CPUs to those of ``device``'s NUMA node that it may use; returns what it
    did, for the report's environment.  Nothing changes where the allowed CPUs lie in one node already,
    where the node is unknown (no NUMA information, not Linux) or where the GPU's node has none of the
    allowed CPUs; then the reason is returned."""
    if not hasattr(os, "sched_getaffinity"):
        return "not pinned: no CPU affinity on this platform"
    allowed = os.sched_getaffinity(0)
    nodes = {n: cpus & allowed for n, cpus in _node_cpus(sys_root).items()}
    used = {n for n, cpus in nodes.items() if cpus}
    if len(used) <= 1:
        return f"not pinned: the {len(allowed)} allowed CPUs lie in one NUMA node"
    node = _gpu_node(device, sys_root) if device.type == "cuda" else None
    if node is None or not nodes.get(node):
        return f"not pinned: the GPU's NUMA node is unknown or has none of the allowed CPUs (nodes {sorted(used)})"
    os.sched_setaffinity(0, nodes[node])
    return f"pinned to NUMA node {node}: {len(nodes[node])} of {len(allowed)} allowed CPUs"
