"""Data-parallel training with ``backend="fusion"``: DistributedDataParallel, compiled.

    torchrun --nproc-per-node 2 demos/ddp_train.py                   # CUDA with NCCL, else CPU with gloo
    torchrun --nproc-per-node 2 demos/ddp_train.py --device cpu --steps 3

``torch.compile(DDP(model))`` runs Dynamo's DDPOptimizer, which splits the graph at the gradient
buckets' boundaries and hands each piece to the backend; ``--bucket-cap-mb`` small enough (the default) puts a
boundary between the two conv pipelines of the model and one inside the first (between its conv and
the multiplier of its epilogue), so the backend sees three graphs: a conv alone, an epilogue without
its conv, and a whole conv-transpose pipeline, which it fuses.
Each process trains on its shard of one global batch; at the end rank 0 checks the losses and the
parameters against one process training the same model eagerly on the whole batch, and prints
``parity OK`` (or raises).
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


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


def make_data(steps: int, batch: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, 12, 12, generator=gen), torch.randn(batch, generator=gen)) for _ in range(steps)]


def train(model: nn.Module, step_fn, data, lr: float = 0.05) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, target in data:
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(step_fn(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def run(rank: int, world: int, device: str, steps: int, bucket_cap_mb: float, options: dict | None = None) -> None:
    """One process's part (the process group is initialised by the caller)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    reference = TwoPipelines()
    model = copy.deepcopy(reference).to(device)
    batch = 4 * world
    data = make_data(steps, batch)
    shard = [(x[rank::world].to(device), t[rank::world].to(device)) for x, t in data]
    # DDPOptimizer refuses a first bucket (DDP's default: 1 MiB) larger than the others; a model this
    # small fits in one 1 MiB bucket, so the first bucket shrinks with the others.
    dist._DEFAULT_FIRST_BUCKET_BYTES = min(dist._DEFAULT_FIRST_BUCKET_BYTES, int(bucket_cap_mb * 2**20))
    ddp = DDP(model, device_ids=[int(device.split(":")[1])] if device.startswith("cuda") else None,
              bucket_cap_mb=bucket_cap_mb)
    compiled = torch.compile(ddp, backend="fusion", options=options)
    losses = train(ddp, compiled, shard)
    totals = torch.tensor(losses, device=device)
    dist.all_reduce(totals)
    if rank == 0:
        want = train(reference, reference, data)
        got = (totals / world).tolist()  # every shard has the same size: the mean of the shard losses
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5)
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        print(f"parity OK: {steps} steps on {world} processes ({device}), losses {', '.join(f'{v:.4f}' for v in got)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--bucket-cap-mb", type=float, default=0.0001,
                        help="DDP bucket size; the default (about 100 bytes) splits the graph inside the patterns")
    args = parser.parse_args()
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}" if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(device)
    try:
        run(rank, world, device, args.steps, args.bucket_cap_mb)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
