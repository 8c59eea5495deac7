"""The Python a fused op's call costs, on CPU, with its conv and its kernel launches stubbed.

A region's host time per call is what a host-bound step (the default mode, small batches) waits on.
On a machine without a GPU this measures the op's own Python: the Triton path runs on CPU tensors
(``FUSION_CPU_KERNELS=triton``), ``FastLaunch`` launches nothing and the conv (aten's forward and
backward) returns an empty tensor of its output's layout, so what is left is the checks, the plans'
lookups, the chains' operands, the allocations.  For ``conv_group_norm`` (conv -> GroupNorm(32) ->
SiLU, 1x64x16x16 channels-last, fp32) it prints microseconds per call of the forward and the backward
implementations (``forward_impl`` / ``backward_impl``, what the direct runner and the custom ops call),
with the call plans the declaration keeps and without them; the best of five rounds.

Usage (repository root; any machine)::

    python tools/op_host_cpu.py [--calls 500]

The numbers are this machine's: compare the two columns, and runs on one machine, not machines.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ["FUSION_CPU_KERNELS"] = "triton"
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fusion_backend.ir.specs import ConvSpec  # noqa: E402
from fusion_backend.kernels import launch  # noqa: E402
from fusion_backend.ops import library_conv  # noqa: E402
from fusion_backend.ops.chain import ChainStep, PointwiseKind  # noqa: E402
from fusion_backend.ops.conv_group_norm import (  # noqa: E402
    CONV_GROUP_NORM,
    ConvGroupNormConfig,
    triton_path,  # noqa: E402
)
from fusion_backend.ops.conv_group_norm import config as group_norm_config  # noqa: E402


def _stub_device_work(y_like: torch.Tensor) -> None:
    """No kernel launches, no conv: what stays is the op's Python and its allocations."""
    launch.FastLaunch.__call__ = lambda self, *args, **kwargs: None
    group_norm_config.run_conv = lambda x, w, b, spec: torch.empty_like(y_like)
    library_conv.ConvBackwardPlan.__call__ = lambda self, grad_y, x, w, need_x, need_w, need_b: (None, None, None)


def _per_call(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return min(rounds)


def _with_plans(kept: bool) -> None:
    """The declaration's settled plans on or off (off: every call plans as a first call does)."""
    declaration = CONV_GROUP_NORM.d
    object.__setattr__(declaration, "settled_forward", triton_path.settled if kept else None)
    object.__setattr__(declaration, "settled_backward", triton_path.settled_backward if kept else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500, help="calls per round (default 500)")
    args = parser.parse_args()
    cl = torch.channels_last
    x = torch.randn(1, 64, 16, 16).to(memory_format=cl)
    weight = torch.randn(64, 64, 3, 3).to(memory_format=cl)
    bias, operands = torch.randn(64), [torch.rand(64) + 0.5, torch.randn(64)]
    spec = ConvSpec(False, (1, 1), (1, 1), (1, 1), (0, 0), 1)
    config = ConvGroupNormConfig(spec, 32, 1e-5, 0, 1, (), (ChainStep(PointwiseKind.SILU),)).to_json()
    _stub_device_work(torch.empty(1, 64, 16, 16).to(memory_format=cl))
    out, *state = CONV_GROUP_NORM.forward_impl(x, weight, bias, operands, config, True)
    grad, mask = torch.randn_like(out), [True] * 5
    print("conv_group_norm (conv -> GroupNorm(32) -> SiLU, 1x64x16x16 channels-last), us per call")
    print(f"{'':36}{'kept plans':>12}{'no plans':>12}")
    rows = {"forward, saving nothing": lambda: CONV_GROUP_NORM.forward_impl(x, weight, bias, operands, config, False),
            "backward": lambda: CONV_GROUP_NORM.backward_impl(grad, x, weight, bias, operands, *state, config, mask)}
    for name, call in rows.items():
        times = []
        for kept in (True, False):
            _with_plans(kept)
            times.append(_per_call(call, args.calls))
        print(f"{name:36}{times[0]:12.1f}{times[1]:12.1f}")
    _with_plans(True)


if __name__ == "__main__":
    main()
