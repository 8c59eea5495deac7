"""Compile the fused conv forward kernel for sm_90 without a GPU: catches GPU-only compile errors.

    python tools/compile_check_conv_fused.py [--quick] [--sass] [--dump-sass DIR]
        [--cases convt3d-fp32,convt3d-bf16,convt3d-amp,conv2d-fp32,conv2d-bf16,convt3d_wide-fp32]
        [--tiles M,N,K,warps,stages;...]

For the ``convt3d`` (ConvTranspose3d 16->32 + chain + MaxPool3d(2) on 16x16x16x32x32, training
forward with saved state) and ``conv2d`` (Conv2d 64->64 + chain on 64x64x256x256, no pool)
specialisations of the ``seeds`` suite, fp32 (TF32) and bf16: the launcher runs on empty CPU
tensors of the full shapes with the kernel replaced by a recorder, so the constexprs and the
argument specialisation (``tt.divisibility``, ints equal to 1) are exactly what a CUDA launch would
compile; then, for every autotune config that ``_prune`` keeps for the shape (only the first with
``--quick``), Triton -> PTX -> cubin for sm_90a and ``ptxas -v`` (Triton's bundled ptxas) for
registers and spills, plus whether ``wgmma`` appears in the PTX.  Uses Triton internals
(``ASTSource``, ``native_specialize_impl``), so it may need a touch after a Triton update.

``--sass``: also disassemble each cubin (Triton's bundled ``cuobjdump -sass``) and count the SASS
instructions by class, for the whole kernel and for its *main loop*: the innermost loop (a backward
branch) with the most MMA instructions (SHIFT_K: the shared-X-tile offsets loop).  The headline
proxies printed for the main loop: thread-instructions per conv-output element of one iteration
(``body * 32 * warps / (BLOCK_M * BLOCK_N)``) and warp-instructions per MMA instruction.  Static
counts: predicated-off instructions and latencies are not modelled.  ``--dump-sass DIR`` keeps the
SASS listings (one file per case and tile).
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


def _workload(name: str, dtype: torch.dtype, compute_dtype: str | None = None):
    """The conv's tensors (empty, full size, CPU) and config, as ``tools/bench_conv_fused.py``."""
    if name in ("convt3d", "convt3d_wide"):  # convt3d_wide: 48 input channels, SHIFT_K with several channel blocks
        spec = ConvSpec(True, (2, 2, 2), (1, 1, 1), (1, 1, 1), (1, 1, 1), 1)
        leaky = ChainStep(PK.LEAKY_RELU, (Const(0.2),))
        chain = (leaky, ChainStep(PK.MUL, (TensorRef(0),)), leaky)
        pool = PoolSpec("max", (2, 2, 2), (2, 2, 2), (0, 0, 0))
        cin = 16 if name == "convt3d" else 48
        x, w, c = torch.empty(16, cin, 16, 32, 32, dtype=dtype), torch.empty(cin, 32, 3, 3, 3, dtype=dtype), 32
    else:
        spec = ConvSpec(False, (1, 1), (0, 0), (1, 1), (0, 0), 1)
        chain = (ChainStep(PK.MUL, (TensorRef(0),)), ChainStep(PK.LEAKY_RELU, (Const(0.01),)), ChainStep(PK.GELU))
        pool = None
        x, w, c = torch.empty(64, 64, 256, 256, dtype=dtype), torch.empty(64, 64, 3, 3, dtype=dtype), 64
    b, m = torch.zeros(c, dtype=dtype), torch.ones((c,) + (1,) * (x.dim() - 2), dtype=dtype)
    cfg = ConvEpilogueConfig(conv=spec, chain=chain, pool=pool, strict=True, compute_dtype=compute_dtype)
    return x, w, b, [m], cfg


def record_launch(seed: str, dtype: torch.dtype, compute_dtype: str | None = None) -> tuple[tuple, dict, tuple | None]:
    """The positional args and keyword constexprs of the conv's training-forward launch, and the
    (args, constexprs) of its weight-matrix launch (None when the path has none)."""
    rec, rec_w = _Recorder(), _Recorder()
    saved = CF._conv_fused_fwd_kernel, CF._shift_k_weight_kernel, CF._INTERPRET, torch.backends.cudnn.allow_tf32
    CF._conv_fused_fwd_kernel, CF._shift_k_weight_kernel, CF._INTERPRET = rec, rec_w, False
    torch.backends.cudnn.allow_tf32 = True  # PyTorch's default on CUDA
    try:
        x, w, b, ops, cfg = _workload(seed, dtype, compute_dtype)
        ce.forward._fused_conv_forward(x, w, b, ops, cfg, True)
    finally:
        CF._conv_fused_fwd_kernel, CF._shift_k_weight_kernel, CF._INTERPRET, torch.backends.cudnn.allow_tf32 = saved
    (args, kw), = rec.calls
    return args, {k: v for k, v in kw.items() if k not in _TILE_KEYS}, (rec_w.calls[0] if rec_w.calls else None)


#: SASS opcode (before the first '.') -> class, for ``--sass``; anything else is "other".
_SASS_CLASSES = {
    "mma": ("HGMMA", "HMMA", "IMMA", "QGMMA", "IGMMA"),
    "ldg/stg": ("LDG", "STG", "LDGSTS", "LDGDEPBAR", "ATOM", "ATOMG", "RED", "UTMALDG", "UTMASTG"),
    "lds/sts": ("LDS", "STS", "LDSM", "STSM", "ATOMS"),
    "sync": ("BAR", "MEMBAR", "FENCE", "WARPGROUP", "DEPBAR", "ARRIVES", "SYNCS", "WARPSYNC"),
    "fp": ("FADD", "FMUL", "FFMA", "FSETP", "FMNMX", "FSEL", "FCHK", "MUFU", "FSET", "HADD2", "HMUL2",
           "HFMA2", "HSETP2", "HMNMX2", "DADD", "DMUL", "DFMA"),
    "cvt": ("F2F", "I2F", "F2I", "F2FP", "FRND", "I2FP", "F2IP"),
    "int/logic": ("IMAD", "IADD3", "IADD", "LOP3", "ISETP", "SEL", "SHF", "LEA", "SGXT", "PLOP3", "P2R", "R2P",
                  "IMNMX", "VIMNMX", "PRMT", "BMSK", "FLO", "POPC", "MOV", "IABS", "I2I", "IMUL", "ISCADD",
                  "CS2R", "S2R", "S2UR", "LOP", "SHL", "SHR", "BREV", "IDP", "LDC", "VOTE", "SHFL"),
    "uniform": (),  # every opcode starting with U (uniform datapath), checked first
    "control": ("BRA", "EXIT", "BSSY", "BSYNC", "NOP", "YIELD", "CALL", "RET", "JMP", "BREAK", "WARPSYNC", "ELECT"),
}
_SASS_OPCODE = {op: cls for cls, ops in _SASS_CLASSES.items() for op in ops}
_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)((?:\.[A-Z0-9_]+)*)\s*([^;]*);")


def sass_listing(cubin: bytes) -> list[tuple[int, str, str]]:
    """``(address, opcode with modifiers, operands)`` of every instruction of the cubin's kernel."""
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        text = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    return [(int(m[1], 16), m[3] + m[4], m[5].strip()) for m in _SASS_LINE.finditer(text)]


def _sass_class(opcode: str) -> str:
    base = opcode.split(".")[0]
    if base.startswith("U") and base not in _SASS_OPCODE:
        return "uniform"
    return _SASS_OPCODE.get(base, "other")


def _main_loop(listing: list[tuple[int, str, str]]) -> tuple[int, int]:
    """``(first, last)`` listing indices of the innermost loop with the most MMA instructions
    (the whole kernel when there is no loop with one)."""
    index = {addr: i for i, (addr, _, _) in enumerate(listing)}
    loops = []
    for i, (addr, op, operands) in enumerate(listing):
        if op.startswith("BRA"):
            target = re.match(r"(0x[0-9a-f]+)", operands.split(",")[-1].strip())
            if target and int(target[1], 16) < addr and int(target[1], 16) in index:
                loops.append((index[int(target[1], 16)], i))
    best, best_key = (0, len(listing) - 1), (0, 0)
    for lo, hi in loops:
        mma = sum(_sass_class(op) == "mma" for _, op, _ in listing[lo : hi + 1])
        key = (mma, -(hi - lo))
        if mma and key > best_key:
            best, best_key = (lo, hi), key
    return best


def sass_counts(listing: list[tuple[int, str, str]]) -> dict[str, int]:
    counts = {cls: 0 for cls in _SASS_CLASSES}
    counts["other"] = 0
    for _, op, _ in listing:
        counts[_sass_class(op)] += 1
    return counts


def sass_summary(cubin: bytes, block_m: int, block_n: int, num_warps: int, dump: Path | None = None) -> str:
    """Per-class SASS counts of the main loop and of the whole kernel, and the headline proxies."""
    listing = sass_listing(cubin)
    if dump is not None:
        dump.write_text("\n".join(f"/*{a:04x}*/ {op} {ops};" for a, op, ops in listing) + "\n")
    lo, hi = _main_loop(listing)
    body = listing[lo : hi + 1]
    loop, total = sass_counts(body), sass_counts(listing)
    n = len(body)
    per_elem = n * 32 * num_warps / (block_m * block_n)
    per_mma = n / max(loop["mma"], 1)
    cls = " ".join(f"{k}={v}" for k, v in loop.items() if v)
    return (f"main loop [{body[0][0]:#x}..{body[-1][0]:#x}] {n} instr ({per_elem:.1f}/conv-output element, "
            f"{per_mma:.1f}/MMA): {cls}; kernel {len(listing)} instr: "
            + " ".join(f"{k}={v}" for k, v in total.items() if v))  # fmt: skip


def compile_one(args: tuple, consts: dict, num_warps: int, num_stages: int, fn=None, sass: bool = False,
                dump: Path | None = None) -> str:  # noqa: ANN001  # fmt: skip
    """Compile one specialisation; a line with time, registers, spills, shared memory and wgmma (and
    with ``sass``, a second line: ``sass_summary``)."""
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
    line = (f"{time.time() - start:5.1f}s regs={','.join(regs)} spill={','.join(spills)} "
            f"shared={compiled.metadata.shared} wgmma={'wgmma' in ptx} ptx_lines={ptx.count(chr(10))}")  # fmt: skip
    if sass:
        line += "\n        " + sass_summary(compiled.asm["cubin"], consts["BLOCK_M"], consts["BLOCK_N"], num_warps, dump)
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the first kept config per case")
    parser.add_argument("--cases", default="convt3d-fp32,convt3d-bf16,convt3d-amp,conv2d-fp32,conv2d-bf16")
    parser.add_argument("--tiles", default="", help="'M,N,K,warps,stages;...' instead of the autotune configs")
    parser.add_argument("--sass", action="store_true", help="count SASS instructions by class (main loop, kernel)")
    parser.add_argument("--dump-sass", default="", help="directory for the SASS listings (implies --sass)")
    opts = parser.parse_args(argv)
    # amp: fp32 tensors, bf16 compute (autocast's casts absorbed into the loaders)
    dtypes = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None), "amp": (torch.float32, "bfloat16")}
    failures = 0
    for case in opts.cases.split(","):
        seed, dt = case.split("-")
        args, consts, weight_launch = record_launch(seed, *dtypes[dt])
        if weight_launch is not None:
            try:
                line = compile_one(*weight_launch, 4, 1, fn=CF._shift_k_weight_kernel)
            except Exception as err:  # noqa: BLE001
                failures += 1
                line = f"FAIL {type(err).__name__}: {str(err)[:1500]}"
            print(f"{case:17s} {'weight matrix':22s} {line}", flush=True)
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
                dump = None
                if opts.dump_sass:
                    Path(opts.dump_sass).mkdir(parents=True, exist_ok=True)
                    dump = Path(opts.dump_sass) / f"{case}_{tile.replace(' ', '_')}.sass"
                line = compile_one(args, {**consts, **cfg.kwargs}, cfg.num_warps, cfg.num_stages,
                                   sass=opts.sass or bool(opts.dump_sass), dump=dump)  # fmt: skip
            except Exception as err:  # noqa: BLE001 - report every failing specialisation, go on
                failures += 1
                line = f"FAIL {type(err).__name__}: {str(err)[:1500]}"
            print(f"{case:17s} {tile:22s} {line}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
