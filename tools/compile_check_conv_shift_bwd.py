"""Compile the conv_shift_bwd kernels for sm_90 without a GPU: catches GPU-only compile errors.

    python tools/compile_check_conv_shift_bwd.py [--quick] [--cases A-fp32,A-bf16,A-fp32-cl] [--tiles ...]

For seed A (ConvTranspose3d 16->32 k3 s2 p1 op1 on (16, 16, 16, 32, 32), MaxPool3d(2) gradient in
compact form), fp32 (TF32) and bf16, contiguous or channels-last (``-cl``): the launchers run on
empty CPU tensors of the full seed shapes with the kernels replaced by recorders, so the constexprs
and the argument specialisation (``tt.divisibility``, ints equal to 1) are exactly what a CUDA
launch would compile; then, for every tile the autotuner would try on that shape (only the first
with ``--quick``), Triton -> PTX -> cubin for sm_90a and ``ptxas -v`` (Triton's bundled ptxas) for
registers and spills, plus shared memory and whether ``wgmma`` appears in the PTX.  The finish
kernel (weight-grad partials -> taps) is compiled once per case.  Uses Triton internals
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
os.environ["FUSION_CONV_AUTOTUNE"] = "0"  # the launchers take the heuristic (recorded) launch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402

from fusion_backend.kernels import conv_fused_bwd as FB  # noqa: E402
from fusion_backend.kernels import conv_shift_bwd as S  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
_BACKEND = make_backend(TARGET)
_TILE_KEYS = ("BLOCK_M", "BLOCK_CI", "BLOCK_CO", "KPB", "num_warps", "num_stages")
_KERNELS = ("_shift_dgrad_kernel", "_shift_wgrad_kernel", "_shift_wgrad_finish_kernel")


class _Recorder:
    """Stands in for a jitted kernel: ``kernel[grid](*args, **kw)`` records the call."""

    def __init__(self, fn) -> None:  # noqa: ANN001
        self.fn = fn
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):  # noqa: ANN001
        return lambda *args, **kw: self.calls.append((args, kw))


def _seed_a(dtype: torch.dtype, channels_last: bool):
    x = torch.empty(16, 16, 16, 32, 32, dtype=dtype)
    w = torch.empty(16, 32, 3, 3, 3, dtype=dtype)
    g_win = torch.empty(16, 32, 16, 32, 32, dtype=torch.float32)
    winner = torch.empty(16, 32, 16, 32, 32, dtype=torch.int8)
    if channels_last:
        fmt = torch.channels_last_3d
        x, g_win, winner = (t.contiguous(memory_format=fmt) for t in (x, g_win, winner))
    args = ((2, 2, 2), (1, 1, 1), (1, 1, 1), True, (1, 1, 1), 1)
    return FB.PooledGrad(g_win, winner, (2, 2, 2)), x, w, args


def record_launches(dtype: torch.dtype, channels_last: bool) -> dict[str, tuple[tuple, dict]]:
    """Per kernel name, the positional args and keyword constexprs of seed A's backward launches."""
    recorders = {name: _Recorder(getattr(S, name)) for name in _KERNELS}
    saved = {name: getattr(S, name) for name in _KERNELS}
    saved_flags = S._INTERPRET, S._sm_count, torch.backends.cudnn.allow_tf32
    for name, rec in recorders.items():
        setattr(S, name, rec)
    S._INTERPRET, S._sm_count = False, lambda device: 132  # an H100's SM count sets the split count
    torch.backends.cudnn.allow_tf32 = True  # PyTorch's default on CUDA
    try:
        grad, x, w, args = _seed_a(dtype, channels_last)
        geo = S._geometry(grad, x, w, args[0], args[1], args[2], args[4], args[5])
        S._input_grad(grad, x, w, geo)
        S._weight_grad(grad, x, w, geo)
    finally:
        for name, fn in saved.items():
            setattr(S, name, fn)
        S._INTERPRET, S._sm_count, torch.backends.cudnn.allow_tf32 = saved_flags
    out = {}
    for name, rec in recorders.items():
        ((call_args, kw),) = rec.calls
        out[name] = (call_args, {k: v for k, v in kw.items() if k not in _TILE_KEYS})
    return out


def compile_one(fn, args: tuple, consts: dict, num_warps: int, num_stages: int) -> str:  # noqa: ANN001
    """Compile one specialisation; a line with time, registers, spills, shared memory and wgmma."""
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
    compiled = triton.compile(
        ASTSource(fn, sig, constexprs=consts, attrs=attrs),
        target=TARGET,
        options=dict(num_warps=num_warps, num_stages=num_stages),
    )
    ptx = compiled.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas-blackwell"
    out = subprocess.run(
        [str(ptxas), "--gpu-name", "sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True
    ).stderr
    if os.environ.get("KEEP_TTGIR"):  # inspection: a folder receiving each kernel's last TTGIR (layouts)
        Path(os.environ["KEEP_TTGIR"], f"{fn.__name__}.ttgir").write_text(compiled.asm["ttgir"])
    os.unlink(f.name)
    regs = re.findall(r"Used (\d+) registers", out)
    spills = re.findall(r"(\d+) bytes spill stores", out)
    return (
        f"{time.time() - start:5.1f}s regs={','.join(regs)} spill={','.join(spills)} "
        f"shared={compiled.metadata.shared} wgmma={'wgmma' in ptx}"
    )


def _parse_tiles(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(v) for v in tile.split(",")) for tile in text.split(";") if tile]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the first tile per kernel and case")
    parser.add_argument("--cases", default="A-fp32,A-bf16")
    parser.add_argument(
        "--dgrad-tiles", default="", help="'M,CI,CO,KPB,warps,stages;...' instead of the list"
    )
    parser.add_argument(
        "--wgrad-tiles", default="", help="'M,CI,CO,KPB,warps,stages;...' instead of the list"
    )
    opts = parser.parse_args(argv)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    failures = 0
    for case in opts.cases.split(","):
        seed, dt, *rest = case.split("-")
        assert seed == "A", f"only seed A is known, got {case!r}"
        launches = record_launches(dtypes[dt], "cl" in rest)
        for name, tiles, custom in (
            ("_shift_dgrad_kernel", S._DGRAD_TILES, opts.dgrad_tiles),
            ("_shift_wgrad_kernel", S._WGRAD_TILES, opts.wgrad_tiles),
        ):
            args, consts = launches[name]
            named = dict(zip(getattr(S, name).arg_names, args, strict=False))
            kpn = consts["KD"] * consts["KH"] * consts["KW"]
            fit = _parse_tiles(custom) if custom else S._fit(tiles, named["CI_G"], named["CO_G"], kpn)
            for tile in fit[:1] if opts.quick else fit:
                bm, bci, bco, kpb, warps, stages = tile
                meta = dict(BLOCK_M=bm, BLOCK_CI=bci, BLOCK_CO=bco, KPB=kpb)
                try:
                    line = compile_one(getattr(S, name), args, {**consts, **meta}, warps, stages)
                except Exception as err:  # noqa: BLE001 - report every failing specialisation, go on
                    failures += 1
                    line = f"FAIL {type(err).__name__}: {str(err)[:1500]}"
                label = f"M{bm} CI{bci} CO{bco} KPB{kpb} w{warps} s{stages}"
                print(f"{case:10s} {name[7:12]} {label:30s} {line}", flush=True)
        args, consts = launches["_shift_wgrad_finish_kernel"]
        line = compile_one(S._shift_wgrad_finish_kernel, args, consts, 4, 1)
        print(f"{case:10s} finish {'':30s} {line}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
