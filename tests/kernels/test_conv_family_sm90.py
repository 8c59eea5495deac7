"""The conv family's kernels compile for sm_90 (``tools/compile_check.py conv_family``, ``conv_tma`` and
``conv_tma_wgrad``),
without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest


def _needs_ptxas() -> None:
    import triton

    if not (Path(triton.__file__).parent / "backends/nvidia/bin/ptxas-blackwell").exists():
        pytest.skip("Triton's bundled ptxas-blackwell is missing: nothing here compiles for sm_90")


@pytest.mark.heavy
def test_hooked_kernels_compile_for_sm90_without_spills_within_shared_memory(sm90_compile_check) -> None:
    """The interpreter runs the kernels on CPU but cannot say whether they compile for the GPU, spill or
    ask for more shared memory than an sm_90 block has.  Compiles fprop, dgrad and wgrad with every
    hook on three of the job's cases: a ResNet-50 3x3 in bf16 (tap-major K; and the gradients loading
    boxes through tensor descriptors, which the interpreter emulates) and the RGB stem in fp32/TF32 (flat K),
    in the suite's one compile-check process (``conftest.SM90_COMPILE_CASES``).  NOTE: 10
    specialisations, about 14 s of compiling on the 2-core CPU box with a cold Triton cache (``time
    python tools/compile_check.py conv_family --cases ...``)."""
    _needs_ptxas()
    out = sm90_compile_check("conv_family")
    for kernel in ("conv_fprop_kernel", "conv_dgrad_kernel", "conv_wgrad_kernel"):
        assert kernel in out, out
    assert "conv_family: all kernels compiled without spills" in out, out


@pytest.mark.heavy
def test_halo_forward_compiles_for_sm90_without_spills(sm90_compile_check) -> None:
    """The halo forward (its prologue once per channel block into a scratch slot, its CTA barriers and
    L2 loads) runs under the interpreter, which cannot say whether it compiles for the GPU: a ResNet-50
    3x3 and an EfficientNet depthwise 3x3 with the BatchNorm hooks.  NOTE: a few specialisations, a few
    seconds of compiling."""
    _needs_ptxas()
    out = sm90_compile_check("conv_halo")
    assert "conv_fprop_halo_kernel" in out, out
    assert "conv_halo: all kernels compiled without spills" in out, out


@pytest.mark.heavy
def test_tma_forward_compiles_for_sm90_without_spills(sm90_compile_check) -> None:
    """The Gluon TMA forward has no interpreter: this compile is the CPU suite's only check of it.  A
    ResNet-50 1x1, plain and with the BatchNorm hooks, and its downsampling 1x1 at stride 2 with them
    (strided boxes), in the same compile-check process.  NOTE: 6 specialisations, a few seconds of
    compiling."""
    _needs_ptxas()
    out = sm90_compile_check("conv_tma")
    assert "tma_fprop_kernel" in out, out
    assert "conv_tma: all kernels compiled without spills" in out, out


@pytest.mark.heavy
def test_tma_weight_gradient_compiles_for_sm90_without_spills(sm90_compile_check) -> None:
    """The Gluon TMA weight gradient has no interpreter either: ResNet-50's 1x1 read as rows with the
    recomputed prologue, and its 3x3 in boxes of the plane, plain (``a^T`` from shared memory) and with
    the prologue (through registers), in the same compile-check process.  NOTE: 3 specialisations, a
    few seconds of compiling."""
    _needs_ptxas()
    out = sm90_compile_check("conv_tma_wgrad")
    assert "tma_wgrad_kernel" in out, out
    assert "conv_tma_wgrad: all kernels compiled without spills" in out, out
