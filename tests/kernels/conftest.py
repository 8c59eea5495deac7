"""Fixtures of the kernel tests."""

import pytest
import torch


@pytest.fixture
def exact_fp32_heuristic_tiles(monkeypatch):
    """For the conv family's numeric tests: fp32 is checked exact, so cuDNN's TF32 flag (True by
    default, which the kernels' dots follow) is turned off and on CUDA too the fp32 floor is full fp32's
    (the TF32 path has its own test); tiles are the heuristic's, untimed (``FUSION_CONV_AUTOTUNE=0``):
    on CUDA each new signature would otherwise compile and time several (``test_conv_family_tiles``
    covers that choice)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setenv("FUSION_CONV_AUTOTUNE", "0")
