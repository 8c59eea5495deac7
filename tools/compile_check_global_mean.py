"""Compile every CUDA-path kernel of ``kernels/global_mean/`` for sm_90 without a GPU.

    python tools/compile_check_global_mean.py [--verbose]

The ``conv_global_mean`` kernels are on the default path of the ``seeds`` suite's global-mean
pipeline: a kernel that compiles under the interpreter but not for the GPU makes the op fall back to
the slow torch reference (with one warning), so run this after every change to the file.

How: the real launchers (``set_sums_partial``, ``contract_forward``, ``params_backward``,
``grad_broadcast``) are called with that pipeline's arguments on CPU tensors (empty, never read) while
each ``JITFunction.run`` is replaced by a recorder.  Each recorded launch then goes through Triton's
own argument binder and ``_pack_args`` (the code a real launch runs), so the signature, the constexprs
and the divisibility attributes are exactly the ones a launch on the GPU would compile, and is
compiled with
``triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32))``
to PTX and cubin; Triton's bundled ``ptxas -v`` reports registers and spills.

Tuple arguments in an ``ASTSource`` signature (what the binder produces, printed with ``--verbose``): a
tuple parameter's signature entry is a tuple of per-element types, e.g. ``ops: ('*fp32',)``; an element
that Triton specializes (an int equal to 1) is ``'constexpr'`` with its value under the path
``(arg_index, element_index)`` in ``constexprs``; a ``tl.constexpr`` tuple parameter (``KINDS``) is
``'constexpr'`` with the whole tuple under ``(arg_index,)``.

Specialisations: the global-mean pipeline (x (16, 64, 512, 512), ConvTranspose2d 64->128 k3, the
folded ``+ bias`` operand), fp32 and bf16 (fp32 output as under autocast), contiguous and
channels_last x, with the split counts an H100 (132 SMs) would choose; plus, in fp32, a padded grouped
Conv2d without bias (several index sets per dim, the other constexpr branches).  Uses Triton
internals, so it may need a touch after a Triton update.  Exit status 1 when a kernel fails to compile
or spills.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # before the kernels are decorated
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # what a launch uses today, without the warning
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from fusion_backend.kernels import global_mean as K  # noqa: E402
from fusion_backend.ops import conv_global_mean as cgm  # noqa: E402
from fusion_backend.ops.chain import ChainStep, Const, PointwiseKind, TensorRef  # noqa: E402
from fusion_backend.ops.config import ConvSpec  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
H100_SMS = 132
# the plain bundled ptxas is older than the PTX version Triton 3.9 emits; the blackwell one reads it
PTXAS = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas-blackwell"


def record_launches(calls: list[tuple[JITFunction, tuple, dict]]) -> list[JITFunction]:
    """Replace ``run`` of every kernel of the package's modules by a recorder; returns the kernels."""
    kernels = [v for module in (K.passes, K.contract) for v in vars(module).values()
               if isinstance(v, JITFunction) and v.fn.__name__.endswith("_kernel")]  # fmt: skip
    for kern in kernels:

        def run(*args, grid, warmup, _k=kern, **kwargs):
            calls.append((_k, args, kwargs))

        kern.run = run  # type: ignore[method-assign]
    return kernels


def global_mean_pipeline_launches(
    dtype: torch.dtype, channels_last: bool, padded: bool = False
) -> list[tuple[JITFunction, tuple, dict]]:
    """Call the four launchers as the op does for the global-mean pipeline; returns the recorded kernel
    launches.

    ``padded``: a variant off that pipeline's path that takes the other branches of the same kernels:
    a regular Conv2d with padding 1 and 2 groups (3 index sets per dim: the tapset gather), no bias, a
    constant step."""
    calls: list[tuple[JITFunction, tuple, dict]] = []
    record_launches(calls)
    n, c_in, c_out, size = 16, 64, 128, (512, 512)
    x = torch.empty((n, c_in, *size), dtype=dtype)
    if channels_last:
        x = torch.empty((n, *size, c_in), dtype=dtype).permute(0, 3, 1, 2)
    weight = torch.empty((c_in, c_out, 3, 3), dtype=dtype)
    bias: torch.Tensor | None = torch.empty((c_out,), dtype=dtype)
    extra = torch.empty((c_out, 1, 1), dtype=torch.float32)
    spec = ConvSpec(True, (1, 1), (0, 0), (1, 1), (0, 0), 1)
    step = ChainStep(PointwiseKind.ADD, (TensorRef(0),))
    if padded:
        weight = torch.empty((c_out, c_in // 2, 3, 3), dtype=dtype)
        bias = None
        spec = ConvSpec(False, (1, 1), (1, 1), (1, 1), (0, 0), 2)
        step = ChainStep(PointwiseKind.MUL, (Const(0.5),))
    cfg = cgm.ConvGlobalMeanConfig(spec, (step,), keepdim=True, out_dtype="float32")
    geo = cgm.geometry._geometry(spec, size, (3, 3), x.device)
    x5 = cgm.common._as5d(x)
    # the split an H100 picks (the launchers only ask the device on CUDA)
    if K.passes._channels_innermost(x5):
        block_p, block_c = K.passes._cl_tiles(size[0] * size[1], c_in)
        split = triton.cdiv(K.passes._PROGRAMS_PER_SM * H100_SMS, n * triton.cdiv(c_in, block_c))
    else:
        split = triton.cdiv(K.passes._PROGRAMS_PER_SM * H100_SMS, n * c_in)
    partial = K.set_sums_partial(x5, geo.bits, geo.set_counts, split=split)
    mean = torch.empty((n, c_out), dtype=torch.float64)
    taps = torch.empty((n, c_in, 9), dtype=torch.float64)
    out = torch.empty((n, c_out), dtype=torch.float32)
    layout = cgm.forward._weight_layout(weight, spec)
    chain = cgm.forward._chain_args(cfg, [extra], c_out, x.device, mean)
    K.contract_forward(partial, geo.tapset, layout, bias, chain, geo.n_outputs, out, mean, taps)
    grad = torch.empty((n, c_out, 1, 1), dtype=torch.float32)
    coef = torch.empty((n, c_out), dtype=torch.float32)
    gw = torch.empty_like(weight)
    targets = ((K.GRAD_NONE, coef, 0),) if padded else ((K.GRAD_DIRECT, torch.empty_like(extra), 1),)
    K.params_backward(grad.reshape(n, c_out), mean, taps, chain, targets,
                      K.WeightLayout.of(gw, spec.transposed, spec.groups),
                      None if bias is None else torch.empty_like(bias), geo.n_outputs, coef, coef)  # fmt: skip
    grad_x = torch.empty_strided(x.shape, cgm.backward._grad_input_strides(x), dtype=dtype)
    K.grad_broadcast(coef, layout, geo.tapset, geo.bits, geo.set_counts, cgm.common._as5d(grad_x), split=split)
    return calls


def ptxas_report(ptx: str) -> tuple[list[str], list[str], str]:
    """``(registers, spill stores, ptxas's message when it reported no registers)`` of ``ptx``."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        proc = subprocess.run([str(PTXAS), "--gpu-name", "sm_90a", "-v", f.name, "-o", os.devnull],
                              capture_output=True, text=True)  # fmt: skip
    finally:
        os.unlink(f.name)
    err = proc.stderr
    regs = re.findall(r"Used (\d+) registers", err)
    problem = "" if regs else f"ptxas exit {proc.returncode}: {(err or proc.stdout).strip()[:400]!r}"
    return regs, re.findall(r"(\d+) bytes spill stores", err), problem


def compile_launch(kern: JITFunction, args: tuple, kwargs: dict, verbose: bool) -> tuple[str, bool]:
    """Compile one recorded launch the way ``JITFunction.run`` would; returns (report line, ok)."""
    backend = make_backend(TARGET)
    kwargs = dict(kwargs, debug=False, instrumentation_mode=knobs.compilation.instrumentation_mode)
    if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):  # a run() option since Triton 3.7-ish
        kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    binder = create_function_from_signature(kern.signature, kern.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kern._pack_args(backend, kwargs, bound, specialization, options)
    if verbose:
        print(f"    signature {signature}\n    constexprs {constexprs}")
    start = time.time()
    compiled = triton.compile(ASTSource(kern, signature, constexprs, attrs), target=TARGET,
                              options=options.__dict__)  # fmt: skip
    regs, spills, problem = ptxas_report(compiled.asm["ptx"])
    ok = bool(regs) and all(s == "0" for s in spills)
    line = (f"{kern.fn.__name__:28s} warps={options.num_warps} stages={options.num_stages} "
            f"regs={','.join(regs)} spill={','.join(spills) or '?'} shared={compiled.metadata.shared} "
            f"{time.time() - start:.1f}s")  # fmt: skip
    if problem:
        line += f"\n       {problem}"
    return line, ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="print each launch's signature and constexprs")
    args = parser.parse_args()
    print(f"triton {triton.__version__}, target {TARGET}, ptxas {PTXAS.name}")
    failed = 0
    seen: set[str] = set()
    cases = [(dt, cl, False) for dt in (torch.float32, torch.bfloat16) for cl in (False, True)]
    cases += [(torch.float32, False, True), (torch.float32, True, True)]
    for dtype, channels_last, padded in cases:
        label = f"{str(dtype).removeprefix('torch.')} {'channels_last' if channels_last else 'contiguous'}"
        what = "padded grouped conv (off the pipeline's path)" if padded else "ConvTranspose2d 64->128 global mean"
        print(f"== {what} {label}")
        for kern, kargs, kwargs in global_mean_pipeline_launches(dtype, channels_last, padded):
            seen.add(kern.fn.__name__)
            try:
                line, ok = compile_launch(kern, kargs, kwargs, args.verbose)
            except Exception:  # noqa: BLE001 - report every kernel, then fail
                line, ok = f"{kern.fn.__name__:28s} COMPILE FAILED\n{traceback.format_exc()}", False
            failed += not ok
            print(f"  {'ok  ' if ok else 'FAIL'} {line}")
    print(f"compiled kernels: {', '.join(sorted(seen))}")
    print("all kernels compiled without spills" if not failed else f"{failed} launch(es) failed or spilled")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
