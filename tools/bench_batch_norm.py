"""A training BatchNorm + ReLU's (with ``--groups``, a GroupNorm + SiLU's) passes against the memory
floor and Inductor, per shape (GPU time).

For each shape (channels-last, the given dtype): the project's kernels (``kernels/batch_norm.py``: the
statistics and their combination, then the normalise pass; the backward's sums and input gradient; or
``kernels/group_norm.py``'s forward and backward) and Inductor's compiled ``relu(batch_norm(y,
training=True))`` (``silu(group_norm(y, groups))``) forward and backward, in GPU microseconds per call
(``impl_choice.gpu_ms_per_call``: calls queued behind a GPU spin, L2 warm), beside the floor of each:
the forward reads the tensor twice and writes it once, the backward reads the gradient and the tensor
twice and writes one, at the copy rate measured first (a 512 MiB ``copy_``).  The last line sums every
column.

Usage (repository root, needs CUDA)::

    python tools/bench_batch_norm.py [--dtype bf16] [--no-inductor] [--shapes 64x64x56x56,64x256x56x56]
    python tools/bench_batch_norm.py --groups 32     (the SD VAE decoder's GroupNorm inputs by default)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch._functorch.config
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusion_backend.impl_choice import gpu_ms_per_call  # noqa: E402
from fusion_backend.kernels import batch_norm as bn  # noqa: E402
from fusion_backend.kernels import group_norm as gn  # noqa: E402
from fusion_backend.kernels.chain_math import OP_CODES  # noqa: E402
from fusion_backend.kernels.epilogue import build_params  # noqa: E402

#: ResNet-50's BatchNorm inputs at batch 64 (the stem's, then each stage's narrow and wide ones)
RESNET50 = ("64x64x112x112,64x64x56x56,64x256x56x56,64x128x28x28,64x512x28x28,64x256x14x14,64x1024x14x14,"
            "64x512x7x7,64x2048x7x7")  # fmt: skip
#: The SD VAE decoder's GroupNorm inputs (``demos/realnets/sd_vae_decoder.py``, batch 1)
VAE_DECODER = "1x512x64x64,1x512x128x128,1x512x256x256,1x256x256x256,1x256x512x512,1x128x512x512"
RELU = [(OP_CODES["relu"], [])]
SILU = [(OP_CODES["silu"], [])]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def copy_rate() -> float:
    """Bytes per millisecond of a device-to-device copy, reads and writes counted."""
    src = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / gpu_ms_per_call(lambda: dst.copy_(src))


def _ours(y: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> tuple[float, float]:
    c = y.shape[1]
    affine = torch.stack([weight, bias]).contiguous()
    q = build_params(RELU, None, c, y.device)
    out, grad_y = torch.empty_like(y), torch.empty_like(y)

    def forward() -> None:
        stats = bn.batch_norm_stats(y, None, 1e-5)
        bn.batch_norm_apply(y, None, RELU, q, affine, stats, out)

    stats = bn.batch_norm_stats(y, None, 1e-5)
    backward = lambda: bn.batch_norm_backward(grad, y, None, RELU, q, affine, stats[:2], grad_y)  # noqa: E731
    return gpu_ms_per_call(forward), gpu_ms_per_call(backward)


def _ours_group(y: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                groups: int) -> tuple[float, float]:  # fmt: skip
    c = y.shape[1]
    affine = torch.stack([weight, bias]).contiguous()
    p, q = build_params([], None, c, y.device), build_params(SILU, None, c, y.device)
    out, grad_y = torch.empty_like(y), torch.empty_like(y)
    stats = torch.empty(2, y.shape[0], groups, device=y.device)
    forward = lambda: gn.group_norm_forward(y, False, [], SILU, groups, 1e-5, p, q, affine, out, stats)  # noqa: E731
    forward()
    backward = lambda: gn.group_norm_backward(grad, y, stats, False, [], SILU, groups, p, q, affine, grad_y, (), (),  # noqa: E731
                                              (True, True))  # fmt: skip
    return gpu_ms_per_call(forward), gpu_ms_per_call(backward)


def _inductor(y: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
              groups: int) -> tuple[float, float]:  # fmt: skip
    # static shapes: one function compiled for several shapes would recompile them with symbolic sizes; a
    # fresh Dynamo per shape, as the lambda's code object is the same for every shape (its recompile limit)
    torch._dynamo.reset()
    norm = (lambda y, w, b: F.silu(F.group_norm(y, groups, w, b, 1e-5))) if groups else \
        (lambda y, w, b: F.relu(F.batch_norm(y, None, None, w, b, True, 0.1, 1e-5)))  # fmt: skip
    compiled = torch.compile(norm, dynamic=False)
    y, w, b = (t.detach().requires_grad_() for t in (y, weight, bias))
    out = compiled(y, w, b)
    forward_ms = gpu_ms_per_call(lambda: compiled(y, w, b))
    backward_ms = gpu_ms_per_call(lambda: torch.autograd.grad(out, (y, w, b), grad, retain_graph=True))
    return forward_ms, backward_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--shapes", default=None, help="comma-separated NxCxHxW (default: ResNet-50's, or the VAE "
                        "decoder's with --groups)")
    parser.add_argument("--groups", type=int, default=0, help="a GroupNorm of this many groups + SiLU (0: BatchNorm)")
    parser.add_argument("--no-inductor", action="store_true", help="time the project's kernels only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_batch_norm.py needs CUDA")
    torch._functorch.config.donated_buffer = False  # the backward is called again on one graph
    rate = copy_rate()
    print(f"copy rate {rate / 1e9:.2f} TB/s; GPU us per call")
    print(f"{'shape':22s} {'MB':>7s} | forward: floor  Inductor  ours | backward: floor  Inductor  ours")
    totals = [0.0] * 6
    for text in (args.shapes or (VAE_DECODER if args.groups else RESNET50)).split(","):
        shape = tuple(int(v) for v in text.split("x"))
        gen = torch.Generator(device="cuda").manual_seed(0)
        y = torch.randn(shape, device="cuda", generator=gen).to(DTYPES[args.dtype], memory_format=torch.channels_last)
        grad = torch.randn(shape, device="cuda", generator=gen).to(y.dtype, memory_format=torch.channels_last)
        weight = torch.rand(shape[1], device="cuda", generator=gen) + 0.5
        bias = torch.randn(shape[1], device="cuda", generator=gen)
        size = y.numel() * y.element_size()
        ours = _ours_group(y, grad, weight, bias, args.groups) if args.groups else _ours(y, grad, weight, bias)
        inductor = (float("nan"), float("nan")) if args.no_inductor else _inductor(y, grad, weight, bias, args.groups)
        row = [3 * size / rate, inductor[0], ours[0], 5 * size / rate, inductor[1], ours[1]]
        totals = [t + v for t, v in zip(totals, row, strict=True)]
        cells = [f"{v * 1e3:8.1f}" for v in row]
        print(f"{text:22s} {size / 1e6:7.1f} | {' '.join(cells[:3])} | {' '.join(cells[3:])}", flush=True)
    cells = [f"{v * 1e3:8.1f}" for v in totals]
    print(f"{'sum':22s} {'':7s} | {' '.join(cells[:3])} | {' '.join(cells[3:])}")


if __name__ == "__main__":
    main()
