"""Compile the conv_shift_bwd kernels for sm_90 without a GPU: catches GPU-only compile errors.

    python tools/compile_check_conv_shift_bwd.py [--quick] [--cases convt3d-fp32,convt3d-bf16,convt3d-fp32-cl]
        [--tiles ...]

For ``convt3d``, the ``seeds`` suite's ConvTranspose3d 16->32 k3 s2 p1 op1 on (16, 16, 16, 32, 32)
(MaxPool3d(2) gradient in compact form), fp32 (TF32) and bf16, contiguous or channels-last (``-cl``):
the launchers run on empty CPU tensors of the full shapes with the kernels replaced by recorders, so
the constexprs and the argument specialisation (``tt.divisibility``, ints equal to 1) are exactly what
a CUDA launch would compile; then, for every tile the autotuner would try on that shape (only the
first with ``--quick``), Triton -> PTX -> cubin for sm_90a and ``ptxas -v`` (Triton's bundled ptxas)
for registers and spills, plus shared memory and whether ``wgmma`` appears in the PTX.  The finish
kernel (weight-grad partials -> taps) is compiled once per case.  Uses Triton internals
(``ASTSource``, ``native_specialize_impl``), so it may need a touch after a Triton update.

``--sass`` also disassembles each cubin (Triton's bundled ``nvdisasm``) and counts the static
instructions of the kernel's *main loop* -- the innermost loop (backward branch) holding an MMA
(HGMMA / HMMA): the weight grad's loop over unit rows, the input grad's loop over live offset
blocks -- by class (int: integer/logic/predicate, mem: global/shared loads and stores, mma,
fp: float arithmetic/compares, cvt: conversions and MUFU, other), and prints
``instr/mma`` (loop instructions per MMA instruction: the headline static cost proxy; compare
like with like, an fp32/TF32 HGMMA has K=8 and a bf16 one K=16, and the HGMMA shape follows the
tile), ``instr/row`` (per unit row of BLOCK_M) and ``warp-instr/kMAC`` (the loop's instructions
times the CTA's warps per 1000 multiply-adds of one iteration: comparable across tiles; an H100
SM issues 4 warp-instructions per clock and runs ~1000 TF32 / ~2000 bf16 dense MACs per clock).  ``--sass-dump DIR`` writes each kernel's SASS there.
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


def _convt3d_maxpool(dtype: torch.dtype, channels_last: bool):
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
    """Per kernel name, the positional args and keyword constexprs of the ConvT3d conv's backward launches."""
    recorders = {name: _Recorder(getattr(S, name)) for name in _KERNELS}
    saved = {name: getattr(S, name) for name in _KERNELS}
    saved_flags = S._INTERPRET, S._sm_count, torch.backends.cudnn.allow_tf32
    for name, rec in recorders.items():
        setattr(S, name, rec)
    S._INTERPRET, S._sm_count = False, lambda device: 132  # an H100's SM count sets the split count
    torch.backends.cudnn.allow_tf32 = True  # PyTorch's default on CUDA
    try:
        grad, x, w, args = _convt3d_maxpool(dtype, channels_last)
        geo = S._geometry(grad, x, w, args[0], args[1], args[2], args[4], args[5])
        S._prepare_input_grad(grad, x, w, geo, x.dtype)(grad, x, w)
        S._prepare_weight_grad(grad, x, w, geo, x.dtype)(grad, x, w)
    finally:
        for name, fn in saved.items():
            setattr(S, name, fn)
        S._INTERPRET, S._sm_count, torch.backends.cudnn.allow_tf32 = saved_flags
    out = {}
    for name, rec in recorders.items():
        ((call_args, kw),) = rec.calls
        out[name] = (call_args, {k: v for k, v in kw.items() if k not in _TILE_KEYS})
    return out


_NV_BIN = Path(triton.__file__).parent / "backends/nvidia/bin"
#: SASS opcode (before the first '.') -> class, for the main-loop counts.
_CLASSES = {
    "int": set(
        "IMAD IADD3 IADD VIADD VIADDMNMX VIMNMX VIMNMX3 LOP3 LOP ISETP SEL SHF SHL SHR LEA IABS IMNMX PRMT "
        "PLOP3 P2R R2P POPC FLO BREV BMSK SGXT IMUL ISCADD MOV CS2R S2R S2UR UIADD3 UIMAD ULOP3 USEL UISETP "
        "USHF ULEA UMOV UPRMT ULDC LDC VOTE VOTEU R2UR UP2UR IDP UIABS UFLO UPOPC UBMSK USGXT".split()
    ),
    "mem": set("LDG STG LDS STS LDSM STSM LDGSTS LDL STL ATOMG RED LD ST LDGDEPBAR".split()),
    "mma": {"HGMMA", "HMMA", "IMMA"},
    "fp": set("FADD FMUL FFMA FSETP FSEL FMNMX FCHK HADD2 HMUL2 HFMA2 HSETP2 FSET DSETP".split()),
    "cvt": set("F2F F2I I2F I2FP F2FP MUFU FRND".split()),
}
_CLASS_OF = {op: cls for cls, ops in _CLASSES.items() for op in ops}
_SASS_LINE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*)(\S*)\s*([^;]*);")
_BRANCH = re.compile(r"BRA\b[^`]*`\((\.L_x_\d+)\)")


def main_loop_counts(cubin: bytes, block_m: int, macs: int, num_warps: int) -> str:
    """Static instruction counts of the innermost SASS loop holding an MMA (see the module docstring)."""
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        sass = subprocess.run(
            [str(_NV_BIN / "nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True
        ).stdout
    finally:
        os.unlink(f.name)
    ops: list[str] = []  # opcode per instruction, in address order
    labels: dict[str, int] = {}  # label -> index of the next instruction
    loops: list[tuple[int, int]] = []
    for line in sass.splitlines():
        stripped = line.strip()
        if stripped.startswith(".L_x_") and stripped.endswith(":"):
            labels[stripped[:-1]] = len(ops)
            continue
        m = _SASS_LINE.search(line)
        if not m:
            continue
        b = _BRANCH.search(line)
        if b and b.group(1) in labels:  # a backward branch: a loop [target, here]
            loops.append((labels[b.group(1)], len(ops)))
        ops.append(m.group(1))
    with_mma = [(lo, hi) for lo, hi in loops if any(_CLASS_OF.get(o) == "mma" for o in ops[lo : hi + 1])]
    if not with_mma:
        return "sass: no MMA loop"
    lo, hi = min(with_mma, key=lambda span: span[1] - span[0])
    body = ops[lo : hi + 1]
    counts = {cls: 0 for cls in (*_CLASSES, "other")}
    for op in body:
        counts[_CLASS_OF.get(op, "other")] += 1
    mma = counts["mma"]
    top = sorted({op: body.count(op) for op in set(body)}.items(), key=lambda kv: -kv[1])[:6]
    return (
        f"loop={len(body)} mma={mma} instr/mma={len(body) / mma:.0f} instr/row={len(body) / block_m:.1f} "
        f"warp-instr/kMAC={len(body) * num_warps * 1000 / macs:.2f} "
        + " ".join(f"{cls}={n}" for cls, n in counts.items())
        + " top="
        + ",".join(f"{op}:{n}" for op, n in top)
    )


def compile_one(fn, args: tuple, consts: dict, num_warps: int, num_stages: int, sass: bool = False) -> str:  # noqa: ANN001
    """Compile one specialisation; a line with time, registers, spills, shared memory and wgmma
    (and with ``sass``, the main loop's instruction counts)."""
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
    if os.environ.get("SASS_DUMP"):
        tag = "_".join(f"{k}{consts[k]}" for k in ("BLOCK_M", "BLOCK_CI", "BLOCK_CO", "KPB") if k in consts)
        name = f"{fn.__name__}_{tag}_w{num_warps}_{consts.get('PREC', '')}_{os.environ.get('SASS_CASE', '')}"
        cubin_path = Path(os.environ["SASS_DUMP"], name + ".cubin")
        cubin_path.write_bytes(compiled.asm["cubin"])
        Path(os.environ["SASS_DUMP"], name + ".ttgir").write_text(compiled.asm["ttgir"])
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
    line = (
        f"{time.time() - start:5.1f}s regs={','.join(regs)} spill={','.join(spills)} "
        f"shared={compiled.metadata.shared} wgmma={'wgmma' in ptx}"
    )
    if sass:
        bm, bci, bco, kpb = (consts[k] for k in ("BLOCK_M", "BLOCK_CI", "BLOCK_CO", "KPB"))
        macs = bm * bci * bco * kpb * consts.get("KS", 1)  # per loop iteration (dgrad: per block)
        line += " | " + main_loop_counts(compiled.asm["cubin"], bm, macs, num_warps)
    return line


def _parse_tiles(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(v) for v in tile.split(",")) for tile in text.split(";") if tile]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the first tile per kernel and case")
    parser.add_argument("--cases", default="convt3d-fp32,convt3d-bf16")
    parser.add_argument(
        "--sass", action="store_true", help="count the main loop's SASS instructions by class"
    )
    parser.add_argument("--sass-dump", default="", help="folder receiving each kernel's cubin and TTGIR")
    parser.add_argument("--kernels", default="dgrad,wgrad", help="which of dgrad,wgrad to compile")
    parser.add_argument(
        "--dgrad-tiles", default="", help="'M,CI,CO,KPB,warps,stages;...' instead of the list"
    )
    parser.add_argument(
        "--wgrad-tiles", default="", help="'M,CI,CO,KPB,warps,stages;...' instead of the list"
    )
    opts = parser.parse_args(argv)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    failures = 0
    if opts.sass_dump:
        Path(opts.sass_dump).mkdir(parents=True, exist_ok=True)
        os.environ["SASS_DUMP"] = opts.sass_dump
    for case in opts.cases.split(","):
        os.environ["SASS_CASE"] = case
        conv, dt, *rest = case.split("-")
        assert conv == "convt3d", f"only convt3d is known, got {case!r}"
        launches = record_launches(dtypes[dt], "cl" in rest)
        for name, tiles, custom in (
            ("_shift_dgrad_kernel", S._DGRAD_TILES, opts.dgrad_tiles),
            ("_shift_wgrad_kernel", S._WGRAD_TILES, opts.wgrad_tiles),
        ):
            if name[7:12] not in opts.kernels:
                continue
            args, consts = launches[name]
            named = dict(zip(getattr(S, name).arg_names, args, strict=False))
            kpn = consts["KD"] * consts["KH"] * consts["KW"]
            fit = _parse_tiles(custom) if custom else S._fit(tiles, named["CI_G"], named["CO_G"], kpn)
            for tile in fit[:1] if opts.quick else fit:
                bm, bci, bco, kpb, warps, stages = tile
                meta = dict(BLOCK_M=bm, BLOCK_CI=bci, BLOCK_CO=bco, KPB=kpb)
                try:
                    line = compile_one(getattr(S, name), args, {**consts, **meta}, warps, stages, opts.sass)
                except Exception as err:  # noqa: BLE001 - report every failing specialisation, go on
                    failures += 1
                    line = f"FAIL {type(err).__name__}: {str(err)[:1500]}"
                label = f"M{bm} CI{bci} CO{bco} KPB{kpb} w{warps} s{stages}"
                print(f"{case:16s} {name[7:12]} {label:30s} {line}", flush=True)
        args, consts = launches["_shift_wgrad_finish_kernel"]
        line = compile_one(S._shift_wgrad_finish_kernel, args, consts, 4, 1)
        print(f"{case:16s} finish {'':30s} {line}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
