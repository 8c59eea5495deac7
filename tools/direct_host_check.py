"""Host time per call of a compiled ConvT3d pipeline forward: direct runner vs through Inductor (CUDA).

    python tools/direct_host_check.py

Compiles ``demos/seeds/convt3d_leaky_mul_leaky_maxpool.py`` at batch 2, 4x8x8 (GPU work ~0, so the
time per call is host time) three ways, twice: ``options={"direct": False}`` (AOTAutograd + Inductor),
the default direct runner, and the direct runner wrapped in ``torch._dynamo.disable``; then the op's
forward function alone.  Prints the best of 5 rounds of 300 calls, in us.  Also prints whether a torch
function mode is active inside the direct call and what ``torch.empty`` costs there (a slower dispatch
inside the compiled call would show).
"""

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "demos" / "seeds"))
sys.path.insert(0, str(ROOT))

import convt3d_leaky_mul_leaky_maxpool as convt3d_pipeline  # noqa: E402

import fusion_backend  # noqa: E402
import fusion_backend.backend as B  # noqa: E402
from fusion_backend.ops import conv_epilogue as ce  # noqa: E402
from fusion_backend.ops import direct_impls as dt  # noqa: E402


def t_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


def empty_us():
    t = time.perf_counter()
    for _ in range(200):
        torch.empty(10, device="cuda")
    return (time.perf_counter() - t) / 200 * 1e6


def main() -> None:
    if not torch.cuda.is_available():
        print("needs CUDA")
        return
    torch.manual_seed(0)
    model = convt3d_pipeline.Model(*convt3d_pipeline.get_init_inputs()).cuda()
    x = torch.rand(2, 16, 4, 8, 8, device="cuda")
    info = {}
    original = dt.direct_impl(ce.conv_epilogue)

    def probe(*args):
        if "empty_inside" not in info:
            info["torch_function_enabled"] = torch._C._is_torch_function_enabled()
            info["torch_function_stack"] = torch._C._len_torch_function_stack()
            info["empty_inside_us"] = min(empty_us() for _ in range(5))
            info["args"] = args
        return original(*args)

    dt.register_direct(ce.conv_epilogue, probe)
    print("torch.empty outside a compiled call, us:", min(empty_us() for _ in range(5)))

    def compiled(options, wrap=False):
        torch._dynamo.reset()
        real = B.direct_module
        if wrap:
            class Wrapped:
                def __init__(self, module):
                    self.forward = torch._dynamo.disable(module.forward)

            B.direct_module = lambda gm: Wrapped(real(gm))
        try:
            f = torch.compile(model, backend="fusion", options=options)
            f(x)
            fusion_backend.settle()  # decisions deferred past the first call: time the settled code
            return t_us(lambda: f(x))
        finally:
            B.direct_module = real

    results = {}
    with torch.no_grad():
        for rnd in range(2):
            results[f"via-inductor{rnd}"] = compiled({"direct": False})
            results[f"direct{rnd}"] = compiled({})
            results[f"direct-disable{rnd}"] = compiled({}, wrap=True)
        a = info.pop("args")
        results["op forward alone"] = t_us(lambda: ce.CONV_EPILOGUE.forward_impl(a[0], a[1], a[2], list(a[3]), a[4], False))
    dt.register_direct(ce.conv_epilogue, original)
    print(info)
    for name, us in results.items():
        print(f"{name:24s} {us:8.1f} us/call")


if __name__ == "__main__":
    main()
