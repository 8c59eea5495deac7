"""Launch the fused conv kernels once each, inside a profiler range, for Nsight Compute.

    bash tools/profile_conv_kernels.sh            # on the GPU machine: ncu over this script, then a summary
    python tools/profile_conv_kernels.py --summarize ncu.csv

The ``seeds`` suite's ConvTranspose3d and Conv2d convs (``--seeds convt3d,conv2d``, shapes as
``tools/bench_conv_fused.py``), fp32 (TF32 as PyTorch's default) and bf16: the fused forward
(``FUSION_CONV_IMPL=triton`` through ``fusion::conv_epilogue_fwd``), the library forward (cuDNN +
epilogue kernel) for comparison, and the Triton backward kernels (``kernels.conv_fused_bwd``).  Every
case runs once before the range (compilation, autotuning), then once inside ``torch.cuda.profiler``
start/stop, so ``ncu --profile-from-start off`` sees one launch of each kernel.  ``--summarize`` turns
ncu's CSV (``--csv --page details``) into a short table: duration, DRAM and SM throughput, occupancy,
the main warp stall.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def run_cases(seeds: list[str], dtypes: list[str], only: str = "") -> None:
    import bench_conv_fused as fwd_tool
    import bench_conv_fused_bwd as bwd_tool
    import torch

    from fusion_backend.kernels import conv_fused_bwd as K
    from fusion_backend.ops import conv_epilogue as ce

    torch_dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    cases = []
    for seed in seeds:
        for name in dtypes:
            dtype = torch_dtypes[name]
            x, w, b, ops, _spec, config = fwd_tool._workload(seed, dtype)

            def forward(impl, x=x, w=w, b=b, ops=ops, config=config):
                os.environ[ce.CONV_IMPL_ENV] = impl
                return torch.ops.fusion.conv_epilogue_fwd(x, w, b, ops, config, True)

            cases.append((f"{seed} {name} forward fused", lambda f=forward: f("triton")))
            cases.append((f"{seed} {name} forward library", lambda f=forward: f("library")))
            bx, bw, args, grad, _full, _ = (bwd_tool.convt3d_maxpool if seed == "convt3d" else bwd_tool.conv2d_dense)(dtype)
            cases.append(
                (f"{seed} {name} backward triton", lambda g=grad, x=bx, w=bw, a=args: K.convolution_backward(g, x, w, *a))
            )
    launch_in_profiler_range([(label, fn) for label, fn in cases if only in label])


def launch_in_profiler_range(cases: list[tuple[str, Any]], warm_runs: int = 1) -> None:
    """Run each ``(label, call)`` ``warm_runs`` times (compiling and tuning outside the range), then
    once each inside ``torch.cuda.profiler`` start/stop under an NVTX range of its label, so that
    ``ncu --profile-from-start off`` sees one launch of each kernel.  Without CUDA (the interpreter)
    the calls run without a profiler range."""
    import torch

    cuda = torch.cuda.is_available()
    for _ in range(warm_runs):
        for _label, fn in cases:
            fn()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
    for label, fn in cases:
        if cuda:
            torch.cuda.nvtx.range_push(label)
        fn()
        if cuda:
            torch.cuda.nvtx.range_pop()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    print("profiled:", "; ".join(label for label, _ in cases))


#: ncu metric names (as printed in --page details) -> column title
METRICS = {
    "Duration": "us",
    "DRAM Throughput": "DRAM %",
    "Compute (SM) Throughput": "SM %",
    "Achieved Occupancy": "occup %",
    "Registers Per Thread": "regs",
    "Executed Instructions": "instr",
}


#: Warp stall reasons, requested by profile_conv_kernels.sh as ``--metrics`` (ncu prints them under
#: their raw names): smsp__warp_issue_stalled_<reason>_per_warp_active.pct
_STALL_PREFIX = "smsp__warp_issue_stalled_"
_STALL_SUFFIX = "_per_warp_active.pct"
STALL_REASONS = (
    "barrier", "branch_resolving", "dispatch_stall", "drain", "imc_miss", "lg_throttle", "long_scoreboard",
    "math_pipe_throttle", "membar", "mio_throttle", "misc", "no_instruction", "not_selected", "selected",
    "short_scoreboard", "sleeping", "tex_throttle", "wait",
)  # fmt: skip


def summarize(path: str) -> None:
    rows: dict[tuple[str, str], dict[str, str]] = defaultdict(dict)
    stalls: dict[tuple[str, str], list[tuple[float, str]]] = defaultdict(list)
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # skip ncu's own log lines
    for r in csv.DictReader(lines):
        key = (r.get("ID", ""), r.get("Kernel Name", "")[:40])
        name, value, unit = r.get("Metric Name", ""), r.get("Metric Value", ""), r.get("Metric Unit", "")
        if name in METRICS:
            if name == "Duration" and unit in ("msecond", "ms"):
                value = f"{float(value.replace(',', '')) * 1000:.1f}"
            elif name == "Duration" and unit in ("nsecond", "ns"):
                value = f"{float(value.replace(',', '')) / 1000:.1f}"
            rows[key][METRICS[name]] = value
        if name.startswith(_STALL_PREFIX) and name.endswith(_STALL_SUFFIX):
            try:
                stalls[key].append((float(value.replace(",", "")), name[len(_STALL_PREFIX) : -len(_STALL_SUFFIX)]))
            except ValueError:
                pass
    cols = list(METRICS.values())
    print(f"{'id':>4} {'kernel':40} " + " ".join(f"{c:>8}" for c in cols) + "  top stalls (% of active warp cycles)")
    for key, vals in rows.items():
        top = ", ".join(f"{name} {pct:.0f}" for pct, name in sorted(stalls[key], reverse=True)[:4])
        print(f"{key[0]:>4} {key[1]:40} " + " ".join(f"{vals.get(c, ''):>8}" for c in cols) + f"  {top}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="convt3d,conv2d", help="convt3d, conv2d")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--only", default="", help="profile only the cases whose label contains this")
    parser.add_argument("--stall-metrics", action="store_true", help="print the ncu --metrics list and exit")
    parser.add_argument("--summarize", metavar="CSV", help="print the summary of an ncu --csv --page details file")
    args = parser.parse_args()
    if args.stall_metrics:
        print(",".join(f"{_STALL_PREFIX}{r}{_STALL_SUFFIX}" for r in STALL_REASONS))
        return 0
    if args.summarize:
        summarize(args.summarize)
        return 0
    run_cases(args.seeds.split(","), args.dtypes.split(","), args.only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
