"""GPU timing of the ``conv_global_mean`` fused op on the ``seeds`` suite's ConvTranspose2d 64->128 k3
global-mean pipeline (self-contained; needs CUDA).

Prints, for fp32 and bf16 (bf16 x/weight/bias, the folded bias and the output in fp32 as under
autocast), in channels-first and channels_last layouts:

* each kernel launcher alone (the pass over x, the contraction, the parameter-gradient kernel,
  the grad_x pass) and the whole op forward, backward and forward+backward (median ms of >= 50
  CUDA-event-timed repetitions after warm-up);
* the number of CUDA kernels one forward and one backward launch (counted with torch.profiler);
* the fraction of the 3 TB/s floor (x read once forward, grad_x written once backward).

Usage (from the repository root)::

    python tools/bench_conv_global_mean.py [--reps 100] [--warmup 20] [--batch 16] [--no-channels-last]

TF32 stays off (``torch.backends.cuda.matmul.allow_tf32`` is irrelevant here: the op has no matmul).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusion_backend.ir.specs import ConvSpec  # noqa: E402
from fusion_backend.kernels import global_mean as kernels  # noqa: E402
from fusion_backend.ops import conv_global_mean as cgm  # noqa: E402
from fusion_backend.ops.chain import ChainStep, PointwiseKind, TensorRef  # noqa: E402

FLOOR_BYTES_PER_S = 3.0e12


def cuda_ms(fn: Callable[[], object], reps: int, warmup: int) -> float:
    """Median of ``reps`` CUDA-event timings of ``fn()`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def count_kernels(fn: Callable[[], object]) -> tuple[int, list[str]]:
    """CUDA kernels launched by one call of ``fn`` (torch.profiler), with their names."""
    fn()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [
        e.name
        for e in prof.events()
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name
        and "Memset" not in e.name
    ]
    return len(names), names


def build_cases(
    dtype: torch.dtype, channels_last: bool, batch: int, size: tuple[int, int] = (512, 512), device: str = "cuda"
) -> tuple[torch.Tensor, dict[str, Callable[[], object]], dict[str, Callable[[], object]]]:
    """The global-mean pipeline's op at ``size``: ``(x, per_kernel, per_op)`` callables (launchers alone; op fwd/bwd/step)."""
    torch.manual_seed(0)
    dev = torch.device(device)
    c_in, c_out = 64, 128
    x = torch.rand(batch, c_in, *size, device=dev).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    conv = torch.nn.ConvTranspose2d(c_in, c_out, 3).to(dev)
    weight = conv.weight.detach().to(dtype).requires_grad_()
    bias = conv.bias.detach().to(dtype).requires_grad_()
    extra = torch.randn(c_out, 1, 1, device=dev, requires_grad=True)  # the folded `+ self.bias`, fp32
    spec = ConvSpec(True, (1, 1), (0, 0), (1, 1), (0, 0), 1)
    cfg = cgm.ConvGlobalMeanConfig(
        spec, (ChainStep(PointwiseKind.ADD, (TensorRef(0),)),), keepdim=True, out_dtype="float32"
    )
    config = cfg.to_json()
    assert cgm.kernel_path(config, dtype, dev.type)[0] == "triton"
    xg = x.detach().requires_grad_()

    def forward() -> torch.Tensor:
        return cgm.conv_global_mean_fwd(x, weight, bias, [extra], config, False)[0]

    out, taps, mean = cgm.conv_global_mean_fwd(x, weight, bias, [extra], config, True)
    grad = torch.randn_like(out)

    def backward() -> list[torch.Tensor]:
        return cgm.conv_global_mean_bwd(
            grad, weight, bias, [extra], taps, mean, list(x.shape), list(cgm.config.grad_input_strides(x)),
            x.dtype, config, [True, True, True, True],
        )  # fmt: skip

    def step() -> None:
        y = cgm.conv_global_mean(xg, weight, bias, [extra], config)
        torch.autograd.grad(y, [xg, weight, bias, extra], grad)

    # the kernels alone, with the op's own arguments
    geo = cgm.config.geometry_for(spec, tuple(x.shape[2:]), tuple(weight.shape[2:]), dev)
    x5 = cgm.config.as_5d(x)
    partial = kernels.set_sums_partial(x5, geo.bits, geo.set_counts)
    layout = cgm.triton_path.weight_layout(weight.detach(), spec)
    chain = cgm.triton_path.chain_args(cfg, [extra], c_out, dev, mean)
    n = x.shape[0]
    out_buf = torch.empty((n, c_out), dtype=torch.float32, device=dev)
    mean_buf = torch.empty((n, c_out), dtype=torch.float64, device=dev)
    taps_buf = torch.empty((n, c_in, 9), dtype=torch.float64, device=dev)
    coef = torch.empty((n, c_out), dtype=torch.float32, device=dev)
    gw = torch.empty_like(weight)
    gw_layout = kernels.WeightLayout.of(gw, True, 1)
    gb = torch.empty_like(bias)
    gextra = torch.empty_like(extra)
    targets = ((kernels.GRAD_DIRECT, gextra, 1),)
    grad_x = torch.empty_strided(x.shape, cgm.config.grad_input_strides(x), dtype=x.dtype, device=dev)
    per_kernel = {
        "pass over x (set_sums_partial)": lambda: kernels.set_sums_partial(x5, geo.bits, geo.set_counts),
        "contraction + chain (contract_forward)": lambda: kernels.contract_forward(
            partial, geo.tapset, layout, bias.detach(), chain, geo.n_outputs, out_buf, mean_buf, taps_buf
        ),
        "parameter grads (params_backward)": lambda: kernels.params_backward(
            grad.reshape(n, c_out), mean, taps.reshape(n, c_in, -1), chain, targets, gw_layout, gb,
            geo.n_outputs, coef, coef,
        ),
        "grad_x pass (grad_broadcast)": lambda: kernels.grad_broadcast(
            coef, layout, geo.tapset, geo.bits, geo.set_counts, cgm.config.as_5d(grad_x)
        ),
    }  # fmt: skip
    return x, per_kernel, {"op forward": forward, "op backward": backward, "op forward + backward (autograd)": step}


def bench(
    dtype: torch.dtype,
    channels_last: bool,
    batch: int,
    reps: int,
    warmup: int,
    size: tuple[int, int] = (512, 512),
    device: str = "cuda",
) -> None:
    """Time one configuration (``size``/``device`` other than the defaults: smoke tests only)."""
    x, per_kernel, per_op = build_cases(dtype, channels_last, batch, size, device)
    forward, backward, step = per_op.values()
    label = f"{str(dtype).replace('torch.', '')} {'channels_last' if channels_last else 'contiguous'}"
    floor_ms = x.numel() * x.element_size() / FLOOR_BYTES_PER_S * 1e3
    print(f"\n== ConvTranspose2d 64->128 global mean, x {tuple(x.shape)} {label}: floor (x once at 3 TB/s) {floor_ms:.3f} ms")
    for name, fn in per_kernel.items():
        print(f"  {name:44s} {cuda_ms(fn, reps, warmup):8.3f} ms")
    fwd_ms = cuda_ms(forward, reps, warmup)
    bwd_ms = cuda_ms(backward, reps, warmup)
    step_ms = cuda_ms(step, reps, warmup)
    nf, names_f = count_kernels(forward)
    nb, names_b = count_kernels(backward)
    print(f"  {'op forward':44s} {fwd_ms:8.3f} ms   ({nf} CUDA kernels: {', '.join(names_f)})")
    print(f"  {'op backward':44s} {bwd_ms:8.3f} ms   ({nb} CUDA kernels: {', '.join(names_b)})")
    print(f"  {'op forward + backward (autograd)':44s} {step_ms:8.3f} ms   (targets: fwd <= 0.44, step <= 1.37 fp32)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--no-channels-last", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_conv_global_mean: no CUDA device; nothing to time")
        return 0
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    import triton

    print(f"triton {triton.__version__}, reps {max(args.reps, 50)}, warm-up {args.warmup}")
    for dtype in (torch.float32, torch.bfloat16):
        for cl in (False,) if args.no_channels_last else (False, True):
            bench(dtype, cl, args.batch, max(args.reps, 50), args.warmup)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
