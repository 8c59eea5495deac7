"""Parity of ``backend="fusion"`` with eager, as a user would run it: no ``import fusion_backend`` anywhere.

    python tools/parity_check.py                  # convt3d and conv2d at full size, fp32 (TF32 off) + bf16
    python tools/parity_check.py --seeds conv2d_small --dtypes fp32

``--seeds`` takes the short names of ``SHORT_NAMES`` or file names (without ``.py``) from
``demos/seeds/``.  ``torch.compile(model, backend="fusion")`` finds the backend through its entry
point.  For each model and dtype it runs one training step (forward, ``out.float().sum().backward()``)
compiled and eager, prints ``||compiled - eager|| / ||eager||`` for the output and every gradient
(input, weight, bias, multiplier), counts the fused ops that ran (from the profiler, by name), and
exits 1 if a count is not 1 or an error exceeds the bound (fp32 1e-5, bf16 1e-2).

In fp32 a float64 run is the referee for tensors that are sums with heavy cancellation (a conv bias
gradient): there eager itself is ~1e-4 off float64 and any other summation order differs from it by
as much, so such a tensor passes when compiled is at least as close to float64 as eager is; both
errors are printed, nothing is hidden.  bf16 means autocast on CUDA; on CPU the
bf16 row is skipped (the CPU path is the plain-torch reference and autocast on CPU is not the target).
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import sys
from pathlib import Path

import torch

SEEDS = Path(__file__).resolve().parents[1] / "demos" / "seeds"
BOUNDS = {"fp32": 1e-5, "bf16": 1e-2}
#: ``--seeds`` short names -> model files in ``demos/seeds/`` (the models ``conv_epilogue`` fuses).
SHORT_NAMES = {
    "convt3d": "convt3d_leaky_mul_leaky_maxpool",
    "conv2d": "conv2d_mul_leaky_gelu",
    "conv2d_small": "conv2d_mul_leaky_gelu_small",
}


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, SEEDS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    return module.Model(*module.get_init_inputs()), module.get_inputs()


def train_step(model, x, dtype: str, device: str):
    x = x.clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "bf16"):
        out = model(x)
    out.float().sum().backward()
    module = getattr(model, "_orig_mod", model)  # torch.compile's wrapper prefixes parameter names
    grads = {"input": x.grad} | {name: p.grad for name, p in module.named_parameters()}
    return out.detach(), grads


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def profiled(fn):
    """``(fn(), number of fused-op calls it made)``, counted by name with the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = fn()
    return result, sum(e.count for e in prof.key_averages() if e.key == "fusion::conv_epilogue_fwd")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="convt3d,conv2d")
    parser.add_argument("--dtypes", default="fp32,bf16")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    assert "fusion_backend" not in sys.modules
    ok = True
    for seed in args.seeds.split(","):
        seed = SHORT_NAMES.get(seed, seed)
        model, (x,) = load(seed)
        model, x = model.to(device), x.to(device)
        eager = copy.deepcopy(model)
        # decide="fuse": this checks the fused ops themselves (with the default "measure", a region
        # Inductor runs faster, and every region on CPU, would be left to Inductor)
        compiled = torch.compile(model, backend="fusion", options={"decide": "fuse"})
        for dtype in args.dtypes.split(","):
            if dtype == "bf16" and device == "cpu":
                print(f"{seed} bf16: skipped on CPU")
                continue
            torch._dynamo.reset()
            train_step(compiled, x, dtype, device)  # compiles
            (got, got_grads), calls = profiled(functools.partial(train_step, compiled, x, dtype, device))
            want, want_grads = train_step(eager, x, dtype, device)
            got_all, want_all = {"output": got} | got_grads, {"output": want} | want_grads
            errors = {k: rel(got_all[k], want_all[k]) for k in want_all}
            refereed = {}
            if dtype == "fp32" and max(errors.values()) > BOUNDS[dtype]:
                # Keep only what the referee needs: conv2d's float64 step is large next to 24 GB.
                keep = {k for k, e in errors.items() if e > BOUNDS[dtype]}
                got_all = {k: v for k, v in got_all.items() if k in keep}
                want_all = {k: v for k, v in want_all.items() if k in keep}
                del got, want, got_grads, want_grads
                ref, ref_grads = train_step(copy.deepcopy(eager).double(), x.double(), dtype, device)
                ref_all = {"output": ref} | ref_grads
                refereed = {k: (rel(got_all[k], ref_all[k]), rel(want_all[k], ref_all[k])) for k in keep}
                del ref, ref_grads, ref_all
            passed = calls == 1 and all(e <= BOUNDS[dtype] or (k in refereed and refereed[k][0] <= refereed[k][1])
                                        for k, e in errors.items())
            ok &= passed
            detail = ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
            detail += "".join(f"; {k} vs float64: compiled {c:.2e}, eager {e:.2e}" for k, (c, e) in refereed.items())
            print(f"{seed} {dtype} ({device}): {'PASS' if passed else 'FAIL'}  fused ops {calls}; "
                  f"rel vs eager: {detail}")
    print("imported by the backend itself:", "fusion_backend" in sys.modules)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
