"""The environment a run happened in, for the report: who can reproduce a number needs all of it.

Collected once per run, best effort: a field that cannot be read is recorded as the error string
rather than aborting the benchmark.  The TF32 flags matter most: PyTorch's defaults let cuDNN
convolutions use TF32 while fp32 matmuls do not, and the harness leaves both alone and writes them down.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import importlib.metadata
import platform
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch


def _safe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:  # any failure becomes data, not an abort
        return f"unavailable: {type(exc).__name__}: {exc}"


def conv_tf32_enabled() -> bool:
    """Whether cuDNN convolutions may use TF32 now (legacy flag, or the new ``fp32_precision`` API)."""
    try:
        return bool(torch.backends.cudnn.allow_tf32)
    except RuntimeError:  # PyTorch >= 2.9 refuses to read the legacy flag after the new API was used
        return torch.backends.cudnn.conv.fp32_precision == "tf32"


def tf32_flags() -> dict[str, Any]:
    """Every TF32-related switch PyTorch exposes, through both the legacy and the new API."""
    return {
        "cuda.matmul.allow_tf32": _safe(lambda: torch.backends.cuda.matmul.allow_tf32),
        "cudnn.allow_tf32": _safe(lambda: torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": _safe(torch.get_float32_matmul_precision),
        "cuda.matmul.fp32_precision": _safe(lambda: torch.backends.cuda.matmul.fp32_precision),
        "cudnn.conv.fp32_precision": _safe(lambda: torch.backends.cudnn.conv.fp32_precision),
        "conv_uses_tf32": _safe(conv_tf32_enabled),
    }


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    """The checkout's commit read from ``.git`` files (no ``git`` process), or ``None``."""
    root = Path(__file__).resolve().parents[2] / ".git"
    try:
        head = (root / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head[5:]
        ref_file = root / ref
        if ref_file.is_file():
            return ref_file.read_text().strip()
        packed = root / "packed-refs"
        for line in packed.read_text().splitlines() if packed.is_file() else []:
            sha, _, name = line.partition(" ")
            if name == ref:
                return sha
    except OSError:
        return None
    return None


def gpu_info(device: torch.device) -> dict[str, Any]:
    """Name, compute capability, SM count, memory and L2 size of a CUDA device."""
    props = torch.cuda.get_device_properties(device)
    return {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "total_memory_bytes": props.total_memory,
        "l2_cache_bytes": getattr(props, "L2_cache_size", None),
        "device_index": device.index if device.index is not None else torch.cuda.current_device(),
    }


def collect_environment(device: torch.device, argv: Sequence[str] | None = None,
                        command_prefix: str = "python -m fusion_backend bench") -> dict[str, Any]:
    """Everything needed to interpret and reproduce a run's numbers.

    ``argv`` are the CLI arguments after ``bench``; the recorded command is the prefix plus them.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    env: dict[str, Any] = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([command_prefix, shlex.join(args)]).strip(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "triton": _safe(lambda: importlib.import_module("triton").__version__),
        "fusion_backend": _version("fusion-backend"),
        "git_commit": _git_commit(),
        "cuda": torch.version.cuda,
        "cudnn": _safe(torch.backends.cudnn.version),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "tf32": tf32_flags(),
        "device": str(device),
    }
    if device.type == "cuda":
        env["gpu"] = _safe(lambda: gpu_info(device))
    return env
