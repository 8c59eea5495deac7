"""Data-parallel training with ``backend="fusion"``: DDP or FSDP2, compiled, checked against one process.

    torchrun --nproc-per-node 2 demos/distributed_train.py                        # DDP; CUDA + NCCL, else CPU + gloo
    torchrun --nproc-per-node 2 demos/distributed_train.py --wrap fsdp2 \\
        --model demos/seeds/convt3d_leaky_mul_leaky_maxpool.py --steps 20 --time 30

Every process trains on its shard of each global batch; rank 0 then trains the same model eagerly on
the whole batches in one process, in float32 and in float64, and checks the distributed run's losses
and its parameter updates (final minus initial parameters) with the project's yardstick
(``fusion_backend.testing.compare``: error vs float64 within ``max(fp32 tolerance, 2 x eager's own
error)``).  It prints the figures and ``parity OK``, or raises.  TF32 is off while parity is checked.

- ``--wrap ddp``: ``torch.compile(DistributedDataParallel(model))``.  Dynamo's DDPOptimizer splits the
  graph at the gradient buckets' boundaries and hands each piece to the backend; the default
  ``--bucket-cap-mb`` (about 100 bytes) puts a boundary between every two layers with parameters, so
  a pattern whose multiplier is a parameter is cut between its conv and its epilogue.
- ``--wrap fsdp2``: ``fully_shard(torch.compile(model))``, as one shards compiled blocks: FSDP2's
  hooks (all-gather before the forward, reduce-scatter after the backward) run outside the compiled
  graph, which sees the unsharded parameters.
- ``--model``: ``two-pipelines`` (a small built-in model with two conv pipelines, for CPU) or the path
  of a benchmark file (``Model``, ``get_inputs()``, ``get_init_inputs()``, e.g. ``demos/seeds/*.py``):
  ``get_inputs()`` gives one global batch, split along dim 0 between the processes.
- ``--time K``: then K timed steps each of eager, Inductor and fusion under the same wrapper, with
  PyTorch's default TF32 settings and DDP's default bucket size (``--time-bucket-cap-mb``; the tiny
  buckets of the parity check are a test of graph splitting, not a setting anyone trains with);
  time per step = the slowest rank's, median over the K steps.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

LEARNING_RATE = 0.1
MOMENTUM = 0.9
DDP_FIRST_BUCKET_BYTES = dist._DEFAULT_FIRST_BUCKET_BYTES  # DDP's own, before any run shrinks it


class TwoPipelines(nn.Module):
    """Conv2d -> x multiplier -> leaky -> max_pool2d, then ConvTranspose2d -> gelu -> mean."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 32, 3, padding=1)
        self.multiplier = nn.Parameter(torch.randn(32, 1, 1) * 0.5 + 1)
        self.up = nn.ConvTranspose2d(32, 4, 2, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.max_pool2d(F.leaky_relu(self.conv(x) * self.multiplier, 0.1), 2)
        return F.gelu(self.up(y)).mean((1, 2, 3))


class Workload:
    """A model factory and its global batches: ``make_model()`` (same parameters in every process,
    on CPU) and ``batch(step)`` (a list of CPU tensors, the same in every process)."""

    def __init__(self, spec: str, world: int) -> None:
        if spec == "two-pipelines":
            self.name = spec
            self.make_model: Callable[[], nn.Module] = TwoPipelines
            self._inputs: Callable[[], list[Any]] = lambda: [torch.randn(4 * world, 3, 12, 12)]
            return
        path = Path(spec)
        loader = importlib.util.spec_from_file_location(path.stem, path)
        if loader is None or not path.is_file():
            raise SystemExit(f"--model: no benchmark file at {spec!r} (or use 'two-pipelines')")
        module = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(module)  # type: ignore[union-attr]
        self.name = path.stem
        self.make_model = lambda: module.Model(*module.get_init_inputs())
        self._inputs = module.get_inputs

    def model(self) -> nn.Module:
        torch.manual_seed(0)
        return self.make_model()

    def batch(self, step: int) -> list[Any]:
        torch.manual_seed(1000 + step)
        return self._inputs()


def shard(batch: Sequence[Any], rank: int, world: int, device: str) -> list[Any]:
    """This process's part of a global batch: tensors split along dim 0 (contiguous), others as is."""
    size = batch[0].shape[0]
    if size % world:
        raise SystemExit(f"the global batch ({size}) must divide among {world} processes")
    part = size // world
    return [t[rank * part:(rank + 1) * part].to(device) if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == size
            else t for t in batch]


def shard_target(out: torch.Tensor, step: int, rank: int, world: int) -> torch.Tensor:
    """This process's rows of batch ``step``'s random target (drawn whole on the CPU from the step, so
    that every process and the single-process run see the same global target), like ``out``."""
    gen = torch.Generator().manual_seed(2000 + step)
    full = torch.randn((out.shape[0] * world, *out.shape[1:]), generator=gen)
    part = out.shape[0]
    return full[rank * part:(rank + 1) * part].to(device=out.device, dtype=torch.promote_types(out.dtype, torch.float32))


def sgd_step(optimizer: torch.optim.Optimizer, step_fn: Callable[..., torch.Tensor], inputs: Sequence[Any],
             target: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One optimizer step on this process's shard of a batch; its loss (not synchronised): the mean
    squared error against ``target(output)``, so the mean of the shard losses is the batch's loss."""
    optimizer.zero_grad(set_to_none=True)
    out = step_fn(*inputs)
    out = out.to(torch.promote_types(out.dtype, torch.float32))
    loss = F.mse_loss(out, target(out))
    loss.backward()
    optimizer.step()
    return loss


def train(parameters: Sequence[nn.Parameter], step_fn: Callable[..., torch.Tensor],
          batches: Callable[[int], list[Any]], steps: int, rank: int = 0, world: int = 1) -> list[float]:
    """``steps`` steps of SGD with momentum; the losses (of this process's shards)."""
    optimizer = torch.optim.SGD(parameters, lr=LEARNING_RATE, momentum=MOMENTUM)
    return [sgd_step(optimizer, step_fn, batches(step), lambda out, s=step: shard_target(out, s, rank, world)).item()
            for step in range(steps)]


def wrap(model: nn.Module, how: str, device: str, backend: str, bucket_cap_mb: float,
         options: dict[str, Any] | None) -> Callable[..., torch.Tensor]:
    """The step function of ``model`` under DDP or FSDP2, compiled with ``backend`` ('eager': not)."""
    compile_kwargs: dict[str, Any] = {"backend": backend}
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
                 bucket_cap_mb: float, options: dict[str, Any] | None = None) -> list[Any]:
    """Train with ``backend="fusion"`` under ``how`` and compare with one eager process on rank 0
    (raises ``AssertionError`` with the figures on a mismatch).  Returns this process's reports."""
    from fusion_backend.report import collect_reports
    from fusion_backend.testing import compare, relative_error

    with tf32_off():
        initial = workload.model()
        model = copy.deepcopy(initial).to(device)
        step_fn = wrap(model, how, device, "fusion", bucket_cap_mb, options)
        with collect_reports() as reports:
            losses = train(list(step_fn.parameters()), step_fn,
                           lambda s: shard(workload.batch(s), rank, world, device), steps, rank, world)
        totals = torch.tensor(losses, dtype=torch.float64, device=device)
        dist.all_reduce(totals)
        got_params = full_parameters(step_fn)
        if rank == 0:
            start = dict(initial.named_parameters())
            want, want_params, ref, ref_params = [], [], [], []
            for dtype, loss_out, params_out in ((torch.float32, want, want_params), (torch.float64, ref, ref_params)):
                eager = copy.deepcopy(initial).to(device=device, dtype=dtype)
                loss_out.extend(train(list(eager.parameters()), eager,
                                      lambda s, d=dtype: [t.to(device=device, dtype=d) for t in workload.batch(s)], steps))
                params_out.extend((n, p.detach().cpu()) for n, p in eager.named_parameters())
            rows, failures = [], []
            got = totals.cpu() / world  # equal shards: the mean of the shard losses is the batch's loss
            checks = [("losses", got, torch.tensor(want, dtype=torch.float64), torch.tensor(ref))]
            for (name, g), (_, w), (_, r) in zip(got_params, want_params, ref_params, strict=True):
                p0 = start[name].detach()
                checks.append((f"{name} update", g.double() - p0.double(), w.double() - p0.double(), r - p0.double()))
            for name, g, w, r in checks:
                problem = compare(name, g, w, tol=1e-5, reference=r)
                rows.append(f"  {name:<28} vs float64: distributed {relative_error(g, r):.2e}, "
                            f"eager {relative_error(w, r):.2e}{'  MISMATCH' if problem else ''}")
                if problem:
                    failures.append(problem)
            moved = max(relative_error(p, start[n].detach()) for n, p in got_params)
            print(f"{how} parity on {world} processes ({device}), {workload.name}, {steps} steps "
                  f"(largest relative parameter change {moved:.2e}):\n" + "\n".join(rows))
            if failures:
                raise AssertionError("\n".join(failures))
            print(f"parity OK: final loss {got[-1].item():.6f} (eager {want[-1]:.6f})")
        return list(reports)


def time_backends(workload: Workload, how: str, rank: int, world: int, device: str, timed_steps: int,
                  bucket_cap_mb: float, backends: Sequence[str] = ("eager", "inductor", "fusion")) -> None:
    """Rank 0 prints, per backend, the first step's seconds (compilation) and the median ms per step."""
    rows = []
    batches = [shard(workload.batch(s), rank, world, device) for s in range(2)]
    targets: dict[int, torch.Tensor] = {}  # drawn once: a CPU draw per step would be timed too

    def target(step: int, out: torch.Tensor) -> torch.Tensor:
        if step not in targets:
            targets[step] = shard_target(out, step, rank, world)
        return targets[step]

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for backend in backends:
        model = workload.model().to(device)
        step_fn = wrap(model, how, device, backend, bucket_cap_mb, None)
        optimizer = torch.optim.SGD(step_fn.parameters(), lr=1e-6)
        times = []
        for step in range(timed_steps + 3):
            dist.barrier()
            sync()
            start = time.perf_counter()
            sgd_step(optimizer, step_fn, batches[step % 2], lambda out, s=step % 2: target(s, out))
            sync()
            elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times.append(elapsed.item())
        rows.append((backend, times[0], statistics.median(times[3:]) * 1e3))
        torch._dynamo.reset()
    if rank == 0:
        base = {b: ms for b, _, ms in rows}.get("inductor")
        buckets = f", {bucket_cap_mb:g} MB buckets" if how == "ddp" else ""
        print(f"{how} time per step on {world} processes ({device}), {workload.name}{buckets}, median of {timed_steps}:")
        for backend, first, ms in rows:
            ratio = f"   Inductor's time / this {base / ms:.2f}x" if base and backend != "inductor" else ""
            print(f"  {backend:<9} first step {first:6.2f} s   {ms:8.3f} ms/step{ratio}")


def describe(reports: Sequence[Any]) -> str:
    fused = sum(sum(r.counts().values()) for r in reports)
    decisions = [f"    {'fused' if d.fused else 'inductor'}: {d.pattern} {d.summary} ({d.rule})"
                 for r in reports for d in r.decisions]
    return f"  backend saw {len(reports)} graph(s), {fused} region(s) fused\n" + "\n".join(decisions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--wrap", choices=["ddp", "fsdp2"], default="ddp")
    parser.add_argument("--model", default="two-pipelines",
                        help="'two-pipelines' or the path of a benchmark file (Model, get_inputs, get_init_inputs)")
    parser.add_argument("--steps", type=int, default=20, help="training steps checked against eager")
    parser.add_argument("--bucket-cap-mb", type=float, default=0.0001,
                        help="DDP bucket size; the default (about 100 bytes) splits the graph between layers")
    parser.add_argument("--time", type=int, default=0, metavar="K", help="then time K steps of eager, inductor, fusion")
    parser.add_argument("--time-bucket-cap-mb", type=float, default=25.0, help="DDP bucket size while timing")
    args = parser.parse_args()
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}" if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(device)
    try:
        workload = Workload(args.model, world)
        reports = check_parity(workload, args.wrap, rank, world, device, args.steps, args.bucket_cap_mb)
        if rank == 0:
            print(describe(reports))
        if args.time:
            time_backends(workload, args.wrap, rank, world, device, args.time, args.time_bucket_cap_mb)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
