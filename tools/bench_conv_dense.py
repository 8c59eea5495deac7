"""Time the dense conv forward (``kernels/conv_dense.py``) on the ``seeds`` suite's Conv2d against cuDNN,
the library-path op and the general fused kernel (``kernels/conv_fused/``).

    python tools/bench_conv_dense.py                  # Conv2d 64->64 k3 on (64, 64, 256, 256): fp32 (TF32), bf16, fp32 x -> bf16
    python tools/bench_conv_dense.py --small          # Conv2d 3->16 k3 on (128, 3, 32, 32)
    python tools/bench_conv_dense.py --cases fp32 --save off --tiles "64,32,4,3;128,32,8,3"

Per case (``fp32``: fp32 x and weight, TF32 as ``torch.backends.cudnn.allow_tf32`` says, PyTorch's
default on; ``bf16``: bf16 x and weight; ``fp32x-bf16``: fp32 x and weight with ``compute_dtype=bf16``,
the autocast case whose casts the kernel absorbs) x ``save`` (the training forward also writes the
conv output without bias), the median ms (``triton.testing.do_bench``) of:

* ``dense``: the launch plan's ``run`` (weight prearrangement + the kernel) with a prebuilt operand
  matrix P, and its achieved GB/s (x read once, out and saved output written once) and TFLOP/s;
* ``cudnn``: ``torch.nn.functional.conv2d`` alone in the compute dtype (no bias, no chain, no cast);
* ``library`` / ``fused``: ``torch.ops.fusion.conv_epilogue_fwd`` with ``FUSION_CONV_IMPL=library``
  (cuDNN + the epilogue kernel) and ``=triton`` (``conv_fused``'s general implicit GEMM);
* the tile the dense plan launched, and its error against a cuDNN reference (full fp32 conv of the
  operands rounded to the compute dtype, the output rounded to it, then bias and chain in fp64):
  norm-wise ``|out - ref| / |ref|`` and ``max |out - ref| / max |ref|``.

``--tiles``: time these tiles (``M,K,warps,stages``) instead of the autotuned one (no autotuning).
A failing case or column prints its error and the run goes on.  Needs CUDA.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusion_backend.kernels.chain_math import OP_CODES  # noqa: E402

#: case -> (x and weight dtype, compute dtype)
CASES = {
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "fp32x-bf16": (torch.float32, torch.bfloat16),
}


def _conv2d(small: bool, dtype: torch.dtype):
    torch.manual_seed(0)
    if small:
        x, w = torch.rand(128, 3, 32, 32), torch.randn(16, 3, 3, 3) * 0.2
    else:
        x, w = torch.rand(64, 64, 256, 256), torch.randn(64, 64, 3, 3) * 0.05
    c = w.shape[0]
    b, m = torch.randn(c), torch.randn(c, 1, 1)
    return x.cuda().to(dtype), w.cuda().to(dtype), b.cuda(), m.cuda()


def _steps(m: torch.Tensor) -> list:
    return [(OP_CODES["mul"], [m]), (OP_CODES["leaky_relu"], [0.01]), (OP_CODES["gelu"], [])]


def _reference(x, w, b, m, compute: torch.dtype) -> torch.Tensor:  # noqa: ANN001
    """cuDNN conv of the operands rounded to ``compute`` (full fp32, TF32 off), the conv output rounded
    to ``compute`` (the kernel's storage rule), then bias and chain in fp64; per sample (memory)."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        w32 = w.to(compute).float()
        outs = []
        for i in range(0, x.shape[0], 8):
            y = torch.nn.functional.conv2d(x[i : i + 8].to(compute).float(), w32).to(compute).double()
            y = (y + b.double()[:, None, None]) * m.double()
            y = torch.where(y > 0, y, y * 0.01)
            outs.append(torch.nn.functional.gelu(y).float())
        return torch.cat(outs)
    finally:
        torch.backends.cudnn.allow_tf32 = saved


def _errors(out: torch.Tensor, ref: torch.Tensor) -> str:
    d = (out.float() - ref).double()
    rel = (d.norm() / ref.double().norm()).item()
    mx = (d.abs().max() / ref.abs().max()).item()
    return f"{rel:.1e}/{mx:.1e}"


def _try(label: str, fn, errors: list[str]):  # noqa: ANN001
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - one failing column must not stop the table
        errors.append(f"{label}: {type(err).__name__}: {str(err).splitlines()[0][:300]}")
        if os.environ.get("BENCH_TRACEBACK"):
            traceback.print_exc()
        return None


def _fmt(v: float | None) -> str:
    return f"{v:8.3f}" if v is not None else "       -"


def run_case(case: str, save: bool, small: bool, tile: tuple[int, ...] | None, do_bench,  # noqa: ANN001
             others: bool = True) -> list[str]:  # fmt: skip
    from fusion_backend.ir.specs import ConvSpec
    from fusion_backend.kernels import conv_dense as CD
    from fusion_backend.kernels.epilogue import build_params
    from fusion_backend.ops import conv_epilogue as ce
    from fusion_backend.ops.chain import ChainStep, Const, PointwiseKind, TensorRef
    from fusion_backend.ops.config import ConvEpilogueConfig

    errors: list[str] = []
    dtype, compute = CASES[case]
    x, w, b, m = _conv2d(small, dtype)
    n, cin, h, wd = x.shape
    cout = w.shape[0]
    oh, ow = h - 2, wd - 2
    out_dtype = torch.float32 if compute != dtype or dtype == torch.float32 else dtype
    out = torch.empty(n, cout, oh, ow, device="cuda", dtype=out_dtype)
    saved_y0 = torch.empty(n, cout, oh, ow, device="cuda", dtype=compute) if save else None
    conv = ConvSpec(False, (1, 1), (0, 0), (1, 1), (0, 0), 1)
    steps = _steps(m)
    tf32 = bool(torch.backends.cudnn.allow_tf32)
    if tile is not None:
        CD._heuristic_config = lambda *a, t=tile: dict(
            BLOCK_M=t[0], BLOCK_K=t[1], num_warps=t[2], num_stages=t[3]
        )
        os.environ["FUSION_CONV_AUTOTUNE"] = "0"
    CD._LAUNCHES._values.clear()
    compute_arg = None if compute == dtype else compute

    start = time.time()
    launch = _try(
        "plan",
        lambda: CD.forward_launch(x, w, b, steps, conv, None, out, saved_y0, None, tf32, compute_arg),
        errors,
    )
    t_dense = err = None
    if launch is not None:
        params = build_params(steps, b, cout, x.device)

        def dense():
            launch.run(x, w, params, b, out, saved_y0, None)

        _try("dense first call", dense, errors)  # autotunes (the tile is bound after it)
        tune_s = time.time() - start
        t_dense = _try("dense", lambda: do_bench(dense, return_mode="median"), errors)
        ref = _try("reference", lambda: _reference(x, w, b, m, compute), errors)
        if ref is not None:
            err = _errors(out, ref)
    else:
        tune_s = time.time() - start
    t_cudnn = None
    if others:
        xc, wc = x.to(compute), w.to(compute)
        cudnn = lambda: torch.nn.functional.conv2d(xc, wc)  # noqa: E731
        t_cudnn = _try("cudnn", lambda: do_bench(cudnn, return_mode="median"), errors)

    pk = PointwiseKind
    chain = (ChainStep(pk.MUL, (TensorRef(0),)), ChainStep(pk.LEAKY_RELU, (Const(0.01),)), ChainStep(pk.GELU))
    autocast = compute != dtype  # the op casts x and w itself; the result stays fp32
    cfg = ConvEpilogueConfig(
        conv=ConvSpec(False, (1, 1), (0, 0), (1, 1), (0, 0), 1),
        chain=chain,
        strict=True,
        compute_dtype=str(compute).split(".")[-1] if autocast else None,
        out_dtype="float32" if autocast else None,
    ).to_json()
    ops = [m.to(dtype) if compute == dtype else m]  # bf16 model: bf16 parameters; autocast: fp32 ones
    times = {}
    for impl in ("library", "triton") if others else ():

        def op(impl=impl):
            os.environ[ce.CONV_IMPL_ENV] = impl
            return torch.ops.fusion.conv_epilogue_fwd(x, w, b, ops, cfg, save)

        times[impl] = _try(impl, lambda op=op: (op(), do_bench(op, return_mode="median"))[1], errors)
    os.environ.pop(ce.CONV_IMPL_ENV, None)

    macs = n * cout * oh * ow * cin * 9
    bytes_moved = x.numel() * x.element_size() + out.numel() * out.element_size()
    if saved_y0 is not None:
        bytes_moved += saved_y0.numel() * saved_y0.element_size()
    rate = ""
    if t_dense:
        rate = f"{bytes_moved / t_dense / 1e6:6.0f} {2 * macs / t_dense / 1e9:6.0f}"
    tile_s = (
        "-" if launch is None or launch.tile() is None else ",".join(f"{v}" for v in launch.tile().values())
    )
    line = (
        f"{case:10s} {save!s:5s} {_fmt(t_dense)} {_fmt(t_cudnn)} {_fmt(times.get('library'))} "
        f"{_fmt(times.get('triton'))} {rate:>13s}  {err or '-':>15s}  {tile_s:16s} {tune_s:5.1f}s"
    )
    return [line] + [f"    ! {e}" for e in errors]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="the small Conv2d: (128, 3, 32, 32) -> 16 channels")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--save", default="both", choices=("both", "on", "off"))
    parser.add_argument("--tiles", default="", help="'M,K,warps,stages;...': time these tiles, no autotuning")
    parser.add_argument("--dense-only", action="store_true", help="time only the dense kernel (tile sweeps)")
    parser.add_argument(
        "--kw-group",
        type=int,
        default=0,
        help="override conv_dense.MAX_KW_GROUP (1: one tap per K step, the unshared X tiles)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA: nothing to time")
        return 0
    import triton.testing

    from fusion_backend.kernels import conv_dense, conv_fused

    # conv_fused's own tile search on the full-size Conv2d would take minutes: its heuristic tile is timed.
    conv_fused.plan._AUTOTUNE_MIN_MACS = 2**62
    if args.kw_group:
        conv_dense.MAX_KW_GROUP = args.kw_group
    tiles = [tuple(int(v) for v in t.split(",")) for t in args.tiles.split(";")] if args.tiles else [None]
    saves = {"both": (False, True), "on": (True,), "off": (False,)}[args.save]
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} "
          f"tf32 {torch.backends.cudnn.allow_tf32} {'Conv2d 3->16 on 128x3x32x32' if args.small else 'Conv2d 64->64 on 64x64x256x256'}")  # fmt: skip
    print(f"{'case':10s} {'save':5s} {'dense':>8s} {'cudnn':>8s} {'library':>8s} {'fused':>8s} "
          f"{'GB/s':>6s} {'TFLOPs':>6s}  {'rel.err norm/max':>16s} {'tile M,N,K,w,s':16s} first")  # fmt: skip
    for tile in tiles:
        for case in args.cases.split(","):
            for save in saves:
                try:
                    lines = run_case(
                        case, save, args.small, tile, triton.testing.do_bench, not args.dense_only
                    )
                except Exception as err:  # noqa: BLE001
                    lines = [f"{case:10s} {save!s:5s} FAILED {type(err).__name__}: {str(err)[:300]}"]
                print("\n".join(lines), flush=True)
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
