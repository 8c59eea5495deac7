"""Data-parallel training with ``backend="fusion"``: DDP or FSDP2, compiled, checked against one process.

    torchrun --nproc-per-node 2 demos/distributed_train.py                        # DDP; CUDA + NCCL, else CPU + gloo
    torchrun --nproc-per-node 2 demos/distributed_train.py --wrap fsdp2 \\
        --model demos/seeds/convt3d_leaky_mul_leaky_maxpool.py --steps 20 --time 30
    torchrun --nproc-per-node 2 demos/distributed_train.py --model conv-batchnorm --optimizer adamw
    torchrun --nproc-per-node 2 demos/distributed_train.py --model demos/realnets/resnet18.py   # torchvision

Every process trains on its shard of each global batch; rank 0 then computes the same data-parallel
training eagerly in one process, in float32 and in float64, and checks the distributed run's losses
and its parameter updates (final minus initial parameters) with the project's yardstick
(``fusion_backend.testing.compare``: error vs float64 within ``max(fp32 tolerance, 2 x eager's own
error)``).  It prints the figures and ``parity OK``, or raises; it also raises if the float64 reference
itself ends in infinities or NaNs (a learning rate too large: nothing to check).  TF32 is off while
parity is checked.  Over the steps float32 and float64 part: each step's rounding changes the next
step's gradients, the more the deeper the network and the larger the step (an input near a ReLU's or a
max-pool's kink may go either way), so eager's own error, and with it what the check lets pass, grows
with the steps: the output says so when it passes ``DRIFT_NOTE`` (1e-2), and a deep network is best
checked over few steps with a small learning rate (``TRAIN_STEPS``, ``TRAIN_LR`` below).

The reference runs each process's shard through its own forward, one shard after the other, and
averages the shards' gradients before each optimizer step: what DDP and FSDP2 compute (each rank's
loss is the mean over its shard; DDP's all-reduce and FSDP2's reduce-scatter average the gradients).
For a model whose samples do not interact this equals one forward on the whole batch.  For one whose
do, BatchNorm in training mode above all, it is the only correct reference: under DDP or FSDP2 each
rank normalises with its own shard's statistics, so a whole-batch forward differs by the difference
between shard and batch statistics.  Converting the model to SyncBatchNorm (whole-batch statistics in
the distributed run) instead would change the model under test (each BatchNorm becomes collectives in
its forward and backward, which is not what a DDP user without the conversion runs) and cannot run on
CPU (SyncBatchNorm rejects CPU tensors, so the gloo test could not check it).  The output says which
statistics the reference uses when the model has a BatchNorm with batch statistics; a model with
SyncBatchNorm is refused.  BatchNorm's running statistics (buffers) are not compared: in training mode
they do not change what the model computes, and DDP keeps rank 0's (broadcast at every forward) while
the serial reference updates them once per shard.

Training settings (the parity check's and the timed steps'), each overridable on the command line:

- ``--optimizer {sgd,adamw}``, ``--lr``, ``--momentum`` (SGD only), ``--weight-decay``.  Defaults: the
  model's own (below), else SGD with lr 0.01 and momentum 0.9, or AdamW with lr 1e-3 and weight decay
  0.01.  The built-in ``two-pipelines`` trains with SGD lr 0.1, momentum 0.9.
- ``--loss {auto,mse,cross-entropy}``: ``auto`` takes cross-entropy against random class labels for
  an output of shape (batch, classes) with at least two classes (a classifier's logits: a squared
  error against random numbers is not what a classifier trains with), else the mean squared error
  against a random normal target of the output's shape.
- ``--steps``: the steps checked; default 20.
- A benchmark file may declare its training defaults as optional module attributes: ``TRAIN_OPTIMIZER``
  (``"sgd"`` or ``"adamw"``), ``TRAIN_LR``, ``TRAIN_MOMENTUM``, ``TRAIN_WEIGHT_DECAY``, ``TRAIN_LOSS``
  (``"auto"``, ``"mse"`` or ``"cross-entropy"``) and ``TRAIN_STEPS``.  The numbers are defaults for
  the file's optimizer only: ``--optimizer`` naming another one takes that optimizer's defaults above.
  ``demos/realnets/resnet18.py`` (torchvision's ResNet-18, 32 images per GPU on two) declares SGD lr
  0.001, momentum 0.9, weight decay 1e-4, cross-entropy and 3 steps; its docstring says why.

Wrappers and models:

- ``--wrap ddp``: ``torch.compile(DistributedDataParallel(model))``.  Dynamo's DDPOptimizer splits the
  graph at the gradient buckets' boundaries and hands each piece to the backend; the default
  ``--bucket-cap-mb`` (about 100 bytes) puts a boundary between every two layers with parameters, so
  a pattern whose multiplier is a parameter is cut between its conv and its epilogue.
- ``--wrap fsdp2``: ``fully_shard(torch.compile(model))``, as one shards compiled blocks: FSDP2's
  hooks (all-gather before the forward, reduce-scatter after the backward) run outside the compiled
  graph, which sees the unsharded parameters.
- ``--model``: ``two-pipelines`` (a small built-in model with two conv pipelines, for CPU),
  ``conv-batchnorm`` (a small built-in classifier with a BatchNorm in training mode, for CPU) or the
  path of a benchmark file (``Model``, ``get_inputs()``, ``get_init_inputs()``, e.g.
  ``demos/seeds/*.py``): ``get_inputs()`` gives one global batch, split along dim 0 between the
  processes.
- ``--per-process-batch [K]``: each process trains on K draws of ``get_inputs()`` (default K = 1;
  the global batch is ``K x world`` draws), as one scales a one-GPU training run out with its batch
  per GPU kept, or grows the batch per GPU until the GPU's work, not the host's, sets the step's
  time; without it ``get_inputs()`` is the global batch, split among the processes.
- ``--time K``: then K timed steps each of eager, Inductor and fusion under the same wrapper, with the
  same optimizer and loss, PyTorch's default TF32 settings and DDP's default bucket size
  (``--time-bucket-cap-mb``; the tiny buckets of the parity check are a test of graph splitting, not a
  setting anyone trains with).  The steps run back to back, as a training loop runs them (the host
  queues the next step while the GPU computes this one), in rounds of ``TIMED_ROUND`` steps between
  two synchronisations, the backends' rounds interleaved; time per step = the slowest rank's round /
  its steps, median over the rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

DDP_FIRST_BUCKET_BYTES = dist._DEFAULT_FIRST_BUCKET_BYTES  # DDP's own, before any run shrinks it
OPTIMIZERS = ("sgd", "adamw")
LOSSES = ("auto", "mse", "cross-entropy")
# Each optimizer's defaults where neither the command line nor the model says otherwise.
OPTIMIZER_DEFAULTS: dict[str, dict[str, float]] = {
    "sgd": {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.0},
    "adamw": {"lr": 1e-3, "weight_decay": 0.01},
}
TRAIN_ATTRIBUTES = ("TRAIN_OPTIMIZER", "TRAIN_LR", "TRAIN_MOMENTUM", "TRAIN_WEIGHT_DECAY", "TRAIN_LOSS",
                    "TRAIN_STEPS")
DEFAULT_STEPS = 20
# Eager float32's own error (vs float64) in a parameter update above which the output says how little
# the check can then see.
DRIFT_NOTE = 1e-2
# Steps timed between two synchronisations: a synchronisation per step would add the host's launch
# latency of every step to the GPU's time (what no training loop waits for), and on a small per-GPU
# batch make every backend read the same host-bound time.
TIMED_ROUND = 10


class TwoPipelines(nn.Module):
    """Conv2d -> x multiplier -> leaky -> max_pool2d, then ConvTranspose2d -> gelu -> mean."""

    TRAIN_LR = 0.1
    TRAIN_MOMENTUM = 0.9

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 32, 3, padding=1)
        self.multiplier = nn.Parameter(torch.randn(32, 1, 1) * 0.5 + 1)
        self.up = nn.ConvTranspose2d(32, 4, 2, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.max_pool2d(F.leaky_relu(self.conv(x) * self.multiplier, 0.1), 2)
        return F.gelu(self.up(y)).mean((1, 2, 3))


class ConvBatchNorm(nn.Module):
    """Conv2d (no bias) -> BatchNorm2d in training mode -> ReLU -> global mean -> Linear: 10 logits."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.bn(self.conv(x))).mean((2, 3)))


BUILTIN_MODELS: dict[str, type[nn.Module]] = {"two-pipelines": TwoPipelines, "conv-batchnorm": ConvBatchNorm}


class Workload:
    """A model factory and its global batches: ``make_model()`` (same parameters in every process,
    on CPU), ``batch(step)`` (a list of CPU tensors, the same in every process) and ``declared`` (the
    ``TRAIN_*`` training defaults the model declares: a benchmark file's module attributes, a built-in
    model's class attributes)."""

    def __init__(self, spec: str, world: int, per_process_batch: int = 0) -> None:
        source: Any
        if spec in BUILTIN_MODELS:
            self.name = spec
            source = self.make_model = BUILTIN_MODELS[spec]
            self._inputs: Callable[[], list[Any]] = lambda: [torch.randn(4 * world, 3, 12, 12)]
        else:
            path = Path(spec)
            loader = importlib.util.spec_from_file_location(path.stem, path)
            if loader is None or not path.is_file():
                raise SystemExit(f"--model: no benchmark file at {spec!r} "
                                 f"(or one of {', '.join(BUILTIN_MODELS)})")
            source = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(source)  # type: ignore[union-attr]
            self.name = path.stem
            self.make_model = lambda: source.Model(*source.get_init_inputs())
            self._inputs = source.get_inputs
        self.declared: dict[str, Any] = {k: getattr(source, k) for k in TRAIN_ATTRIBUTES
                                         if hasattr(source, k)}
        if per_process_batch < 0:
            raise SystemExit(f"--per-process-batch takes a positive number of batches, not {per_process_batch}")
        if per_process_batch:
            one = self._inputs
            self._inputs = lambda: _concatenated([one() for _ in range(per_process_batch * world)])

    def model(self) -> nn.Module:
        torch.manual_seed(0)
        return self.make_model()

    def batch(self, step: int) -> list[Any]:
        torch.manual_seed(1000 + step)
        return self._inputs()


def _concatenated(batches: Sequence[Sequence[Any]]) -> list[Any]:
    """One global batch from one batch per process: tensors with a batch dimension concatenated along
    dim 0, other inputs (which must agree) taken from the first."""
    first = batches[0]
    return [torch.cat([b[i] for b in batches]) if isinstance(t, torch.Tensor) and t.dim() else t
            for i, t in enumerate(first)]


@dataclass(frozen=True)
class Training:
    """The optimizer and loss of every training step of the demo (parity run, reference and timing).
    ``momentum`` is SGD's; AdamW keeps torch's default betas and eps."""

    optimizer: str = "sgd"
    lr: float = OPTIMIZER_DEFAULTS["sgd"]["lr"]
    momentum: float = OPTIMIZER_DEFAULTS["sgd"]["momentum"]
    weight_decay: float = 0.0
    loss: str = "auto"

    def make_optimizer(self, parameters: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(parameters, lr=self.lr, momentum=self.momentum,
                                   weight_decay=self.weight_decay)
        return torch.optim.AdamW(parameters, lr=self.lr, weight_decay=self.weight_decay)

    def __str__(self) -> str:
        if self.optimizer == "sgd":
            text = f"SGD lr {self.lr:g}, momentum {self.momentum:g}"
            text += f", weight decay {self.weight_decay:g}" if self.weight_decay else ""
        else:
            text = f"AdamW lr {self.lr:g}, weight decay {self.weight_decay:g}"
        return f"{text}, {self.loss} loss"


def training_settings(args: argparse.Namespace, declared: Mapping[str, Any],
                      where: str = "the model") -> Training:
    """The training of a run: the command line's settings (``None`` where not given) over the model's
    ``declared`` ``TRAIN_*`` defaults over ``OPTIMIZER_DEFAULTS``.  The model's numbers belong to its
    optimizer (``TRAIN_OPTIMIZER``, else SGD) and apply only when the run uses that optimizer: a
    learning rate tuned for SGD is no learning rate for AdamW.  Raises ``SystemExit`` on a
    declared value out of range or on ``--momentum`` with AdamW (which has none)."""
    own = declared.get("TRAIN_OPTIMIZER", "sgd")
    loss = declared.get("TRAIN_LOSS", "auto")
    if own not in OPTIMIZERS or loss not in LOSSES:
        raise SystemExit(f"{where}: TRAIN_OPTIMIZER must be one of {OPTIMIZERS} "
                         f"and TRAIN_LOSS one of {LOSSES}")
    optimizer = args.optimizer or own
    settings = dict(OPTIMIZER_DEFAULTS[optimizer])
    if optimizer == own:
        for key in settings:
            if f"TRAIN_{key.upper()}" in declared:
                settings[key] = float(declared[f"TRAIN_{key.upper()}"])
    if optimizer != "sgd" and args.momentum is not None:
        raise SystemExit("--momentum is SGD's; AdamW keeps its default betas")
    for key in settings:
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    if not settings["lr"] > 0:
        raise SystemExit(f"the learning rate must be positive, not {settings['lr']}")
    return Training(optimizer=optimizer, loss=args.loss or loss, **settings)


def parity_steps(args: argparse.Namespace, declared: Mapping[str, Any]) -> int:
    """``--steps``, else the model's ``TRAIN_STEPS``, else ``DEFAULT_STEPS``."""
    steps = args.steps if args.steps is not None else int(declared.get("TRAIN_STEPS", DEFAULT_STEPS))
    if steps < 1:
        raise SystemExit(f"the parity check needs at least one step, not {steps}")
    return steps


def loss_kind(choice: str, out: torch.Tensor) -> str:
    """The loss ``choice`` means for ``out``: ``auto`` is cross-entropy for a (batch, classes) output
    with at least two classes, mean squared error otherwise."""
    if choice != "auto":
        return choice
    return "cross-entropy" if out.dim() == 2 and out.shape[1] >= 2 else "mse"


def shard(batch: Sequence[Any], rank: int, world: int, device: str) -> list[Any]:
    """This process's part of a global batch: tensors split along dim 0 (contiguous), others as is."""
    size = batch[0].shape[0]
    if size % world:
        raise SystemExit(f"the global batch ({size}) must divide among {world} processes")
    part = size // world
    return [t[rank * part:(rank + 1) * part].to(device) if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == size
            else t for t in batch]


def shard_target(out: torch.Tensor, step: int, rank: int, world: int, kind: str) -> torch.Tensor:
    """Rank ``rank``'s rows of batch ``step``'s random target (drawn whole on the CPU from the step, so
    that every process and the single-process reference see the same global target): class labels
    for cross-entropy, else normal values like ``out``."""
    gen = torch.Generator().manual_seed(2000 + step)
    part = out.shape[0]
    if kind == "cross-entropy":
        full = torch.randint(out.shape[1], (part * world,), generator=gen)
        return full[rank * part:(rank + 1) * part].to(out.device)
    full = torch.randn((part * world, *out.shape[1:]), generator=gen)
    return full[rank * part:(rank + 1) * part].to(device=out.device,
                                                   dtype=torch.promote_types(out.dtype, torch.float32))


def train_step(optimizer: torch.optim.Optimizer, step_fn: Callable[..., torch.Tensor],
               shards: Sequence[tuple[int, Sequence[Any]]],
               target: Callable[[torch.Tensor, int, str], torch.Tensor],
               loss: str) -> tuple[torch.Tensor, str]:
    """One optimizer step on ``shards`` ((rank, inputs) pairs), run one after the other, each with its
    own forward, their gradients averaged (a distributed process passes its own shard and leaves the
    averaging to DDP/FSDP2).  Returns the mean of the shards' losses, each the mean over its rows of
    ``loss`` against ``target(output, rank, kind)`` (with equal shards: the batch's loss), and the
    loss's kind (``loss_kind``)."""
    optimizer.zero_grad(set_to_none=True)
    values = []
    for rank, inputs in shards:
        out = step_fn(*inputs)
        out = out.to(torch.promote_types(out.dtype, torch.float32))
        kind = loss_kind(loss, out)
        value = (F.cross_entropy if kind == "cross-entropy" else F.mse_loss)(out, target(out, rank, kind))
        (value / len(shards)).backward()
        values.append(value.detach())
    optimizer.step()
    return torch.stack(values).mean(), kind


def train(model: Callable[..., torch.Tensor], parameters: Iterable[nn.Parameter], workload: Workload,
          training: Training, steps: int, ranks: Sequence[int], world: int, device: str,
          dtype: torch.dtype | None = None) -> tuple[list[float], str]:
    """``steps`` steps of ``training`` on the shards ``ranks`` of each global batch (in ``dtype``
    where given: floating inputs are converted); the losses (means over those shards) and the loss's
    kind."""
    optimizer = training.make_optimizer(parameters)
    losses, kind = [], training.loss
    for step in range(steps):
        batch = workload.batch(step)
        shards = [(r, [t.to(dtype) if dtype and isinstance(t, torch.Tensor) and t.is_floating_point() else t
                       for t in shard(batch, r, world, device)]) for r in ranks]
        loss, kind = train_step(optimizer, model, shards,
                                lambda out, r, k, s=step: shard_target(out, s, r, world, k), training.loss)
        losses.append(loss.item())
    return losses, kind


def batch_statistics_note(model: nn.Module) -> str | None:
    """A sentence on the BatchNorm semantics the reference follows, for a model with a BatchNorm
    that normalises with batch statistics (training mode, or no running statistics); ``None`` for
    one without.  Raises ``SystemExit`` for SyncBatchNorm: its whole-batch statistics are a collective
    that a one-process reference cannot run (nor would the per-shard reference compute them)."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
             and (m.training or not m.track_running_stats)]
    if any(isinstance(m, nn.SyncBatchNorm) for m in norms):
        raise SystemExit("SyncBatchNorm in training mode: the one-process reference cannot compute its "
                         "statistics")
    if not norms:
        return None
    return (f"{len(norms)} BatchNorm(s) with batch statistics: the reference normalises each process's "
            "shard with that shard's statistics, as DDP and FSDP2 do (not the whole batch's, as "
            "SyncBatchNorm would)")


def wrap(model: nn.Module, how: str, device: str, backend: str, bucket_cap_mb: float,
         options: dict[str, Any] | None, mode: str | None = None) -> Callable[..., torch.Tensor]:
    """The step function of ``model`` under DDP or FSDP2, compiled with ``backend`` ('eager': not)
    in ``torch.compile``'s ``mode``."""
    compile_kwargs: dict[str, Any] = {"backend": backend, "mode": mode}
    if backend == "fusion" and options:
        compile_kwargs["options"] = options
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        # DDPOptimizer refuses a first bucket (DDP's default: 1 MiB) larger than the others; a
        # small model fits in one 1 MiB bucket, so the first bucket shrinks with the others.
        dist._DEFAULT_FIRST_BUCKET_BYTES = min(DDP_FIRST_BUCKET_BYTES, int(bucket_cap_mb * 2**20))
        ddp = DDP(model, device_ids=[torch.device(device).index] if device.startswith("cuda") else None,
                  bucket_cap_mb=bucket_cap_mb)
        return ddp if backend == "eager" else torch.compile(ddp, **compile_kwargs)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    step_fn = model if backend == "eager" else torch.compile(model, **compile_kwargs)
    # The mesh names the device type: left to itself, FSDP2 takes CUDA's whenever CUDA is present,
    # also for a CPU model on a gloo group.
    fully_shard(step_fn, mesh=init_device_mesh(torch.device(device).type, (dist.get_world_size(),)))
    return step_fn


def full_parameters(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter, unsharded (a collective under FSDP2: every process must call it)."""
    out = []
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append((name.replace("_orig_mod.", "").replace("module.", ""), full.detach().cpu()))
    return out


@contextlib.contextmanager
def tf32_off() -> Iterator[None]:
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def check_parity(workload: Workload, how: str, rank: int, world: int, device: str, steps: int,
                 bucket_cap_mb: float, options: dict[str, Any] | None = None,
                 training: Training | None = None, mode: str | None = None) -> list[Any]:
    """Train with ``backend="fusion"`` under ``how`` and compare with the same data-parallel training
    computed serially by one eager process on rank 0 (see the module's docstring; raises
    ``AssertionError`` with the figures on a mismatch, or if the float64 reference itself ends in
    non-finite numbers: then the learning rate is too large for a check).  ``training`` defaults to
    the workload's declared settings.  Returns this process's reports."""
    from fusion_backend.report import collect_reports
    from fusion_backend.testing import compare, relative_error

    if training is None:
        training = training_settings(parse_args([]), workload.declared, workload.name)
    with tf32_off():
        initial = workload.model()
        note = batch_statistics_note(initial)
        model = copy.deepcopy(initial).to(device)
        step_fn = wrap(model, how, device, "fusion", bucket_cap_mb, options, mode)
        with collect_reports() as reports:
            losses, kind = train(step_fn, list(step_fn.parameters()), workload, training, steps, [rank],
                                 world, device)
        totals = torch.tensor(losses, dtype=torch.float64, device=device)
        dist.all_reduce(totals)
        got_params = full_parameters(step_fn)
        if rank == 0:
            start = dict(initial.named_parameters())
            want, want_params, ref, ref_params = [], [], [], []
            for dtype, loss_out, params_out in ((torch.float32, want, want_params), (torch.float64, ref, ref_params)):
                eager = copy.deepcopy(initial).to(device=device, dtype=dtype)
                loss_out.extend(train(eager, list(eager.parameters()), workload, training, steps,
                                      range(world), world, device, dtype)[0])
                params_out.extend((n, p.detach().cpu()) for n, p in eager.named_parameters())
            if not all(math.isfinite(v) for v in ref) or not all(p.isfinite().all() for _, p in ref_params):
                raise AssertionError(f"the float64 reference diverged ({training}; losses {ref}): "
                                     "no parity to check, lower --lr")
            rows, failures = [], []
            got = totals.cpu() / world  # equal shards: the mean of the shard losses is the batch's loss
            checks = [("losses", got, torch.tensor(want, dtype=torch.float64),
                       torch.tensor(ref, dtype=torch.float64))]
            for (name, g), (_, w), (_, r) in zip(got_params, want_params, ref_params, strict=True):
                p0 = start[name].detach()
                checks.append((f"{name} update", g.double() - p0.double(), w.double() - p0.double(), r - p0.double()))
            drift = (0.0, "")
            for name, g, w, r in checks:
                problem = compare(name, g, w, tol=1e-5, reference=r)
                eager_error = relative_error(w, r)
                rows.append(f"  {name:<28} vs float64: distributed {relative_error(g, r):.2e}, "
                            f"eager {eager_error:.2e}{'  MISMATCH' if problem else ''}")
                drift = max(drift, (eager_error, name))
                if problem:
                    failures.append(problem)
            # The whole parameter vector's change over its norm: a tensor initialised to zero (a
            # BatchNorm's bias) has no relative change of its own.
            moved = math.sqrt(sum((p.double() - start[n].detach().double()).square().sum().item()
                                  for n, p in got_params)
                              / max(sum(p.detach().double().square().sum().item() for p in start.values()),
                                    1e-300))
            print(f"{how} parity on {world} processes ({device}), {workload.name}, {steps} steps of "
                  f"{replace(training, loss=kind)} (parameters moved {moved:.2e} of their norm):\n"
                  + (f"  {note}\n" if note else "") + "\n".join(rows))
            if drift[0] > DRIFT_NOTE:
                # The float32 and float64 runs part over the steps (see the module's docstring); the
                # yardstick (2 x eager's error) then passes any smaller difference.
                print(f"  eager float32 itself is {drift[0]:.1e} off float64 ({drift[1]}) after {steps} "
                      "steps: differences below about twice that cannot show; fewer --steps or a lower "
                      "--lr sharpen the check")
            if failures:
                raise AssertionError("\n".join(failures))
            print(f"parity OK: final loss {got[-1].item():.6f} (eager {want[-1]:.6f})")
        return list(reports)


def time_backends(workload: Workload, how: str, rank: int, world: int, device: str, timed_steps: int,
                  bucket_cap_mb: float, backends: Sequence[str] = ("eager", "inductor", "fusion"),
                  training: Training | None = None, mode: str | None = None) -> None:
    """Rank 0 prints, per backend, the first step's seconds (compilation) and the median ms per step
    of ``training``'s step (default: the workload's declared settings) on two alternating batches, the
    steps run back to back in rounds of ``TIMED_ROUND`` (at least one round), the backends' rounds
    interleaved, and what fusion's timed run decided."""
    from fusion_backend.frame_room import call_with_frame_room
    from fusion_backend.report import collect_reports

    if training is None:
        training = training_settings(parse_args([]), workload.declared, workload.name)
    batches = [shard(workload.batch(s), rank, world, device) for s in range(2)]
    targets: dict[int, torch.Tensor] = {}  # drawn once: a CPU draw per step would be timed too

    def target(step: int, out: torch.Tensor, kind: str) -> torch.Tensor:
        if step not in targets:
            targets[step] = shard_target(out, step, rank, world, kind)
        return targets[step]

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    kind = training.loss

    def timed(step_fn: Callable[..., torch.Tensor], optimizer: torch.optim.Optimizer, steps: range) -> float:
        """Seconds of the slowest rank for ``steps``, run back to back after a barrier."""
        dist.barrier()

        def run_steps() -> float:  # with room on the frame stack, as the benchmark's loops (frame_room.py)
            nonlocal kind
            sync()
            start = time.perf_counter()
            for step in steps:
                _, kind = train_step(optimizer, step_fn, [(rank, batches[step % 2])],
                                     lambda out, _, k, s=step % 2: target(s, out, k), training.loss)
            sync()
            return time.perf_counter() - start

        elapsed = torch.tensor(call_with_frame_room(run_steps), dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return elapsed.item()

    decided = ""
    n_rounds = max(timed_steps // TIMED_ROUND, 1)
    # Code compiled before (the parity check's, with its tiny buckets and TF32 off) must not be reused:
    # Dynamo's guards do not see the bucket size, and a backend's cache entries outlive its wrapper.
    torch._dynamo.reset()
    runs = []  # (backend, step function, optimizer, first step's seconds)
    for backend in backends:
        step_fn = wrap(workload.model().to(device), how, device, backend, bucket_cap_mb, None, mode)
        optimizer = training.make_optimizer(step_fn.parameters())
        with collect_reports() as reports:
            first = timed(step_fn, optimizer, range(1))
            timed(step_fn, optimizer, range(1, 3))  # the steps a deferred decision settles in (DISTRIBUTED_SETTLE_CALL)
        if backend == "fusion":
            decided = describe(standing_reports(reports))
        runs.append((backend, step_fn, optimizer, first))
    # The backends' rounds alternate: the host's speed drifts over seconds on the GPU machines, which
    # one backend's rounds after the other's would read as a difference between the backends.
    rounds: dict[str, list[float]] = {backend: [] for backend in backends}
    for start in range(3, 3 + n_rounds * TIMED_ROUND, TIMED_ROUND):
        for backend, step_fn, optimizer, _ in runs:
            rounds[backend].append(timed(step_fn, optimizer, range(start, start + TIMED_ROUND)) / TIMED_ROUND)
    rows = [(backend, first, statistics.median(rounds[backend]) * 1e3) for backend, _, _, first in runs]
    torch._dynamo.reset()
    if rank == 0:
        base = {b: ms for b, _, ms in rows}.get("inductor")
        buckets = f", {bucket_cap_mb:g} MB buckets" if how == "ddp" else ""
        print(f"{how} time per step on {world} processes ({device}), {workload.name}{buckets}, "
              f"{replace(training, loss=kind)}, median of {n_rounds} rounds of {TIMED_ROUND} steps:")
        for backend, first, ms in rows:
            ratio = f"   Inductor's time / this {base / ms:.2f}x" if base and backend != "inductor" else ""
            print(f"  {backend:<9} first step {first:6.2f} s   {ms:8.3f} ms/step{ratio}")
        if decided:
            print(f"fusion's timed run:\n{decided}")


def standing_reports(reports: Sequence[Any]) -> list[Any]:
    """The reports that stand after the steps that made ``reports``: a graph's report with pending
    decisions is left out where its settle published a later one (same graph name).  Nothing is
    settled here, unlike ``fusion_backend.runtime.deferred.settled_reports``: a settle agrees across
    the ranks with a collective, and only rank 0 describes."""
    from fusion_backend.runtime.deferred import any_pending

    return [r for i, r in enumerate(reports)
            if not (any_pending([r]) and any(s.graph_name == r.graph_name for s in reports[i + 1:]))]


def describe(reports: Sequence[Any]) -> str:
    fused = sum(sum(r.counts().values()) for r in reports)
    decisions = [f"    {'fused' if d.fused else 'inductor'}: {d.pattern} {d.summary} ({d.rule})"
                 for r in reports for d in r.decisions]
    return f"  backend saw {len(reports)} graph(s), {fused} region(s) fused\n" + "\n".join(decisions)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; training settings not given are ``None`` (``training_settings`` fills them)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--wrap", choices=["ddp", "fsdp2"], default="ddp")
    parser.add_argument("--model", default="two-pipelines",
                        help=f"one of {', '.join(BUILTIN_MODELS)} or the path of a benchmark file "
                             "(Model, get_inputs, get_init_inputs; optional TRAIN_* training defaults)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"training steps checked against eager; default: TRAIN_STEPS, "
                             f"else {DEFAULT_STEPS}")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default=None,
                        help="default: the model's TRAIN_OPTIMIZER, else sgd")
    parser.add_argument("--lr", type=float, default=None,
                        help="default: the model's TRAIN_LR, else 0.01 (sgd) or 1e-3 (adamw); "
                             "two-pipelines: 0.1")
    parser.add_argument("--momentum", type=float, default=None,
                        help="SGD's; default: TRAIN_MOMENTUM, else 0.9")
    parser.add_argument("--weight-decay", type=float, default=None,
                        help="default: TRAIN_WEIGHT_DECAY, else 0 (sgd) or 0.01 (adamw)")
    parser.add_argument("--loss", choices=LOSSES, default=None,
                        help="default: TRAIN_LOSS, else auto (cross-entropy on (batch, classes) logits, "
                             "else mse)")
    parser.add_argument("--bucket-cap-mb", type=float, default=0.0001,
                        help="DDP bucket size; the default (about 100 bytes) splits the graph between layers")
    parser.add_argument("--compile-mode", default=None,
                        help="torch.compile's mode for both runs (e.g. reduce-overhead: CUDA graphs)")
    parser.add_argument("--log-decisions", action="store_true",
                        help="log the fusion backend's decisions (rank 0, to stderr)")
    parser.add_argument("--time", type=int, default=0, metavar="K", help="then time K steps of eager, inductor, fusion")
    parser.add_argument("--per-process-batch", type=int, nargs="?", const=1, default=0, metavar="K",
                        help="each process trains on K draws of get_inputs() (default 1), not on its "
                             "share of one draw")
    parser.add_argument("--time-bucket-cap-mb", type=float, default=25.0, help="DDP bucket size while timing")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}" if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(device)
    if args.log_decisions and rank == 0:
        logging.basicConfig(format="%(name)s: %(message)s")
        for name in ("fusion_backend.decision", "fusion_backend.impl_choice"):
            logging.getLogger(name).setLevel(logging.INFO)
    try:
        workload = Workload(args.model, world, args.per_process_batch)
        training = training_settings(args, workload.declared, workload.name)
        steps = parity_steps(args, workload.declared)
        reports = check_parity(workload, args.wrap, rank, world, device, steps, args.bucket_cap_mb,
                               training=training, mode=args.compile_mode)
        if rank == 0:
            print(describe(standing_reports(reports)))
        if args.time:
            time_backends(workload, args.wrap, rank, world, device, args.time, args.time_bucket_cap_mb,
                          training=training, mode=args.compile_mode)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
