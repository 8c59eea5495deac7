"""Time the library conv (aten / cuDNN) of the norm and channel-reduction families' workloads in NCHW
against channels-last: the forward with x as given, with x relaid first (torch's copy) and with x
already channels-last, the copies themselves, and ``aten.convolution_backward`` on NCHW against
channels-last tensors.  What ``ops/library_conv.py``'s rule rests on.

Usage (repository root, needs CUDA)::

    python tools/conv_layout_timing.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.benchmark import Timer

#: name -> (conv, x shape, weight shape, transposed, stride, padding)
CASES = {
    "Conv2d 64->64 k3 p1, 32x64x128x128": (F.conv2d, (32, 64, 128, 128), (64, 64, 3, 3), False, 1, 1),
    "ConvTranspose2d 64->32 k4 s2 p1, 16x64x64x64": (F.conv_transpose2d, (16, 64, 64, 64), (64, 32, 4, 4), True, 2, 1),
    "Conv2d 64->64 k3 p1, 32x64x64x64": (F.conv2d, (32, 64, 64, 64), (64, 64, 3, 3), False, 1, 1),
    "Conv2d 64->128 k3, 64x64x128x128": (F.conv2d, (64, 64, 128, 128), (128, 64, 3, 3), False, 1, 0),
}


def _ms(fn) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=0.3).median * 1e3


def time_case(conv, x_shape, w_shape, transposed: bool, stride: int, padding: int,
              dtype: torch.dtype) -> dict[str, float]:  # fmt: skip
    """ms per call of each variant (see the module docstring)."""
    cl = torch.channels_last
    x = torch.randn(x_shape, device="cuda", dtype=dtype)
    w = torch.randn(w_shape, device="cuda", dtype=dtype) * 0.05
    x_cl, w_cl = x.to(memory_format=cl), w.to(memory_format=cl)
    g = torch.randn_like(conv(x, w, None, stride, padding))
    g_cl = g.to(memory_format=cl)

    def backward(grad, inp, weight):
        return torch.ops.aten.convolution_backward(
            grad, inp, weight, None, [stride] * 2, [padding] * 2, [1, 1], transposed, [0, 0], 1, [True, True, False],
        )  # fmt: skip

    return {
        "fwd nchw": _ms(lambda: conv(x, w, None, stride, padding)),
        "fwd cl (x relaid)": _ms(lambda: conv(x.to(memory_format=cl), w_cl, None, stride, padding)),
        "fwd cl (x cl)": _ms(lambda: conv(x_cl, w_cl, None, stride, padding)),
        "x -> cl copy": _ms(lambda: x.to(memory_format=cl)),
        "y cl -> nchw copy": _ms(lambda: g_cl.contiguous()),
        "bwd nchw": _ms(lambda: backward(g, x, w)),
        "bwd cl": _ms(lambda: backward(g_cl, x_cl, w_cl)),
    }


def main() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for name, case in CASES.items():
            cells = "  ".join(f"{k} {v:.3f}" for k, v in time_case(*case, dtype).items())
            print(f"{str(dtype).removeprefix('torch.'):8} {name:46} {cells}", flush=True)


if __name__ == "__main__":
    main()
