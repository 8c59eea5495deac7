"""Compile the fused conv forward kernel for sm_90 without a GPU: catches GPU-only compile errors.

    python tools/compile_check_conv_fused.py [--quick] [--cases A-fp32,A-bf16,B-fp32,B-bf16,Awide-fp32]

For the seed-A (ConvTranspose3d + chain + MaxPool3d, training forward with saved state) and seed-B
(Conv2d + chain, no pool) specialisations, fp32 (TF32) and bf16: the launcher runs on empty CPU
tensors of the full seed shapes with the kernel replaced by a recorder, so the constexprs and the
argument specialisation (``tt.divisibility``, ints equal to 1) are exactly what a CUDA launch would
compile; then, for every autotune config that ``_prune`` keeps for the shape (only the first with
``--quick``), Triton -> PTX -> cubin for sm_90a and ``ptxas -v`` (Triton's bundled ptxas) for
registers and spills, plus whether ``wgmma`` appears in the PTX.  Uses Triton internals
(``ASTSource``, ``native_specialize_impl``), so it may need a touch after a Triton update.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # before the kernels are decorated
os.environ["FUSION_CONV_AUTOTUNE"] = "0"  # the launcher takes the heuristic (recorded) launch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402

from fusion_backend.kernels import conv_fused as CF  # noqa: E402
from fusion_backend.ops import conv_epilogue as ce  # noqa: E402
from fusion_backend.ops.chain import ChainStep, Const, PointwiseKind, TensorRef  # noqa: E402
from fusion_backend.ops.config import ConvEpilogueConfig, ConvSpec, PoolSpec  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
_BACKEND = make_backend(TARGET)
_TILE_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
PK = PointwiseKind


class _Recorder:
    """Stands in for the jitted kernel: ``kernel[grid](*args, **kw)`` records the call."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((args, kw))


def _seed(name: str, dtype: torch.dtype):
    """The seed's tensors (empty, full size, CPU) and config, as ``tools/bench_conv_fused.py``."""
    if name in ("A", "Awide"):  # Awide: 48 input channels, the SHIFT_K path with several channel blocks
        spec = ConvSpec(True, (2, 2, 2), (1, 1, 1), (1, 1, 1), (1, 1, 1), 1)
        leaky = ChainStep(PK.LEAKY_RELU, (Const(0.2),))
        chain = (leaky, ChainStep(PK.MUL, (TensorRef(0),)), leaky)
        pool = PoolSpec("max", (2, 2, 2), (2, 2, 2), (0, 0, 0))
        cin = 16 if name == "A" else 48
        x, w, c = torch.empty(16, cin, 16, 32, 32, dtype=dtype), torch.empty(cin, 32, 3, 3, 3, dtype=dtype), 32
    else:
        spec = ConvSpec(False, (1, 1), (0, 0), (1, 1), (0, 0), 1)
        chain = (ChainStep(PK.MUL, (TensorRef(0),)), ChainStep(PK.LEAKY_RELU, (Const(0.01),)), ChainStep(PK.GELU))
        pool = None
        x, w, c = torch.empty(64, 64, 256, 256, dtype=dtype), torch.empty(64, 64, 3, 3, dtype=dtype), 64
    b, m = torch.zeros(c, dtype=dtype), torch.ones((c,) + (1,) * (x.dim() - 2), dtype=dtype)
    cfg = ConvEpilogueConfig(conv=spec, chain=chain, pool=pool, strict=True)
    return x, w, b, [m], cfg


def record_launch(seed: str, dtype: torch.dtype) -> tuple[tuple, dict, tuple | None]:
    """The positional args and keyword constexprs of the seed's training-forward launch, and the
    (args, constexprs) of its weight-matrix launch (None when the path has none)."""
    rec, rec_w = _Recorder(), _Recorder()
    saved = CF._conv_fused_fwd_kernel, CF._shift_k_weight_kernel, CF._INTERPRET, torch.backends.cudnn.allow_tf32
    CF._conv_fused_fwd_kernel, CF._shift_k_weight_kernel, CF._INTERPRET = rec, rec_w, False
    torch.backends.cudnn.allow_tf32 = True  # PyTorch's default on CUDA
    try:
        x, w, b, ops, cfg = _seed(seed, dtype)
        ce._fused_conv_forward(x, w, b, ops, cfg, True)
    finally:
        CF._conv_fused_fwd_kernel, CF._shift_k_weight_kernel, CF._INTERPRET, torch.backends.cudnn.allow_tf32 = saved
    (args, kw), = rec.calls
    return args, {k: v for k, v in kw.items() if k not in _TILE_KEYS}, (rec_w.calls[0] if rec_w.calls else None)


def compile_one(args: tuple, consts: dict, num_warps: int, num_stages: int, fn=None) -> str:  # noqa: ANN001
    """Compile one specialisation; a line with time, registers, spills, shared memory and wgmma."""
    fn = fn or CF._conv_fused_fwd_kernel
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        ty, spec = native_specialize_impl(type(_BACKEND), args[i], False, True, True)
        if ty == "constexpr":  # an int equal to 1, as the JIT specialises it
            sig[name], consts = "constexpr", {**consts, name: spec}
        else:
            sig[name] = ty
            if spec:
                attrs[(i,)] = _BACKEND.parse_attr(spec)
    start = time.time()
    compiled = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=TARGET,
                              options=dict(num_warps=num_warps, num_stages=num_stages))  # fmt: skip
    ptx = compiled.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas-blackwell"
    out = subprocess.run([str(ptxas), "--gpu-name", "sm_90a", "-v", f.name, "-o", os.devnull],
                         capture_output=True, text=True).stderr  # fmt: skip
    if os.environ.get("KEEP_PTX"):  # inspection: the last compiled config's PTX / TTGIR (layouts)
        Path(os.environ["KEEP_PTX"]).write_text(ptx)
    if os.environ.get("KEEP_TTGIR"):
        Path(os.environ["KEEP_TTGIR"]).write_text(compiled.asm["ttgir"])
    os.unlink(f.name)
    regs = re.findall(r"Used (\d+) registers", out)
    spills = re.findall(r"(\d+) bytes spill stores", out)
    return (f"{time.time() - start:5.1f}s regs={','.join(regs)} spill={','.join(spills)} "
            f"shared={compiled.metadata.shared} wgmma={'wgmma' in ptx} ptx_lines={ptx.count(chr(10))}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the first kept config per case")
    parser.add_argument("--cases", default="A-fp32,A-bf16,B-fp32,B-bf16")
    parser.add_argument("--tiles", default="", help="'M,N,K,warps,stages;...' instead of the autotune configs")
    opts = parser.parse_args(argv)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    failures = 0
    for case in opts.cases.split(","):
        seed, dt = case.split("-")
        args, consts, weight_launch = record_launch(seed, dtypes[dt])
        if weight_launch is not None:
            try:
                line = compile_one(*weight_launch, 4, 1, fn=CF._shift_k_weight_kernel)
            except Exception as err:  # noqa: BLE001
                failures += 1
                line = f"FAIL {type(err).__name__}: {str(err)[:1500]}"
            print(f"{case:7s} {'weight matrix':22s} {line}", flush=True)
        named = dict(zip(CF._conv_fused_fwd_kernel.arg_names, args, strict=False))
        if opts.tiles:
            configs = [
                triton.Config(dict(BLOCK_M=t[0], BLOCK_N=t[1], BLOCK_K=t[2]), num_warps=t[3], num_stages=t[4])
                for t in ([int(v) for v in tile.split(",")] for tile in opts.tiles.split(";"))
            ]  # fmt: skip
        else:
            configs = CF._prune(CF._configs(), named, **consts)
        for cfg in configs[:1] if opts.quick else configs:
            tile = (f"M{cfg.kwargs['BLOCK_M']} N{cfg.kwargs['BLOCK_N']} K{cfg.kwargs['BLOCK_K']} "
                    f"w{cfg.num_warps} s{cfg.num_stages}")  # fmt: skip
            try:
                line = compile_one(args, {**consts, **cfg.kwargs}, cfg.num_warps, cfg.num_stages)
            except Exception as err:  # noqa: BLE001 - report every failing specialisation, go on
                failures += 1
                line = f"FAIL {type(err).__name__}: {str(err)[:1500]}"
            print(f"{case:7s} {tile:22s} {line}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
