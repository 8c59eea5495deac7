"""The benchmark pins itself to the CPUs of its GPU's NUMA node, and only where that means something."""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest
import torch

from fusion_backend.bench import affinity

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs Linux CPU affinity")


def _fake_sys(root: Path, nodes: dict[int, str], gpu_node: int | None) -> Path:
    for n, cpus in nodes.items():
        (root / f"devices/system/node/node{n}").mkdir(parents=True)
        (root / f"devices/system/node/node{n}/cpulist").write_text(cpus + "\n")
    if gpu_node is not None:
        pci = root / "bus/pci/devices/0000:1a:00.0"
        pci.mkdir(parents=True)
        (pci / "numa_node").write_text(f"{gpu_node}\n")
    return root


@pytest.fixture
def cuda_props(monkeypatch):
    props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x1A, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)


@pytest.fixture
def affinity_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: calls.append(set(cpus)))
    return calls


def test_cpus_spanning_two_nodes_are_narrowed_to_the_gpus_node(tmp_path, cuda_props, affinity_calls):
    root = _fake_sys(tmp_path, {0: "0-3", 1: "4-7"}, gpu_node=1)
    said = affinity.pin_to_device_node(torch.device("cuda", 0), sys_root=root)
    assert affinity_calls == [{4, 5, 6, 7}]
    assert said == "pinned to NUMA node 1: 4 of 8 allowed CPUs"


def test_only_allowed_cpus_of_the_node_are_kept(tmp_path, cuda_props, affinity_calls):
    root = _fake_sys(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15"}, gpu_node=0)
    affinity.pin_to_device_node(torch.device("cuda", 0), sys_root=root)
    assert affinity_calls == [{0, 1, 2, 3}]


@pytest.mark.parametrize("nodes,gpu_node,reason", [
    ({0: "0-7"}, 0, "lie in one NUMA node"),
    ({0: "0-3", 1: "4-7"}, None, "node is unknown"),
    ({0: "0-3", 1: "4-7"}, -1, "node is unknown"),
    ({0: "0-3", 1: "4-7", 2: "16-19"}, 2, "has none of the allowed CPUs"),
])
def test_nothing_changes_where_pinning_cannot_help(tmp_path, cuda_props, affinity_calls, nodes, gpu_node, reason):
    root = _fake_sys(tmp_path, nodes, gpu_node)
    said = affinity.pin_to_device_node(torch.device("cuda", 0), sys_root=root)
    assert affinity_calls == []
    assert said.startswith("not pinned") and reason in said
