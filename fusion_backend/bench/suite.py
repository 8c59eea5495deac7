"""Turn ``--suite`` into workloads: model files in the benchmark layout.

A *benchmark model file* is a Python file defining ``Model`` (an ``nn.Module`` class), ``get_inputs()``
(the forward's positional arguments) and ``get_init_inputs()`` (``Model``'s constructor arguments):
the layout of KernelBench-style problem files and of ``demos/seeds/``.  Keeping the layout this small
lets users benchmark their own models by pointing ``--suite`` at a file or folder.

``--suite`` is a comma-separated list whose entries are each a suite name (see :data:`SUITES`), a
``.py`` file, or a folder (every ``*.py`` in it not starting with ``_``, in name order).

A named suite (:data:`SUITES`) is a folder under the repository's ``demos/`` (``seeds``: three
multi-op conv pipelines at full size, two of them also small; ``convnets``: single conv layers with
what real networks put after them; ``realnets``: whole networks built from torchvision, torchaudio,
diffusers or written out) and the files to run from it, in order.  ``demos/`` is *not*
inside the package, so it is looked up in ``$FUSION_DEMOS_DIR`` (the folder holding ``seeds/`` and
``convnets/``), then next to the package (a source checkout or editable install), then under the
working directory; each suite takes the first of these that has its folder, and if none has it the
error says where it looked.

A model file may also declare, as module-level constants (each optional, checked when it loads):

- ``DTYPES``: the precisions it is benchmarked in, names of :data:`fusion_backend.bench.config.PRECISIONS`
  (``DTYPES = ("bf16",)``);
- ``MODES``: the modes it is benchmarked in, names of :data:`fusion_backend.bench.config.MODES`;
- ``REQUIRES``: the top-level packages its ``Model`` or ``get_inputs()`` import when called
  (``REQUIRES = ("torchvision",)``).  Such a file imports them inside those functions, never at file
  level, so that it loads where they are missing;
- ``INFER_EVAL``: ``True`` runs its ``infer`` rows with the model in eval mode (``model.eval()``: batch
  norms on their running statistics, no dropout), as users run a whole network for inference; its
  ``train`` rows, and every row of a file without it, run the model in training mode.

A run's rows of a file are the run's ``--dtype`` x ``--mode`` in the run's order, kept to those the file
declares (:meth:`Workload.rows`); without ``DTYPES`` / ``MODES`` a file runs every precision / mode the run
asks for.  A file runs no row, and is skipped with a reason (:meth:`Workload.skip_reason`), where a package
of its ``REQUIRES`` is not installed or where the run asks for none of its declared rows; a file whose
building raises :class:`ImportError` is skipped too (:func:`import_skip_reason`).  A skip is not a failure.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from .config import MODES, PRECISIONS
from .errors import SuiteError

#: The parts every benchmark model file must define.
LAYOUT: tuple[str, ...] = ("Model", "get_inputs", "get_init_inputs")

#: The optional declarations of a model file (module docstring) and the names each may hold (``None``: any).
DECLARATIONS: dict[str, tuple[str, ...] | None] = {
    "DTYPES": tuple(PRECISIONS), "MODES": tuple(MODES), "REQUIRES": None,
}


@dataclass(frozen=True)
class NamedSuite:
    """A ``--suite`` name: ``files`` (run in this order) inside the folder ``demos/<folder>/``."""

    folder: str
    files: tuple[str, ...]
    description: str


#: Named suites, in the order ``--help`` lists them.
SUITES: dict[str, NamedSuite] = {
    "seeds": NamedSuite("seeds", (
        "convt3d_leaky_mul_leaky_maxpool.py",
        "conv2d_mul_leaky_gelu.py",
        "convt2d_global_mean_bias_logsumexp.py",
        "conv2d_mul_leaky_gelu_small.py",
        "convt2d_global_mean_bias_logsumexp_small.py",
    ), "three multi-op conv pipelines, full size then small"),
    "seeds-small": NamedSuite("seeds", (
        "conv2d_mul_leaky_gelu_small.py",
        "convt2d_global_mean_bias_logsumexp_small.py",
    ), "the small variants of the seeds suite's Conv2d and ConvTranspose2d pipelines"),
    "convnets": NamedSuite("convnets", (
        "conv2d_64_k3_relu.py",
        "conv2d_128_256_k3_s2_relu.py",
        "conv2d_256_k3_relu_maxpool.py",
        "conv2d_depthwise_144_k3_relu6.py",
        "conv2d_128_k3_silu.py",
        "convt2d_128_64_k2_s2_relu.py",
        "convt2d_256_128_k4_s2_relu.py",
        "convt2d_64_3_k4_s2_tanh.py",
        "conv3d_32_64_k3_leaky_maxpool.py",
        "convt3d_64_32_k2_s2_relu.py",
        "conv1d_80_256_k5_gelu.py",
        "conv2d_512_k3_global_mean.py",
        "conv2d_64_k3_relu_batch1.py",
        "conv2d_128_k3_silu_batch1.py",
        "conv1d_80_256_k5_gelu_batch1.py",
        "conv2d_64_k3_relu_channels_last.py",
        "conv2d_256_k3_relu_maxpool_channels_last.py",
        "convt2d_128_64_k2_s2_relu_channels_last.py",
    ), "conv layers of real networks with their activation or pooling"),
    "families": NamedSuite("families", (
        "conv2d_64_k3_batchnorm_train_relu.py",
        "convt2d_64_32_k4_s2_groupnorm_silu.py",
        "upsample2x_conv2d_128_k3_groupnorm_silu.py",
        "conv3d_16_32_k3_softmax_mul.py",
        "conv2d_64_128_k3_min_tanh.py",
        "conv2d_3_64_k7_s2_batchnorm_eval_relu_maxpool.py",
        "conv2d_3_64_k7_s2_batchnorm_train_relu_maxpool.py",
        "conv2d_64_k3_layernorm_chw_relu.py",
    ), "one conv + normalization or channel reduction workload per pattern family"),
    "realnets": NamedSuite("realnets", (
        "resnet50.py",
        "efficientnet_b0.py",
        "r3d_18.py",
        "wav2vec2_base.py",
        "sd_vae_decoder.py",
        "dcgan_generator.py",
    ), "whole networks (torchvision, torchaudio, diffusers, DCGAN); a missing library skips its files"),
}

#: Environment variable naming the folder that holds the named suites' folders (``seeds/``, ``convnets/``).
DEMOS_ENV = "FUSION_DEMOS_DIR"


@dataclass(frozen=True)
class Workload:
    """One loaded benchmark model file.

    ``name`` is the file's stem and is unique within a suite; ``module`` is the executed file.  Building
    the model and inputs is :meth:`build`'s job so that loading a suite stays cheap and side-effect free.
    ``dtypes``, ``modes``, ``requires`` and ``infer_eval`` are the file's declarations (module
    docstring; ``None`` / empty / False where it makes none).
    """

    name: str
    path: Path
    module: ModuleType
    dtypes: tuple[str, ...] | None = None
    modes: tuple[str, ...] | None = None
    requires: tuple[str, ...] = ()
    infer_eval: bool = False

    def rows(self, dtypes: Sequence[str], modes: Sequence[str]) -> list[tuple[str, str]]:
        """The (dtype, mode) rows of a run asking for ``dtypes`` x ``modes``: in that order, kept to the
        file's declared ``DTYPES`` and ``MODES``."""
        return [(d, m) for d in dtypes if self.dtypes is None or d in self.dtypes
                for m in modes if self.modes is None or m in self.modes]

    def missing(self) -> tuple[str, ...]:
        """The packages of ``REQUIRES`` that are not installed (found by ``importlib.util.find_spec``)."""
        return tuple(name for name in self.requires if not _installed(name))

    def skip_reason(self, dtypes: Sequence[str], modes: Sequence[str]) -> str:
        """Why a run asking for ``dtypes`` x ``modes`` runs no row of this file (``""`` where it runs some),
        known without building it: ``"needs torchvision, not installed"``, or that the run asks for none
        of the rows it declares."""
        missing = self.missing()
        if missing:
            return f"needs {' and '.join(missing)}, not installed"
        if self.rows(dtypes, modes):
            return ""
        declared = {"DTYPES": (self.dtypes, dtypes), "MODES": (self.modes, modes)}
        disjoint = {name: (own, asked) for name, (own, asked) in declared.items()
                    if own is not None and not set(own) & set(asked)}
        files = " and ".join(f"{name} {','.join(own)}" for name, (own, _) in disjoint.items())
        runs = " and ".join(",".join(asked) for _, asked in disjoint.values())
        return f"its file declares {files}; the run asks for {runs}"

    def set_mode(self, model: torch.nn.Module, mode: str) -> torch.nn.Module:
        """``model`` put in the state a ``mode`` row runs it in, and returned: with ``INFER_EVAL``, eval
        mode for ``infer`` (running statistics, no dropout) and training mode for ``train``; otherwise
        left as built.  The one place the benchmark and the tools that run a file's rows take it from."""
        if self.infer_eval:
            model.train(mode != "infer")
        return model

    def build(self, seed: int) -> tuple[torch.nn.Module, list[Any]]:
        """Construct ``Model(*get_init_inputs())`` and ``get_inputs()`` on CPU under ``torch.manual_seed(seed)``.

        The same seed gives the same parameters and inputs on every call, which is what makes every
        backend see identical weights.  Raises whatever the model file raises.
        """
        torch.manual_seed(seed)
        init = list(self.module.get_init_inputs())
        model = self.module.Model(*init)
        if not isinstance(model, torch.nn.Module):
            raise SuiteError(f"{self.path}: Model(*get_init_inputs()) returned {type(model).__name__}, "
                             "not a torch.nn.Module")
        torch.manual_seed(seed + 1)
        inputs = self.module.get_inputs()
        if not isinstance(inputs, (list, tuple)):
            raise SuiteError(f"{self.path}: get_inputs() must return a list or tuple of forward arguments, "
                             f"got {type(inputs).__name__}")
        return model, list(inputs)


def demos_dir_candidates() -> list[Path]:
    """Where the ``demos`` folder may be, in order: ``$FUSION_DEMOS_DIR``, next to the package, under cwd."""
    candidates: list[Path] = []
    env = os.environ.get(DEMOS_ENV)
    if env:
        candidates.append(Path(env).expanduser())
    repo_root = Path(__file__).resolve().parents[2]  # <repo>/fusion_backend/bench/suite.py -> <repo>
    candidates.append(repo_root / "demos")
    candidates.append(Path.cwd() / "demos")
    return candidates


def suite_dir(folder: str) -> Path:
    """``<demos>/<folder>`` for the first ``demos`` candidate that has it, or :class:`SuiteError` listing
    where it looked."""
    candidates = [c / folder for c in demos_dir_candidates()]
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    looked = ", ".join(str(c) for c in candidates)
    raise SuiteError(
        f"the named suites are read from demos/{folder}/ of the fusion repository, which is not next to the "
        f"installed package (looked in: {looked}). Run from a source checkout (pip install -e .), set "
        f"{DEMOS_ENV} to the repository's demos/ folder, or pass --suite PATH to your own model files."
    )


def load_workload(path: str | os.PathLike[str]) -> Workload:
    """Execute one model file and check it has the benchmark layout.

    Raises :class:`SuiteError` if the file does not exist, fails to import (the message carries the
    exception), or lacks any of :data:`LAYOUT` (the message names every missing one).  The file's folder
    is on ``sys.path`` while it runs, so it may import helpers next to it.
    """
    path = Path(path)
    if not path.is_file():
        raise SuiteError(f"model file {path} does not exist")
    if path.suffix != ".py":
        raise SuiteError(f"model file {path} is not a .py file")
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    module_name = f"fusion_bench_workload_{path.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    if spec is None or spec.loader is None:
        raise SuiteError(f"cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    folder = str(resolved.parent)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    # Registered so that tools resolving ``Model.__module__`` (pickling, Dynamo's source lookups) find it.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise SuiteError(f"importing {path} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        if added:
            sys.path.remove(folder)
    missing = [name for name in LAYOUT if not callable(getattr(module, name, None))]
    if missing:
        sys.modules.pop(module_name, None)
        raise SuiteError(
            f"{path} is not a benchmark model file: it does not define {', '.join(missing)} (a model file "
            "defines Model, an nn.Module class; get_inputs(), the forward's arguments; and "
            "get_init_inputs(), Model's constructor arguments)"
        )
    try:
        declared = {name: _declaration(module, name, allowed) for name, allowed in DECLARATIONS.items()}
        infer_eval = getattr(module, "INFER_EVAL", False)
        if not isinstance(infer_eval, bool):
            raise SuiteError(f"INFER_EVAL must be True or False, got {infer_eval!r}")
    except SuiteError as exc:
        sys.modules.pop(module_name, None)
        raise SuiteError(f"{path}: {exc}") from None
    return Workload(name=path.stem, path=resolved, module=module, dtypes=declared["DTYPES"],
                    modes=declared["MODES"], requires=declared["REQUIRES"] or (), infer_eval=infer_eval)


def _declaration(module: ModuleType, name: str, allowed: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """The module's ``name`` declaration as a tuple (``None`` if absent); :class:`SuiteError` unless it is
    a non-empty tuple or list of distinct strings, each in ``allowed`` (where given)."""
    if not hasattr(module, name):
        return None
    value = getattr(module, name)
    if not isinstance(value, (tuple, list)) or not value or not all(isinstance(v, str) for v in value):
        raise SuiteError(f"{name} must be a non-empty tuple of strings, got {value!r}")
    if len(set(value)) != len(value):
        raise SuiteError(f"{name} names an entry twice: {value!r}")
    unknown = [v for v in value if allowed is not None and v not in allowed]
    if unknown:
        raise SuiteError(f"{name} names {', '.join(map(repr, unknown))}; "
                         f"choose from {', '.join(allowed or ())}")
    return tuple(value)


def _installed(package: str) -> bool:
    """Whether ``import package`` can find it (without importing it)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module entry of None
        return False


def import_skip_reason(exc: ImportError) -> str:
    """The skip reason of a workload whose building raised ``exc``: ``"needs diffusers, not installed"``
    for a missing module, else what failed (a library installed in a version that lacks a name)."""
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return f"needs {exc.name.partition('.')[0]}, not installed"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"importing a library failed: {first}"


def _files_of(entry: str) -> list[Path]:
    if entry in SUITES:
        named = SUITES[entry]
        folder = suite_dir(named.folder)
        files = [folder / name for name in named.files]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise SuiteError(f"suite {entry!r}: {folder} lacks {', '.join(absent)}")
        return files
    path = Path(entry).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.glob("*.py") if not p.name.startswith("_"))
        if not files:
            raise SuiteError(f"folder {path} holds no model files (*.py not starting with _)")
        return files
    if path.exists() or path.suffix == ".py":
        return [path]
    raise SuiteError(f"--suite entry {entry!r} is neither a suite name ({', '.join(SUITES)}) nor an "
                     "existing file or folder")


def resolve_suite(spec: str | Sequence[str]) -> list[Workload]:
    """Load every workload of ``spec`` (comma-separated string or list of names/files/folders).

    Duplicate files are loaded once; two different files with the same stem are an error, because the
    stem names the workload in every table and in the JSON report.
    """
    entries = [e.strip() for e in spec.split(",")] if isinstance(spec, str) else [str(e) for e in spec]
    entries = [e for e in entries if e]
    if not entries:
        raise SuiteError("--suite is empty; give a suite name, a model file or a folder")
    workloads: list[Workload] = []
    seen: dict[str, Path] = {}
    for entry in entries:
        for file in _files_of(entry):
            workload = load_workload(file)
            if workload.name in seen:
                if seen[workload.name] == workload.path:
                    continue
                raise SuiteError(f"two model files are named {workload.name!r}: {seen[workload.name]} and "
                                 f"{workload.path}; rename one")
            seen[workload.name] = workload.path
            workloads.append(workload)
    return workloads


def filter_workloads(workloads: Sequence[Workload], patterns: str | None) -> list[Workload]:
    """Keep workloads whose name matches any comma-separated pattern (glob if it has ``*?[``, else substring)."""
    if not patterns:
        return list(workloads)
    pats = [p.strip() for p in patterns.split(",") if p.strip()]

    def keep(name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) if any(c in p for c in "*?[") else p in name for p in pats)

    return [w for w in workloads if keep(w.name)]
