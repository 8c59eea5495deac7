"""Accuracy of every forward x backward implementation pair of the fused conv op, against eager and float64.

    python tools/diagnose_conv_impl.py                    # convt3d, fp32 (TF32 as PyTorch's default) and bf16
    python tools/diagnose_conv_impl.py --seeds convt3d,conv2d --dtypes fp32

``--seeds`` takes the conv names of ``tools/bench_conv_fused.py`` (convt3d, conv2d, conv2d_small).
For each conv and dtype it runs ``fusion::conv_epilogue_fwd`` with the library forward (cuDNN + the
epilogue kernel) and the fused kernel (``FUSION_CONV_IMPL=library|triton``), then the library and the
Triton backward on each forward's saved state, with one fixed random upstream gradient, and prints
``||got - ref|| / ||ref||`` of the output and of every gradient against eager (the same dtype and
TF32 setting) and against a float64 run, next to eager's own error from float64.  With a max pool it
also prints the fraction of winners on which the two forwards disagree.  Then the ``auto`` choice
with its timings (``impl_choice`` logs them).  Needs CUDA; shapes as ``tools/bench_conv_fused.py``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_conv_fused import _workload  # noqa: E402

from fusion_backend.ops import conv_epilogue as ce  # noqa: E402
from fusion_backend.ops.config import ConvEpilogueConfig  # noqa: E402

NAMES = ("out", "grad x", "grad w", "grad b", "grad m")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _eager(x, w, b, ops, config, grad_out, dtype):  # noqa: ANN001
    """Output and gradients of the eager module semantics (``conv_epilogue_eager``) in ``dtype``."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (x, w, b, *ops)]
    out = ce.conv_epilogue_eager(leaves[0], leaves[1], leaves[2], leaves[3:], config)
    out.backward(grad_out.to(out.dtype))
    return [out.detach()] + [t.grad for t in leaves]


def _fused(x, w, b, ops, config, grad_out, fwd: str, bwd: str):  # noqa: ANN001
    os.environ[ce.CONV_IMPL_ENV] = fwd
    out, sa, sb = torch.ops.fusion.conv_epilogue_fwd(x, w, b, ops, config, True)
    os.environ[ce.CONV_IMPL_ENV] = {"library": "library", "triton": "triton"}.get(bwd, bwd)
    grads = torch.ops.fusion.conv_epilogue_bwd(
        grad_out.to(out.dtype), x, w, b, ops, sa, sb, config, [True] * (3 + len(ops))
    )
    return [out] + list(grads), sa


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="convt3d", help="convt3d, conv2d, conv2d_small")
    parser.add_argument("--dtypes", default="fp32,bf16")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA: nothing to diagnose")
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("fusion_backend.impl_choice").setLevel(logging.INFO)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    print(f"tf32 (cudnn.allow_tf32) = {torch.backends.cudnn.allow_tf32}")
    for seed in args.seeds.split(","):
        for dname in args.dtypes.split(","):
            dtype = dtypes[dname]
            x, w, b, ops, _spec, config = _workload(seed, dtype)
            cfg = ConvEpilogueConfig.from_json(config)
            gen = torch.Generator(device="cuda").manual_seed(1)
            out_shape = torch.ops.fusion.conv_epilogue_fwd(x, w, b, ops, config, False)[0].shape
            grad_out = torch.randn(out_shape, device="cuda", generator=gen)
            eager = _eager(x, w, b, ops, config, grad_out, dtype)
            exact = _eager(x, w, b, ops, config, grad_out.double(), torch.float64)
            print(f"\n== {seed} {dname}: rel. error vs eager / vs float64 ({', '.join(NAMES)})")
            print(
                f"{'eager':22} "
                + "  ".join(f"{'-':>8} / {_rel(e, f):.1e}" for e, f in zip(eager, exact, strict=True))
            )
            winners = {}
            for fwd in ("library", "triton"):
                for bwd in ("library", "triton"):
                    got, winners[fwd] = _fused(x, w, b, ops, config, grad_out, fwd, bwd)
                    cells = [
                        f"{_rel(g, e):.1e} / {_rel(g, f):.1e}"
                        for g, e, f in zip(got, eager, exact, strict=True)
                    ]
                    print(f"{'fwd ' + fwd + ', bwd ' + bwd:22} " + "  ".join(cells))
            if cfg.pool is not None and cfg.pool.kind == "max":
                differ = (winners["library"] != winners["triton"]).float().mean().item()
                print(f"winners that differ between the library and the fused forward: {differ:.2e}")
            os.environ[ce.CONV_IMPL_ENV] = "auto"
            torch.ops.fusion.conv_epilogue_fwd(x, w, b, ops, config, True)  # logs the measured choice
            torch.ops.fusion.conv_epilogue_fwd(x, w, b, ops, config, False)
            _fused(x, w, b, ops, config, grad_out, "auto", "auto")  # and the backward's
    os.environ.pop(ce.CONV_IMPL_ENV, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
