"""``kernels/relayout.relayout``: copies between NCHW-style and channels-last layouts (with a cast)
bitwise as ``Tensor.copy_`` does, on odd sizes that leave partial tiles; clear errors for what it
does not serve.  Under the interpreter on CPU, with CUDA on the GPU."""

from __future__ import annotations

import os

import pytest
import torch

from fusion_backend.ops import conv_io

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CL = {4: torch.channels_last, 5: torch.channels_last_3d}


@pytest.fixture
def relayout():
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel on CPU tensors needs TRITON_INTERPRET=1")
    from fusion_backend.kernels import relayout as module

    return module


@pytest.mark.parametrize("shape", [(2, 70, 9, 11), (3, 5, 4, 6, 7), (1, 3, 1, 1), (2, 1, 5, 3)], ids=str)
@pytest.mark.parametrize("to_cl", [True, False], ids=["to-channels-last", "from-channels-last"])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.float32, torch.float16),
                                    (torch.float16, torch.float32)], ids=lambda d: f"{d[0]}->{d[1]}")  # fmt: skip
def test_relayout_copies_like_copy_(relayout, shape, to_cl, dtypes):
    src_dtype, dst_dtype = dtypes
    fmt = CL[len(shape)]
    src = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))).to(DEVICE, src_dtype)
    src[0, 0].view(-1)[0] = float("nan")
    src[-1, -1].view(-1)[-1] = float("-inf")
    if not to_cl:
        src = src.to(memory_format=fmt)
    dst = torch.empty(shape, dtype=dst_dtype, device=DEVICE, memory_format=fmt if to_cl else torch.contiguous_format)
    out = relayout.relayout(src, dst, (16, 32, 4))  # small tiles: several blocks along both axes
    want = torch.empty_like(dst).copy_(src)
    assert out is dst and dst.stride() == want.stride()
    assert torch.equal(dst.isnan(), want.isnan()) and torch.equal(dst.nan_to_num(), want.nan_to_num())


def test_relayout_refuses_what_it_does_not_serve(relayout):
    x = torch.randn(2, 3, 4, 5, device=DEVICE)
    with pytest.raises(ValueError, match="shapes differ"):
        relayout.relayout(x, torch.empty(2, 3, 5, 4, device=DEVICE))
    with pytest.raises(ValueError, match="do not flatten"):
        relayout.relayout(x.transpose(2, 3), torch.empty(2, 3, 5, 4, device=DEVICE))
    with pytest.raises(ValueError, match="non-float"):
        relayout.relayout(x, torch.empty(2, 3, 4, 5, device=DEVICE, dtype=torch.int32))


def test_the_ops_relayout_falls_back_to_copy_for_other_layouts(relayout):
    """``ops/conv_io.py``'s ``relayout`` serves every layout: a source whose spatial dims do not
    flatten takes torch's copy."""
    base = torch.randn(2, 3, 5, 6, device=DEVICE)
    src = base[..., 1:]  # sliced: H stride 6, W 5 wide
    dst = torch.empty(src.shape, device=DEVICE, memory_format=torch.channels_last)
    assert relayout.relayout_supported(src, dst) is not None
    assert torch.equal(conv_io.relayout(src, dst), src)


def test_a_planned_relayout_copies_into_a_fresh_tensor_of_its_layout_on_every_call(relayout):
    """``PlannedRelayout``: the planned source layout takes the kernel; a source laid out otherwise
    (the plan cannot know what a library gives) and a layout the kernel does not serve take torch's
    copy; every call returns a new tensor of the planned layout and dtype."""
    src = torch.randn(2, 5, 3, 4, device=DEVICE)
    cl = torch.empty(src.shape, dtype=torch.float16, device="meta", memory_format=torch.channels_last)
    plan = relayout.PlannedRelayout(src, tuple(cl.shape), cl.stride(), cl.dtype)
    assert plan.by_kernel and plan.launch is not None
    first, second = plan(src), plan(src * 2)
    for out, want in ((first, src), (second, src * 2)):
        assert out.stride() == cl.stride() and out.dtype == torch.float16
        assert torch.equal(out, want.half())
    assert first.data_ptr() != second.data_ptr()
    other = src.to(memory_format=torch.channels_last)  # same shape and dtype, other strides
    assert torch.equal(plan(other), src.half()) and plan(other).stride() == cl.stride()
    sliced = torch.randn(2, 5, 3, 6, device=DEVICE)[..., 1:5]  # spatial dims do not flatten
    by_copy = relayout.PlannedRelayout(sliced, tuple(cl.shape), cl.stride(), torch.float32)
    assert not by_copy.by_kernel and torch.equal(by_copy(sliced), sliced)
    empty = torch.empty(0, 5, 3, 4, device=DEVICE)
    nothing = relayout.PlannedRelayout(empty, (0, 5, 3, 4), empty.stride(), torch.float32)
    assert nothing(empty).shape == (0, 5, 3, 4)
