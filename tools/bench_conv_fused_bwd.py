"""Time the implicit-gradient conv backward kernels against aten's convolution_backward (CUDA).

    python tools/bench_conv_fused_bwd.py                       # convt3d and conv2d, fp32 (TF32 per cudnn flag) and bf16
    python tools/bench_conv_fused_bwd.py --seeds convt3d --dtypes fp32 --no-tf32 --reps 50

The convs of the ``seeds`` suite (``demos/seeds/``): ``convt3d``: ConvTranspose3d 16->32 k3 s2 p1 op1
on (16, 16, 16, 32, 32), gradient in max-pooled form (b) (``g_win`` + int8 winners of MaxPool3d(2)).
``conv2d``: Conv2d 64->64 k3 on (64, 64, 256, 256), dense form (a).  For each: parity vs aten (fp32 ieee reference on the full-size gradient), then the median of
CUDA-event timings after warm-up (the first calls autotune) for grad_x, grad_w, grad_b and all three,
and aten's ``convolution_backward`` on the full-size gradient (grad_x + grad_w + grad_b) for
comparison; GB/s counts the compulsory bytes (inputs read once, outputs written once), TFLOP/s the
2*MACs of each GEMM.  Prints the autotuner's choice per kernel.  Exits 0 without CUDA.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusion_backend.kernels import conv_fused_bwd as K  # noqa: E402


def convt3d_maxpool(dtype: torch.dtype):
    torch.manual_seed(0)
    x = torch.rand(16, 16, 16, 32, 32, device="cuda")
    w = torch.randn(16, 32, 3, 3, 3, device="cuda") * 0.1
    args = ((2, 2, 2), (1, 1, 1), (1, 1, 1), True, (1, 1, 1), 1)
    y = torch.ops.aten.convolution(x, w, None, *args)
    _, flat = F.max_pool3d(y, 2, return_indices=True)
    d, h, ww = (flat // (64 * 64)) % 32, (flat // 64) % 64, flat % 64
    win = ((d % 2) * 4 + (h % 2) * 2 + (ww % 2)).to(torch.int8)
    g_win = torch.randn(flat.shape, device="cuda")
    full = torch.zeros(flat.shape[0] * flat.shape[1], y[0, 0].numel(), device="cuda")
    full.scatter_add_(1, flat.reshape(full.shape[0], -1), g_win.reshape(full.shape[0], -1))
    full = full.reshape(y.shape)
    implicit = K.PooledGrad(g_win.to(dtype), win, (2, 2, 2))
    return x.to(dtype), w.to(dtype), args, implicit, full.to(dtype), g_win.numel() * (g_win.element_size() + 1)


def conv2d_dense(dtype: torch.dtype):
    torch.manual_seed(0)
    x = torch.rand(64, 64, 256, 256, device="cuda")
    w = torch.randn(64, 64, 3, 3, device="cuda") * 0.05
    args = ((1, 1), (0, 0), (1, 1), False, (0, 0), 1)
    g = torch.randn(64, 64, 254, 254, device="cuda").to(dtype)
    return x.to(dtype), w.to(dtype), args, g, g, g.numel() * g.element_size()


def time_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def bench_case(seed: str, dname: str, dtype: torch.dtype, reps: int) -> None:
    x, w, args, grad, full, grad_bytes = (convt3d_maxpool if seed == "convt3d" else conv2d_dense)(dtype)
    reason = K.unsupported_reason(grad, x, w, *args)
    if reason:
        print(f"{seed} {dname}: unsupported: {reason}")
        return
    # parity: fp32 IEEE aten on the full-size gradient
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    want = torch.ops.aten.convolution_backward(
        full.float(), x.float(), w.float(), [full.shape[1]], *args, [True, True, True]
    )
    torch.backends.cudnn.allow_tf32 = saved
    got = K.convolution_backward(grad, x, w, *args)
    errs = " ".join(f"{n}={rel_err(g, e):.1e}" for n, g, e in zip(("dx", "dw", "db"), got, want, strict=True))
    ys = full.shape
    kvol = math.prod(w.shape[2:])
    if args[3]:  # transposed: MACs over the input grid
        macs = x.shape[0] * math.prod(x.shape[2:]) * x.shape[1] * w.shape[1] * kvol
    else:
        macs = x.shape[0] * math.prod(ys[2:]) * ys[1] * w.shape[1] * kvol
    flops = 2 * macs
    xb, wb = x.numel() * x.element_size(), w.numel() * w.element_size()
    runs = {
        "grad_x": (lambda: K.conv_input_grad(grad, x, w, *args), grad_bytes + wb + xb, flops),
        "grad_w": (lambda: K.conv_weight_grad(grad, x, w, *args), grad_bytes + xb + wb, flops),
        "grad_b": (lambda: K.conv_bias_grad(grad), grad_bytes, 0),
        "fused total": (lambda: K.convolution_backward(grad, x, w, *args), 2 * grad_bytes + 2 * xb + 2 * wb, 2 * flops),
        "aten (full g)": (
            lambda: torch.ops.aten.convolution_backward(full, x, w, [ys[1]], *args, [True, True, True]),
            full.numel() * full.element_size() + 2 * xb + 2 * wb, 2 * flops,
        ),
    }  # fmt: skip
    print(f"\n{seed} {dname}: parity vs fp32 aten: {errs}")
    for name, (fn, nbytes, nflops) in runs.items():
        ms = time_ms(fn, reps)
        tflops = f"{nflops / ms / 1e9:7.1f} TFLOP/s" if nflops else ""
        print(f"  {name:14s} {ms:8.3f} ms  {nbytes / ms / 1e6:8.1f} GB/s  {tflops}")
    for kernel in (K._dgrad_tuned, K._wgrad_tuned):
        print(f"  best config {getattr(kernel.fn, '__name__', kernel.fn)}: {getattr(kernel, 'best_config', None)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="convt3d,conv2d", help="convt3d, conv2d")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--no-tf32", action="store_true", help="fp32 in IEEE (cudnn.allow_tf32 = False)")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA: nothing to time")
        return 0
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = not opts.no_tf32
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, tf32 {not opts.no_tf32}")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    for seed in opts.seeds.split(","):
        for dname in opts.dtypes.split(","):
            bench_case(seed.lower(), dname, dtypes[dname], opts.reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
