"""Host time per call of identical models compiled one after the other: does the compile order show?

Compiles ``--copies`` copies of a small Conv2d + ReLU model (each a ``copy.deepcopy``, all running the
class's one ``forward`` code object as the bench's copies do, or with ``--private-code`` each its own
copy of it, so that each has a Dynamo cache of its own) with ``--backend``, then calls them in rounds,
one call of each in turn, the order rotating from round to round, and times every call on the host
clock (no device synchronisation: the calls are host-bound by design).  Prints each copy's median
time per call and the median over the rounds of the last copy's round median over its own: a copy
compiled earlier reading below 1.00x runs slower than a later one with the same code.  ``--mode train``
times forward + backward of the output's sum, the gradients set to ``None`` before each call, as the
bench's training step does.

Usage (repository root; runs on the CPU, or on CUDA with ``--device cuda``)::

    python tools/compile_order.py --backend inductor --copies 4
    python tools/compile_order.py --backend inductor --copies 4 --private-code --no-compile-caches
    python tools/compile_order.py --device cuda --mode train --copies 4
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fusion_backend  # noqa: E402


class ConvReLU(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x)) * 2


def with_private_forward(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with its class swapped for a subclass whose ``forward`` runs a copy of the code object
    (same code, globals, defaults and closure): Dynamo keeps its compiled entries per code object."""
    cls, shared = type(module), type(module).forward
    private = types.FunctionType(shared.__code__.replace(), shared.__globals__, shared.__name__,
                                 shared.__defaults__, shared.__closure__)
    module.__class__ = type(cls.__name__, (cls,), {"forward": private})
    return module


def step(compiled: torch.nn.Module, x: torch.Tensor, train: bool) -> None:
    """One call: the forward, and in training the backward of its sum (gradients set to None first)."""
    if not train:
        compiled(x)
        return
    compiled.zero_grad(set_to_none=True)
    compiled(x).sum().backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--calls", type=int, default=500, help="calls of each copy per round")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--private-code", action="store_true",
                        help="give every copy its own copy of the forward code object (a Dynamo cache each)")
    parser.add_argument("--mode", choices=("infer", "train"), default="infer",
                        help="train: forward + backward, gradients set to None before each call")
    parser.add_argument("--no-compile-caches", action="store_true",
                        help="turn off Inductor's FX graph cache and AOTAutograd's cache")
    args = parser.parse_args()
    backend = args.backend
    if backend == "fusion":  # the callable: without the installed entry point the name is unknown to Dynamo
        from fusion_backend import fusion as backend
    if args.no_compile_caches:
        torch._inductor.config.fx_graph_cache = False
        torch._functorch.config.enable_autograd_cache = False
    torch.set_num_threads(1)
    model = ConvReLU().to(args.device)
    x = torch.randn(1, 4, 4, 4, device=args.device)
    copies = []
    train = args.mode == "train"
    with torch.set_grad_enabled(train):
        for _ in range(args.copies):
            mine = copy.deepcopy(model)
            compiled = torch.compile(with_private_forward(mine) if args.private_code else mine, backend=backend)
            step(compiled, x, train)
            fusion_backend.settle()  # decisions the fusion backend deferred past the first call
            copies.append(compiled)
        medians = [[0.0] * args.copies for _ in range(args.rounds)]
        for r in range(args.rounds):
            order = list(range(args.copies))
            order = order[r % args.copies:] + order[:r % args.copies]
            samples: list[list[float]] = [[] for _ in copies]
            for _ in range(args.calls):
                for i in order:
                    began = time.perf_counter()
                    step(copies[i], x, train)
                    samples[i].append((time.perf_counter() - began) * 1e6)
            for i in range(args.copies):
                medians[r][i] = statistics.median(samples[i])
    last = args.copies - 1
    code = "a forward code object per copy" if args.private_code else "one shared forward code object"
    print(f"{args.backend} on {args.device}, {args.mode}, {args.copies} copies in compile order ({code}), "
          f"{args.rounds} rounds of {args.calls} calls each")
    for i in range(args.copies):
        ratios = [medians[r][last] / medians[r][i] for r in range(args.rounds)]
        print(f"  copy {i}: {statistics.median(m[i] for m in medians):.1f} us per call; last copy / this: "
              f"median {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
