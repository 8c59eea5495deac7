"""The environment a run happened in, for the report: who can reproduce a number needs all of it.

Collected once per run, best effort: a field that cannot be read is recorded as the error string
rather than aborting the benchmark.  The TF32 flags matter most: PyTorch's defaults let cuDNN
convolutions use TF32 while fp32 matmuls do not, and the harness leaves both alone and writes them down.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
import tempfile
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


def git_code(root: Path | None = None) -> dict[str, Any]:
    """The code a run ran, as git sees the checkout at ``root`` (None: this package's): ``git_tree``, the
    tree id of the working tree as it is (tracked files and untracked ones that are not ignored, with
    their uncommitted changes: what ``git add -A && git write-tree`` would give), and ``git_local_changes``,
    whether it differs from the checked-out commit's tree.  Computed with a temporary index and object
    store, so that the checkout's repository is not written.  WHY: a checkout copied over an older one (a
    GPU machine's copy of a working tree) reports that older commit; its tree still names the code run,
    and ``git log --format='%H %T'`` finds the commit with that tree.  Empty without git or outside a
    checkout."""
    root = Path(__file__).resolve().parents[2] if root is None else root

    def git(*args: str, env: dict[str, str] | None = None) -> str:
        done = subprocess.run(["git", *args], cwd=root, env=env, capture_output=True, text=True, timeout=60)
        if done.returncode:
            raise OSError(done.stderr.strip() or f"git {args[0]} failed")
        return done.stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root.resolve():
            return {}  # the package installed somewhere inside another repository: not its checkout
        with tempfile.TemporaryDirectory() as tmp:
            objects = Path(tmp) / "objects"
            objects.mkdir()
            env = dict(os.environ, GIT_INDEX_FILE=str(Path(tmp) / "index"), GIT_OBJECT_DIRECTORY=str(objects),
                       GIT_ALTERNATE_OBJECT_DIRECTORIES=git("rev-parse", "--path-format=absolute", "--git-path",
                                                            "objects"))  # fmt: skip
            git("add", "-A", ".", env=env)
            tree = git("write-tree", env=env)
            head = git("rev-parse", "HEAD^{tree}", env=env)
    except (OSError, subprocess.SubprocessError):  # no git, not a checkout, no commit yet
        return {}
    return {"git_tree": tree, "git_local_changes": tree != head}


def describe_code(env: dict[str, Any]) -> str:
    """A report's line for the code a run ran (:func:`git_code`'s fields and ``git_commit``): ``commit C``,
    ``commit C with local changes (working tree T)`` (no ``T`` where merged parts ran different trees), or
    ``-`` where nothing is known."""
    commit, tree = env.get("git_commit"), env.get("git_tree")
    if not commit:
        return f"working tree {tree}" if tree else "-"
    if env.get("git_local_changes"):
        return f"commit {commit} with local changes" + (f" (working tree {tree})" if tree else "")
    return f"commit {commit}"


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
        **git_code(),
        "cuda": torch.version.cuda,
        "cudnn": _safe(torch.backends.cudnn.version),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "tf32": tf32_flags(),
        "device": str(device),
    }
    if device.type == "cuda":
        env["gpu"] = _safe(lambda: gpu_info(device))
    return env
