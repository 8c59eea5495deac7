"""Time the fused conv forward (``FUSION_CONV_IMPL=triton``) against the library path.

    python tools/bench_conv_fused.py                       # convt3d and conv2d, fp32 and bf16
    python tools/bench_conv_fused.py --seeds convt3d --dtypes fp32 --no-save

``--seeds`` names the convs of the ``seeds`` suite (``demos/seeds/``): ``convt3d`` (ConvTranspose3d
16->32 k3 s2 on 16x16x16x32x32, leaky -> x m -> leaky, MaxPool3d(2)), ``conv2d`` (Conv2d 64->64 k3 on
64x64x256x256, x m -> leaky -> GELU) and ``conv2d_small`` (Conv2d 3->16 k3 on 128x3x32x32, same chain).
For each conv x dtype it prints the median ms (``triton.testing.do_bench``) of
``fusion::conv_epilogue_fwd`` with the fused implicit-GEMM kernel and with cuDNN + the epilogue
kernel, the cuDNN conv alone, the eager module, the autotuned tile, and the relative error of the
fused output vs the library path.  ``save`` = the training forward (writes the backward state).
Needs CUDA; fp32 uses TF32 as ``torch.backends.cudnn.allow_tf32`` says (PyTorch's default: on).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from seed_convs import seed_conv  # tools/, this script's folder

from fusion_backend.ops import conv_epilogue as ce
from fusion_backend.ops.config import ConvEpilogueConfig


def _workload(name: str, dtype: torch.dtype):
    torch.manual_seed(0)
    spec, chain, pool = seed_conv("convt3d" if name == "convt3d" else "conv2d")
    if name == "convt3d":
        x, w, c = torch.rand(16, 16, 16, 32, 32), torch.randn(16, 32, 3, 3, 3) * 0.1, 32
    elif name == "conv2d_small":  # demos/seeds/conv2d_mul_leaky_gelu_small.py's shapes
        x, w, c = torch.rand(128, 3, 32, 32), torch.randn(16, 3, 3, 3) * 0.2, 16
    else:
        x, w, c = torch.rand(64, 64, 256, 256), torch.randn(64, 64, 3, 3) * 0.05, 64
    b, m = torch.randn(c), torch.randn((c,) + (1,) * (x.dim() - 2))
    x, w, b, m = (t.cuda().to(dtype) for t in (x, w, b, m))
    config = ConvEpilogueConfig(conv=spec, chain=chain, pool=pool, strict=True).to_json()
    return x, w, b, [m], spec, config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="convt3d,conv2d", help="convt3d, conv2d, conv2d_small")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--no-save", action="store_true", help="inference forward only (no saved state)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA: nothing to time")
        return 0
    import triton.testing

    from fusion_backend.kernels import conv_fused

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    save = not args.no_save
    print(
        f"{'conv':12} {'dtype':5} {'save':5} {'fused':>8} {'library':>8} {'cudnn':>8} {'eager':>8}  rel.err  tile"
    )
    for seed in args.seeds.split(","):
        for dname in args.dtypes.split(","):
            x, w, b, ops, spec, config = _workload(seed, dtypes[dname])

            def op(impl: str, x=x, w=w, b=b, ops=ops, config=config):
                os.environ[ce.CONV_IMPL_ENV] = impl
                return torch.ops.fusion.conv_epilogue_fwd(x, w, b, ops, config, save)

            got, want = op("triton"), op("library")
            rel = ((got[0].double() - want[0].double()).norm() / want[0].double().norm()).item()
            times = {
                impl: triton.testing.do_bench(lambda impl=impl: op(impl)) for impl in ("triton", "library")
            }
            conv = lambda x=x, w=w, spec=spec: torch.ops.aten.convolution(  # noqa: E731
                x, w, None, list(spec.stride), list(spec.padding), list(spec.dilation), spec.transposed,
                list(spec.output_padding), spec.groups,
            )  # fmt: skip
            t_conv = triton.testing.do_bench(conv)
            eager = lambda x=x, w=w, b=b, ops=ops, config=config: ce.conv_epilogue_eager(x, w, b, ops, config)  # noqa: E731
            with torch.no_grad():
                t_eager = triton.testing.do_bench(eager)
            best = getattr(conv_fused.plan._conv_fused_fwd_tuned, "best_config", None)
            print(f"{seed:12} {dname:5} {save!s:5} {times['triton']:8.3f} {times['library']:8.3f} {t_conv:8.3f} "
                  f"{t_eager:8.3f}  {rel:.1e}  {best}")  # fmt: skip
    os.environ.pop(ce.CONV_IMPL_ENV, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
