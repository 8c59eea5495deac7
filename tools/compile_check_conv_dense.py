"""Compile the dense conv forward kernel (``kernels/conv_dense.py``) for sm_90a without a GPU.

    python tools/compile_check_conv_dense.py [--quick] [--cases conv2d-fp32,conv2d-bf16,conv2d-fp32x-bf16]
        [--save both|on|off] [--tiles M,K,warps,stages;...] [--sass] [--dump-sass DIR]

For the ``seeds`` suite's Conv2d(64, 64, 3) over (64, 64, 256, 256), chain mul -> leaky_relu -> gelu,
no pool: ``conv2d-fp32`` fp32 x and weight with TF32 (``allow_tf32``, PyTorch's default),
``conv2d-bf16`` bf16 x and weight, ``conv2d-fp32x-bf16`` fp32 x and weight with
``compute_dtype=bfloat16`` (autocast absorbed), each with and without the saved conv output.  The
launcher runs on empty CPU tensors of the full shapes with the kernels replaced by recorders, so the
constexprs and the argument specialisation (``tt.divisibility``, ints equal to 1) are exactly what a
CUDA launch compiles; then for every autotune tile ``_prune`` keeps (only the first with ``--quick``):
Triton -> PTX -> cubin for sm_90a, ``ptxas -v`` for registers and spills, and whether ``wgmma``
appears in the PTX (see ``tools/compile_check_conv_fused.py``, whose compile and SASS helpers this
reuses).  The weight prearrangement kernel is compiled once per case.  Exit status 1 when any compile
failed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compile_check_conv_fused as ccf  # noqa: E402  (sets TRITON_INTERPRET / FUSION_CONV_AUTOTUNE first)
import torch  # noqa: E402
import triton  # noqa: E402

from fusion_backend.kernels import conv_dense as CD  # noqa: E402
from fusion_backend.kernels.conv_fused import ConvGeometry  # noqa: E402
from fusion_backend.kernels.epilogue import OP_CODES  # noqa: E402

_TILE_KEYS = ("BLOCK_M", "BLOCK_K", "num_warps", "num_stages")
#: case -> (x dtype, weight dtype, compute dtype)
CASES = {
    "conv2d-fp32": (torch.float32, torch.float32, None),
    "conv2d-bf16": (torch.bfloat16, torch.bfloat16, None),
    "conv2d-fp32x-bf16": (torch.float32, torch.float32, torch.bfloat16),
}


def record_launch(
    case: str, save: bool, shape: tuple[int, ...] = (64, 64, 256, 256)
) -> tuple[tuple, dict, tuple]:
    """``(args, constexprs)`` of the main kernel's launch for that Conv2d (tile keys left out), and
    ``(args, constexprs)`` of the weight prearrangement's."""
    x_dtype, w_dtype, compute = CASES[case]
    rec, rec_w = ccf._Recorder(), ccf._Recorder()
    saved = CD._conv_dense_fwd_kernel, CD._dense_weight_kernel, CD._INTERPRET
    CD._conv_dense_fwd_kernel, CD._dense_weight_kernel, CD._INTERPRET = rec, rec_w, False
    try:
        n, c, h, w = shape
        x = torch.empty(n, c, h, w, dtype=x_dtype)
        weight = torch.empty(c, c, 3, 3, dtype=w_dtype)
        bias, mult = torch.zeros(c), torch.ones(c, 1, 1)
        conv = ConvGeometry(False, (1, 1), (0, 0), (1, 1), (0, 0), 1)
        out_dtype = x_dtype if compute is None else torch.float32
        y_dtype = compute or x_dtype
        out = torch.empty(n, c, h - 2, w - 2, dtype=out_dtype)
        saved_a = torch.empty(n, c, h - 2, w - 2, dtype=y_dtype) if save else None
        steps = [(OP_CODES["mul"], [mult]), (OP_CODES["leaky_relu"], [0.01]), (OP_CODES["gelu"], [])]
        CD._LAUNCHES._values.clear()
        CD.conv_dense_forward(
            x, weight, bias, steps, conv, None, out, saved_a, allow_tf32=True, compute_dtype=compute
        )
    finally:
        CD._conv_dense_fwd_kernel, CD._dense_weight_kernel, CD._INTERPRET = saved
        CD._LAUNCHES._values.clear()
    ((args, kw),) = rec.calls
    return args, {k: v for k, v in kw.items() if k not in _TILE_KEYS}, rec_w.calls[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the first kept tile per case")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--save", default="both", choices=("both", "on", "off"))
    parser.add_argument("--tiles", default="", help="'M,K,warps,stages;...' instead of the autotune tiles")
    parser.add_argument(
        "--sass", action="store_true", help="count SASS instructions by class (main loop, kernel)"
    )
    parser.add_argument("--dump-sass", default="", help="directory for the SASS listings (implies --sass)")
    opts = parser.parse_args(argv)
    saves = {"both": (False, True), "on": (True,), "off": (False,)}[opts.save]
    failures = 0
    for case in opts.cases.split(","):
        for save in saves:
            args, consts, (w_args, w_consts) = record_launch(case, save)
            name = f"{case}{'-save' if save else ''}"
            if not save:  # the weight kernel does not depend on SAVE
                try:
                    line = ccf.compile_one(w_args, w_consts, 4, 1, fn=CD._dense_weight_kernel)
                except Exception as err:  # noqa: BLE001
                    failures += 1
                    line = f"FAIL {type(err).__name__}: {str(err)[:1500]}"
                print(f"{name:22s} {'weight matrix':21s} {line}", flush=True)
            if opts.tiles:
                configs = [
                    triton.Config(dict(BLOCK_M=t[0], BLOCK_K=t[1]), num_warps=t[2], num_stages=t[3])
                    for t in ([int(v) for v in tile.split(",")] for tile in opts.tiles.split(";"))
                ]  # fmt: skip
            else:
                named = dict(zip(CD._conv_dense_fwd_kernel.arg_names, args, strict=False))
                configs = CD._prune(CD._configs(), named, **consts)
            for cfg in configs[:1] if opts.quick else configs:
                kw = cfg.kwargs
                tile = f"M{kw['BLOCK_M']} N{consts['BLOCK_N']} K{kw['BLOCK_K']} w{cfg.num_warps} "
                tile += f"s{cfg.num_stages}"
                try:
                    dump = None
                    if opts.dump_sass:
                        Path(opts.dump_sass).mkdir(parents=True, exist_ok=True)
                        dump = Path(opts.dump_sass) / f"{name}_{tile.replace(' ', '_')}.sass"
                    sass = opts.sass or bool(opts.dump_sass)
                    line = ccf.compile_one(
                        args, {**consts, **kw}, cfg.num_warps, cfg.num_stages, fn=CD._conv_dense_fwd_kernel,
                        sass=sass, dump=dump,
                    )  # fmt: skip
                except Exception as err:  # noqa: BLE001 - report every failing specialisation, go on
                    failures += 1
                    line = f"FAIL {type(err).__name__}: {str(err)[:1500]}"
                print(f"{name:22s} {tile:21s} {line}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
