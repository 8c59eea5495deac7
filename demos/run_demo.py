"""Demo: compile the ``seeds`` suite's models with ``backend="fusion"`` and show what happened.

    python demos/run_demo.py                 # convt3d, conv2d, convt2d; full size on CUDA, shrunk on CPU
    python demos/run_demo.py --seeds convt3d --size full --dtype bf16

``--seeds`` takes short names (see ``SHORT_NAMES``) or file names without ``.py`` from ``demos/seeds/``.
For each model: the rewrites (from the report); for the output and every gradient (input and
parameters) the max absolute and the relative difference to eager (||fusion - eager|| / ||eager||),
and the relative error of fusion and of eager vs a float64 run; on CUDA the median time of a forward
(under no_grad) and of a training step for eager, Inductor and fusion, measured in the same run (CUDA
events, after warm-up), plus the memory held between forward and backward.

TF32 is OFF by default here (``--tf32`` turns it on), so fp32 parity is a like-for-like comparison;
the benchmark (``python -m fusion_backend bench``) leaves PyTorch's defaults alone (TF32 on for
convolutions), so its fp32 times are lower.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import statistics
import sys
from pathlib import Path

import torch

from fusion_backend import settle
from fusion_backend.testing import float64_reference, relative_error, run_and_backward, run_settled

SEEDS = Path(__file__).resolve().parent / "seeds"

#: ``--seeds`` short names -> model files in ``demos/seeds/``.
SHORT_NAMES = {
    "convt3d": "convt3d_leaky_mul_leaky_maxpool",  # ConvTranspose3d -> leaky -> x m -> leaky -> MaxPool3d
    "conv2d": "conv2d_mul_leaky_gelu",  # Conv2d -> x m -> leaky -> GELU
    "convt2d": "convt2d_global_mean_bias_logsumexp",  # ConvTranspose2d -> global mean -> + b -> logsumexp
    "conv2d_small": "conv2d_mul_leaky_gelu_small",
    "convt2d_small": "convt2d_global_mean_bias_logsumexp_small",
}


def load(name: str, size: str):
    spec = importlib.util.spec_from_file_location(name, SEEDS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # Dynamo looks classes up through their module
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    model = module.Model(*module.get_init_inputs())
    inputs = module.get_inputs()
    if size == "small":  # keep every hyper-parameter, cut batch and spatial extent
        inputs = [t[(slice(0, 2), slice(None), *(slice(0, 12) for _ in t.shape[2:]))].contiguous() for t in inputs]
    return model, inputs


def step(fn, x, train: bool, autocast):
    with autocast:
        out = fn(x)
    if train:
        out.float().sum().backward()
    return out


def time_ms(fn, reps: int = 20) -> float:
    fn()
    settle()  # decisions the fusion backend deferred past the first call: time the settled code
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def held_between_fw_and_bw(fn, x, autocast) -> int:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with autocast:
        out = fn(x)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    out.float().sum().backward()
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="convt3d,conv2d,convt2d",
                        help=f"comma-separated: {', '.join(SHORT_NAMES)}, or a file name in demos/seeds/")
    parser.add_argument("--size", choices=["full", "small"], default=None, help="default: full on CUDA, small on CPU")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16 = autocast")
    parser.add_argument("--tf32", action="store_true", help="allow TF32 in convolutions (PyTorch's default)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = args.size or ("full" if device == "cuda" else "small")
    # Off unless asked: compare like for like (the fused kernels follow cuDNN's flag, as cuDNN does).
    torch.backends.cudnn.allow_tf32 = args.tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    autocast = torch.autocast(device, dtype=torch.bfloat16) if args.dtype == "bf16" else contextlib.nullcontext()

    for seed in args.seeds.split(","):
        name = SHORT_NAMES.get(seed.strip(), seed.strip())
        model, (x,) = load(name, size)
        model, x = model.to(device), x.to(device)
        eager = copy.deepcopy(model)
        tf32 = "TF32 on" if args.tf32 else "TF32 off"
        print(f"\n=== {name} ({size}, {args.dtype}, {tf32}, {device}) input {tuple(x.shape)}")

        torch._dynamo.reset()
        compiled = torch.compile(model, backend="fusion")
        got, got_grads, reports = run_settled(compiled, [x.clone().requires_grad_()], True, model, autocast)
        want, want_grads = run_and_backward(eager, [x.clone().requires_grad_()], True, eager, autocast)
        ref, ref_grads = float64_reference(eager, [x.clone().requires_grad_()], True)
        for r in reports:
            print(r)
        print(f"  {'tensor':28s} {'max|fusion-eager|':>18s} {'rel vs eager':>13s} {'fusion vs f64':>14s} "
              f"{'eager vs f64':>13s}  (rel = ||a - b|| / ||b||)")
        rows = [("output", got, want, ref)] + [(k, got_grads[k], want_grads[k], ref_grads[k]) for k in want_grads]
        for name_, g, w, r in rows:
            print(f"  {name_:28s} {(g.float() - w.float()).abs().max().item():18.3e} {relative_error(g, w):13.3e} "
                  f"{relative_error(g, r):14.3e} {relative_error(w, r):13.3e}")

        if device != "cuda":
            print("  (timings need CUDA)")
            continue
        torch._dynamo.reset()
        inductor = torch.compile(copy.deepcopy(eager), backend="inductor")
        fused = torch.compile(copy.deepcopy(eager), backend="fusion")
        rows = {}
        xt = x.clone().requires_grad_()
        for label, fn in (("eager", eager), ("inductor", inductor), ("fusion", fused)):
            with torch.no_grad():
                fwd = time_ms(lambda fn=fn, x=x: step(fn, x, False, autocast))
            train = time_ms(lambda fn=fn, xt=xt: step(fn, xt, True, autocast))
            held = held_between_fw_and_bw(fn, xt, autocast)
            rows[label] = (fwd, train, held)
        print(f"  {'backend':10s} {'forward ms':>11s} {'train ms':>9s} {'held MB':>9s}")
        for label, (fwd, train, held) in rows.items():
            print(f"  {label:10s} {fwd:11.3f} {train:9.3f} {held / 2**20:9.1f}")
        fe, te, _ = rows["eager"]
        fi, ti, hi = rows["inductor"]
        ff, tf, hf = rows["fusion"]
        print(f"  fusion speed-up: forward {fe / ff:.2f}x vs eager, {fi / ff:.2f}x vs inductor; "
              f"train {te / tf:.2f}x vs eager, {ti / tf:.2f}x vs inductor; held memory {hf / max(hi, 1):.2f} of inductor's")


if __name__ == "__main__":
    main()
