"""Compile recorded Triton launches for sm_90a without a GPU: the core of ``tools/compile_check.py``.

* ``recording()``: while it is active, ``kernel[grid](*args, **kwargs)`` of every ``JITFunction`` in
  the loaded ``fusion_backend.kernels`` modules records a ``Launch`` instead of launching, so the
  real launchers can run on empty CPU tensors of full size.
* ``specialise(launch)``: the signature, constexprs, divisibility attributes and options that
  ``JITFunction.run`` would compile for that launch (Triton's own argument binder and
  ``_pack_args``, the code a real launch runs).
* ``compile_specialisation``: Triton -> PTX -> cubin for ``TARGET``, then the bundled
  ``ptxas -v`` for registers and spill stores; optionally the SASS of the cubin (bundled
  ``cuobjdump -sass``) counted by instruction class, for the whole kernel and its main loop.

Uses Triton internals (``create_function_from_signature``, ``JITFunction._pack_args``), so it may
need a touch after a Triton update.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from fusion_backend.kernels.compile_pool import compile_source

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
#: Launch options a kernel gets when its launch names none (``num_warps``, ``num_stages``).
DEFAULT_OPTIONS = BACKEND.parse_options({})
_NVIDIA_BIN = Path(triton.__file__).parent / "backends/nvidia/bin"


def _triton_ptxas() -> Path:
    """The ptxas Triton itself assembles ``TARGET``'s code with, so it reads the PTX version Triton
    emits for it (that version follows this ptxas: the bundled Blackwell one on Triton 3.9, whatever
    ``knobs.nvidia.ptxas`` resolves to on Triton 3.6, which can be a newer CUDA's than the bundled
    Blackwell one's 12.8)."""
    from fusion_backend.kernels.compile_pool import assembler

    found = assembler(TARGET.arch)
    if found is None:
        raise RuntimeError("this Triton's NVIDIA backend names no ptxas")
    return Path(found[0])


PTXAS = _triton_ptxas()
CUOBJDUMP = _NVIDIA_BIN / "cuobjdump"


@dataclass(frozen=True)
class Launch:
    """One recorded ``kernel[grid](*args, **kwargs)``: ``kwargs`` holds the constexprs and the launch
    options (``num_warps``, ``num_stages``) as the launcher passed them."""

    kernel: JITFunction
    args: tuple
    kwargs: dict

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    @property
    def named_args(self) -> dict[str, Any]:
        """The positional arguments by parameter name (what an autotuner's pruner receives)."""
        return dict(zip(self.kernel.arg_names, self.args, strict=False))

    def with_tile(self, tile: triton.Config) -> Launch:
        """This launch with ``tile``'s constexprs and options in place of the recorded ones."""
        return Launch(self.kernel, self.args, {**self.kwargs, **tile.all_kwargs()})

    def option(self, name: str) -> int:
        """``num_warps`` / ``num_stages`` as launched (Triton's default when the launch names none)."""
        return self.kwargs.get(name, getattr(DEFAULT_OPTIONS, name))


@contextmanager
def recording() -> Iterator[list[Launch]]:
    """Within: launches of the kernels of the loaded ``fusion_backend.kernels`` modules are appended
    to the yielded list instead of running; ``torch.backends.cudnn.allow_tf32`` is True (PyTorch's
    default on CUDA, which the conv launchers read).  Everything is restored on exit."""
    launches: list[Launch] = []
    kernels = {
        id(value): value
        for name, module in list(sys.modules.items())
        if name.startswith("fusion_backend.kernels") and module is not None
        for value in vars(module).values()
        if isinstance(value, JITFunction)
    }
    for kernel in kernels.values():

        def run(*args: Any, grid: Any, warmup: bool, _kernel: JITFunction = kernel, **kwargs: Any) -> None:
            launches.append(Launch(_kernel, args, kwargs))

        kernel.run = run  # type: ignore[method-assign]
    allow_tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = True
    try:
        yield launches
    finally:
        torch.backends.cudnn.allow_tf32 = allow_tf32
        for kernel in kernels.values():
            vars(kernel).pop("run", None)


@dataclass(frozen=True)
class Specialisation:
    """What Triton compiles for one launch: ``ASTSource``'s signature, constexprs and attributes
    (tuple parameters appear as tuples of element types; an element Triton specialises, an int equal
    to 1, is ``'constexpr'`` with its value under ``(arg_index, element_index)``), and the options."""

    kernel: JITFunction
    signature: dict
    constexprs: dict
    attrs: dict
    options: Any

    def key(self) -> str:
        """Equal for two launches that compile to the same kernel."""
        return repr((self.kernel.fn.__module__, self.kernel.fn.__qualname__, self.signature, self.constexprs, self.attrs,
                     sorted(self.options.__dict__.items())))  # fmt: skip


def specialise(launch: Launch) -> Specialisation:
    """The specialisation ``JITFunction.run`` would compile for ``launch`` on an sm_90 device."""
    kern = launch.kernel
    kwargs = dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", kern.debug) or knobs.runtime.debug
    for knob in ("instrumentation_mode", "fpsan_homomorphic_casts"):  # what JITFunction.run adds (by version)
        if hasattr(knobs.compilation, knob):
            kwargs[knob] = getattr(knobs.compilation, knob)
    binder = create_function_from_signature(kern.signature, kern.params, BACKEND)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kern._pack_args(BACKEND, kwargs, bound, specialization, options)
    return Specialisation(kern, signature, constexprs, attrs, options)


@dataclass
class Report:
    """One compiled specialisation: ptxas's registers and spill stores per function (strings, as
    ptxas prints them), shared memory, whether the PTX uses ``wgmma``, and the SASS summary."""

    seconds: float
    registers: list[str]
    spill_stores: list[str]
    shared: int
    wgmma: bool
    ptx_lines: int
    ptxas_error: str = ""  # ptxas's message when it reported no registers
    sass: str = ""
    #: ptxas's wgmma pipeline advisories by code, e.g. ``C7517`` (a ``warpgroup.wait`` it injected before
    #: registers an in-flight ``wgmma`` defines are read) or ``C7515`` (the kernel's ``wgmma`` serialised):
    #: where they appear, MMAs the kernel meant to keep in flight run synchronously
    wgmma_advice: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """ptxas assembled the PTX (it reports registers then)."""
        return bool(self.registers)

    @property
    def spills(self) -> bool:
        return any(int(s) for s in self.spill_stores)

    def line(self) -> str:
        text = (f"{self.seconds:5.1f}s regs={','.join(self.registers)} spill={','.join(self.spill_stores) or '?'} "
                f"shared={self.shared} wgmma={self.wgmma} ptx_lines={self.ptx_lines}")  # fmt: skip
        if self.wgmma_advice:
            counts = {code: self.wgmma_advice.count(code) for code in sorted(set(self.wgmma_advice))}
            text += " wgmma_advice=" + ",".join(f"{code}x{n}" for code, n in counts.items())
        if self.ptxas_error:
            text += f"\n        {self.ptxas_error}"
        if self.sass:
            text += f"\n        {self.sass}"
        return text


def ptxas_report(ptx: str) -> tuple[list[str], list[str], str, list[str]]:
    """``(registers, spill stores, ptxas's message when it reported no registers, its wgmma advisories'
    codes)`` of ``ptx`` for sm_90a (:attr:`Report.wgmma_advice`)."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        proc = subprocess.run([str(PTXAS), "--gpu-name", "sm_90a", "-v", f.name, "-o", os.devnull],
                              capture_output=True, text=True)  # fmt: skip
    finally:
        os.unlink(f.name)
    regs = re.findall(r"Used (\d+) registers", proc.stderr)
    error = "" if regs else f"ptxas exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[:400]!r}"
    advice = re.findall(r"\((C75\d\d)\)[^\n]*(?:wgmma|warpgroup)", proc.stderr)
    return regs, re.findall(r"(\d+) bytes spill stores", proc.stderr), error, advice


def compile_specialisation(
    spec: Specialisation, sass_rates: dict[str, float] | None = None, keep: dict[str, Path] | None = None,
    label: str = "",
) -> Report:  # fmt: skip
    """Compile ``spec`` for ``TARGET`` and assemble its PTX with ptxas.

    ``sass_rates``: None for no SASS, else the SASS summary (``sass_summary``) with these proxies.
    ``keep``: file extension (``ptx``, ``ttgir``, ``cubin``, ``sass``) -> folder receiving
    ``<label>.<extension>`` of this compile.  Raises what ``triton.compile`` raises."""
    start = time.time()
    compiled = triton.compile(compile_source(spec.kernel, spec.signature, spec.constexprs, spec.attrs),
                              target=TARGET, options=spec.options.__dict__)  # fmt: skip
    ptx, cubin = compiled.asm["ptx"], compiled.asm["cubin"]
    regs, spills, error, advice = ptxas_report(ptx)
    report = Report(time.time() - start, regs, spills, compiled.metadata.shared, "wgmma" in ptx,
                    ptx.count("\n"), error, wgmma_advice=advice)  # fmt: skip
    keep = keep or {}
    listing = sass_listing(cubin) if sass_rates is not None or "sass" in keep else []
    if sass_rates is not None:
        report.sass = sass_summary(listing, sass_rates)
    artefacts = {
        "ptx": ptx.encode(),
        "ttgir": compiled.asm["ttgir"].encode(),
        "cubin": cubin,
        "sass": "".join(f"/*{a:04x}*/ {op} {ops};\n" for a, op, ops in listing).encode(),
    }
    for ext, folder in keep.items():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{label}.{ext}").write_bytes(artefacts[ext])
    return report


# --------------------------------------------------------------------------------------------------
# SASS: listing, instruction classes, main loop
# --------------------------------------------------------------------------------------------------

#: SASS opcode (before the first '.') -> class; any other opcode starting with U (the uniform
#: datapath) is "uniform", anything else "other".
SASS_CLASSES: dict[str, tuple[str, ...]] = {
    "mma": ("HGMMA", "HMMA", "IMMA", "QGMMA", "IGMMA"),
    "ldg/stg": ("LDG", "STG", "LDGSTS", "LDGDEPBAR", "ATOM", "ATOMG", "RED", "UTMALDG", "UTMASTG", "LDL", "STL",
                "LD", "ST"),
    "lds/sts": ("LDS", "STS", "LDSM", "STSM", "ATOMS"),
    "sync": ("BAR", "MEMBAR", "FENCE", "WARPGROUP", "DEPBAR", "ARRIVES", "SYNCS", "WARPSYNC"),
    "fp": ("FADD", "FMUL", "FFMA", "FSETP", "FMNMX", "FSEL", "FCHK", "MUFU", "FSET", "HADD2", "HMUL2",
           "HFMA2", "HSETP2", "HMNMX2", "DADD", "DMUL", "DFMA", "DSETP"),
    "cvt": ("F2F", "I2F", "F2I", "F2FP", "FRND", "I2FP", "F2IP"),
    "int/logic": ("IMAD", "IADD3", "IADD", "VIADD", "VIADDMNMX", "LOP3", "ISETP", "SEL", "SHF", "LEA", "SGXT",
                  "PLOP3", "P2R", "R2P", "R2UR", "IMNMX", "VIMNMX", "VIMNMX3", "PRMT", "BMSK", "FLO", "POPC", "MOV",
                  "IABS", "I2I", "IMUL", "ISCADD", "CS2R", "S2R", "S2UR", "LOP", "SHL", "SHR", "BREV", "IDP", "LDC",
                  "VOTE", "SHFL", "REDUX"),
    "uniform": (),
    "control": ("BRA", "EXIT", "BSSY", "BSYNC", "NOP", "YIELD", "CALL", "RET", "JMP", "BREAK", "ELECT"),
}  # fmt: skip
_SASS_CLASS_OF = {op: cls for cls, ops in SASS_CLASSES.items() for op in ops}
_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)((?:\.[A-Z0-9_]+)*)\s*([^;]*);")

Listing = list[tuple[int, str, str]]


def sass_listing(cubin: bytes) -> Listing:
    """``(address, opcode with modifiers, operands)`` of every instruction of the cubin's kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        text = subprocess.run(
            [str(CUOBJDUMP), "-sass", f.name], capture_output=True, text=True, check=True
        ).stdout
    finally:
        os.unlink(f.name)
    return [(int(m[1], 16), m[3] + m[4], m[5].strip()) for m in _SASS_LINE.finditer(text)]


def sass_class(opcode: str) -> str:
    base = opcode.split(".")[0]
    if base.startswith("U") and base not in _SASS_CLASS_OF:
        return "uniform"
    return _SASS_CLASS_OF.get(base, "other")


def sass_counts(listing: Listing) -> dict[str, int]:
    """Instructions per class (every class of ``SASS_CLASSES`` and "other")."""
    counts = dict.fromkeys((*SASS_CLASSES, "other"), 0)
    for _, op, _ in listing:
        counts[sass_class(op)] += 1
    return counts


def main_loop(listing: Listing) -> tuple[int, int] | None:
    """``(first, last)`` listing indices of the main loop: among the loops (a backward branch and its
    target) that hold an MMA instruction, the innermost ones (holding no other such loop), and of
    those the one with the most MMA instructions (then the shortest); None when no loop holds one."""
    index = {addr: i for i, (addr, _, _) in enumerate(listing)}
    loops = []
    for i, (addr, op, operands) in enumerate(listing):
        target = re.match(r"(0x[0-9a-f]+)", operands.split(",")[-1].strip()) if op.startswith("BRA") else None
        if target and int(target[1], 16) < addr and int(target[1], 16) in index:
            loops.append((index[int(target[1], 16)], i))
    mma = {
        span: sum(sass_class(op) == "mma" for _, op, _ in listing[span[0] : span[1] + 1]) for span in loops
    }
    with_mma = [span for span in loops if mma[span]]
    innermost = [a for a in with_mma if not any(b != a and a[0] <= b[0] and b[1] <= a[1] for b in with_mma)]
    return max(innermost, key=lambda span: (mma[span], span[0] - span[1]), default=None)


def sass_summary(listing: Listing, rates: dict[str, float]) -> str:
    """The main loop's span, instruction count, instructions per MMA instruction, ``rates`` (proxy
    name -> factor on the loop's instruction count), per-class counts and most frequent opcodes; then
    the whole kernel's count per class.  Static counts: predication and latencies are not modelled."""
    total = sass_counts(listing)
    kernel = f"kernel {len(listing)} instr: " + " ".join(f"{k}={v}" for k, v in total.items() if v)
    span = main_loop(listing)
    if span is None:
        return f"no loop with an MMA; {kernel}"
    body = listing[span[0] : span[1] + 1]
    counts = sass_counts(body)
    n = len(body)
    proxies = {"instr/MMA": n / counts["mma"], **{name: n * factor for name, factor in rates.items()}}
    opcodes = [op.split(".")[0] for _, op, _ in body]
    top = sorted(set(opcodes), key=lambda op: (-opcodes.count(op), op))[:6]
    return (f"main loop [{body[0][0]:#x}..{body[-1][0]:#x}] {n} instr: "
            + " ".join(f"{name}={value:.2f}" for name, value in proxies.items()) + "; "
            + " ".join(f"{k}={v}" for k, v in counts.items() if v)
            + " top=" + ",".join(f"{op}:{opcodes.count(op)}" for op in top) + f"; {kernel}")  # fmt: skip
