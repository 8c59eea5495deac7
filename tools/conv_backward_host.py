"""Host time of the conv backward inside a fused training step, against eager's (CUDA).

A host-bound training step of a fused region costs more host time than eager's step for the same
layer (``docs/perf/RESULTS.md``, "Where a host-bound training step's time goes"), and a profile puts
a large share of the fused backward's host time in ``aten.convolution_backward``.  This tool shows
whether the layouts the fused op hands that call are the reason.  For each benchmark model file it

* compiles the model with ``backend="fusion"`` and ``decide="fuse"``, runs 200 training steps with
  autograd's work on the calling thread, and prints the host time per step, the host time per call of
  ``ops.conv_io.run_conv_backward`` and the shapes and strides of its last call;
* does the same for the eager model (whose conv backward does not go through that function);
* times ``aten.convolution_backward`` alone on the layer's shapes with the gradient and input NCHW,
  with a channels-last gradient, and with both channels-last.

Usage (repository root, needs CUDA)::

    python tools/conv_backward_host.py demos/convnets/conv2d_64_k3_relu_batch1.py demos/convnets/conv2d_depthwise_144_k3_relu6.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_step import _step_fn, time_calls  # noqa: E402

from fusion_backend.bench.suite import load_workload  # noqa: E402
from fusion_backend.ops import conv_io  # noqa: E402

_CONVS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d,
          torch.nn.ConvTranspose3d)


def _spy_on_conv_backward(calls: list[tuple]) -> None:
    """Replace ``run_conv_backward`` wherever it was imported with a version that records its host
    time, shapes and strides in ``calls``."""
    original = conv_io.run_conv_backward

    def spy(grad_y, x, weight, spec, need_x, need_w, need_b=False):
        start = time.perf_counter()
        result = original(grad_y, x, weight, spec, need_x, need_w, need_b)
        calls.append((time.perf_counter() - start, tuple(grad_y.shape), grad_y.stride(), x.stride(), weight.stride(),
                      str(grad_y.dtype), need_x, need_w, need_b))  # fmt: skip
        return result

    for module in list(sys.modules.values()):
        if getattr(module, "run_conv_backward", None) is original:
            module.run_conv_backward = spy


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t


def measure(path: str, steps: int) -> None:
    model, inputs = load_workload(path).build(seed=0)
    model = model.cuda()
    inputs = [x.cuda().requires_grad_(True) for x in inputs]
    calls: list[tuple] = []
    _spy_on_conv_backward(calls)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusion", options={"decide": "fuse"})
    torch.autograd.set_multithreading_enabled(False)
    try:
        for name, fn in (("fusion", compiled), ("eager", model)):
            step = _step_fn(fn, model, inputs, True, "fp32")
            calls.clear()
            enqueue_ms, _ = time_calls(step, steps, torch.cuda.synchronize)
            recent = calls[-steps:]
            per_call = sum(c[0] for c in recent) / len(recent) * 1e6 if recent else 0.0
            layout = recent[-1][1:] if recent else "not called"
            print(f"{Path(path).stem} {name}: step host {enqueue_ms * 1e3:.0f} us; run_conv_backward "
                  f"{len(recent)} calls, {per_call:.0f} us each; last call (shape, strides grad/x/weight, dtype, "
                  f"needs x/w/b): {layout}")
    finally:
        torch.autograd.set_multithreading_enabled(True)
    conv = next(m for m in model.modules() if isinstance(m, _CONVS))
    x = inputs[0].detach()
    y = conv(x).detach()
    transposed = isinstance(conv, (torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d))
    output_padding = list(getattr(conv, "output_padding", (0,) * (x.dim() - 2)))
    for label, grad, xx in (("NCHW", torch.randn_like(y), x), ("channels-last grad", _channels_last(torch.randn_like(y)), x),
                            ("both channels-last", _channels_last(torch.randn_like(y)), _channels_last(x))):
        def call(grad=grad, xx=xx):
            torch.ops.aten.convolution_backward(grad, xx, conv.weight, [conv.out_channels], list(conv.stride),
                                                list(conv.padding), list(conv.dilation), transposed, output_padding,
                                                conv.groups, [True, True, True])  # fmt: skip

        enqueue_ms, wall_ms = time_calls(call, 300, torch.cuda.synchronize)
        print(f"   aten.convolution_backward, {label}: host {enqueue_ms * 1e3:.0f} us, wall {wall_ms * 1e3:.0f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    for path in args.files:
        measure(path, args.steps)


if __name__ == "__main__":
    main()
