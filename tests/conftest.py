"""Test set-up shared by the whole suite.

Without CUDA, Triton kernels run on CPU tensors under Triton's interpreter.  ``TRITON_INTERPRET`` is
read when ``@triton.jit`` decorates a kernel, so it must be set before any kernel module is imported:
that is why this happens at the top of conftest, before the tests import ``fusion_backend``.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def kernel_device() -> str:
    """Device on which Triton kernels run in this session: CUDA, or CPU under the interpreter."""
    return KERNEL_DEVICE


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
