"""Compile the conv_fused_bwd kernels for sm_90 without a GPU: catches GPU-only compile errors.

    TRITON_DEFAULT_FP_FUSION=1 python tools/compile_check_conv_fused_bwd.py [fp32|bf16] [--quick]

For the ``pooled`` (ConvTranspose3d 16->32 k3 s2 behind MaxPool3d(2): max-pooled, transposed) and
``dense`` (Conv2d 64->64 k3; NCHW and channels-last) specialisations, the convs of the ``seeds``
suite, and every autotune config (only the first with ``--quick``): Triton -> PTX -> cubin, then
``ptxas -v`` for registers and spills.  Uses Triton internals (``ASTSource``), so it may need a touch
after a Triton update.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # before the kernels are decorated
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fusion_backend.kernels import conv_fused_bwd as K  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
_ONE = dict(PDD=1, PDH=1, PDW=1, NJD=1, NJH=1, NJW=1)
POOL = dict(PKD=2, PKH=2, PKW=2, PSD=2, PSH=2, PSW=2, PPD=0, PPH=0, PPW=0, **_ONE)
NOPOOL = dict(PKD=1, PKH=1, PKW=1, PSD=1, PSH=1, PSW=1, PPD=0, PPH=0, PPW=0, **_ONE)


def compile_one(kernel, ptr_types: dict[str, str], consts: dict, num_warps: int, num_stages: int) -> str:
    fn = kernel.fn
    sig = {name: "constexpr" if name in consts else ptr_types.get(name, "i32") for name in fn.arg_names}
    start = time.time()
    compiled = triton.compile(
        ASTSource(fn, sig, constexprs=consts), target=TARGET,
        options=dict(num_warps=num_warps, num_stages=num_stages),
    )  # fmt: skip
    ptx = compiled.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas-blackwell"
    out = subprocess.run([str(ptxas), "--gpu-name", "sm_90a", "-v", f.name, "-o", os.devnull],
                         capture_output=True, text=True).stderr  # fmt: skip
    regs = re.findall(r"Used (\d+) registers", out)
    spills = re.findall(r"(\d+) bytes spill stores", out)
    return (f"{fn.__name__} warps={num_warps} stages={num_stages} {time.time() - start:.1f}s regs={regs} "
            f"spill={spills} shared={compiled.metadata.shared} wgmma={'wgmma' in ptx}")  # fmt: skip


def main() -> int:
    dt = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "fp32"
    quick = "--quick" in sys.argv
    prec = "tf32" if dt == "fp32" else "ieee"
    d_ptr = {"g_ptr": f"*{dt}", "win_ptr": "*i8", "w_ptr": f"*{dt}", "tab_ptr": "*i32", "cnt_ptr": "*i32",
             "dx_ptr": f"*{dt}"}  # fmt: skip
    dense = dict(XSD=1, XSH=1, XSW=1, GSD=1, GSH=1, GSW=1, POOLED=False, **NOPOOL, BLOCK_N=64, BLOCK_K=64)
    d_cases = {
        "pooled": (d_ptr, dict(XSD=1, XSH=1, XSW=1, GSD=2, GSH=2, GSW=2, POOLED=True, G_CL=False, X_CL=False,
                               **POOL, BLOCK_N=16, BLOCK_K=32)),
        "dense": ({**d_ptr, "win_ptr": f"*{dt}"}, dict(dense, G_CL=False, X_CL=False)),
        "dense_cl": ({**d_ptr, "win_ptr": f"*{dt}"}, dict(dense, G_CL=True, X_CL=True)),
    }  # fmt: skip
    w_ptr = {"a_ptr": f"*{dt}", "b_ptr": f"*{dt}", "win_ptr": "*i8", "tab_ptr": "*i32", "part_ptr": "*fp32"}
    w_dense = dict(SD=1, SH=1, SW=1, G_IS_A=True, A_POOLED=False, B_POOLED=False, **NOPOOL, BLOCK_A=64, BLOCK_G=64)
    w_cases = {
        "pooled": (w_ptr, dict(SD=2, SH=2, SW=2, G_IS_A=False, A_POOLED=False, B_POOLED=True, A_CL=False, B_CL=False,
                               **POOL, BLOCK_A=16, BLOCK_G=32, BLOCK_R=32, LINE_MODE=True)),
        "dense": (w_ptr, dict(w_dense, A_CL=False, B_CL=False, BLOCK_R=64, LINE_MODE=True)),
        "dense_cl_flat": (w_ptr, dict(w_dense, A_CL=True, B_CL=True, BLOCK_R=64, LINE_MODE=False)),
    }  # fmt: skip
    for kernel, configs, cases in ((K._dgrad_tuned, K._dgrad_configs(), d_cases),
                                   (K._wgrad_tuned, K._wgrad_configs(), w_cases)):  # fmt: skip
        for cfg in configs[:1] if quick else configs:
            for name, (ptrs, consts) in cases.items():
                line = compile_one(kernel, ptrs, dict(consts, PREC=prec, I64=False, **cfg.kwargs), cfg.num_warps,
                                   cfg.num_stages)  # fmt: skip
                print(f"{name:14s} {cfg.kwargs} {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
