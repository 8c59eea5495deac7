"""Launch the fused conv kernels once each, inside a profiler range, for Nsight Compute.

    bash tools/profile_conv_kernels.sh            # on the GPU machine: ncu over this script, then a summary
    python tools/profile_conv_kernels.py --summarize ncu.csv

Seeds A and B, fp32 (TF32 as PyTorch's default) and bf16: the fused forward (``FUSION_CONV_IMPL=triton``
through ``fusion::conv_epilogue_fwd``), the library forward (cuDNN + epilogue kernel) for comparison,
and the compact backward kernels (``kernels.conv_fused_bwd``).  Every case runs once before the
range (compilation, autotuning), then once inside ``torch.cuda.profiler`` start/stop, so
``ncu --profile-from-start off`` sees one launch of each kernel.  ``--summarize`` turns ncu's CSV
(``--csv --page details``) into a short table: duration, DRAM and SM throughput, occupancy, the
main warp stall.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def run_cases(seeds: list[str], dtypes: list[str]) -> None:
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
            x, w, b, ops, _spec, config = fwd_tool._seed(seed, dtype)

            def forward(impl, x=x, w=w, b=b, ops=ops, config=config):
                os.environ[ce.CONV_IMPL_ENV] = impl
                return torch.ops.fusion.conv_epilogue_fwd(x, w, b, ops, config, True)

            cases.append((f"{seed} {name} forward fused", lambda f=forward: f("triton")))
            cases.append((f"{seed} {name} forward library", lambda f=forward: f("library")))
            bx, bw, args, grad, _full, _ = (bwd_tool.seed_a if seed == "A" else bwd_tool.seed_b)(dtype)
            cases.append(
                (f"{seed} {name} backward compact", lambda g=grad, x=bx, w=bw, a=args: K.convolution_backward(g, x, w, *a))
            )
    for _label, fn in cases:  # compile and autotune outside the range
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for label, fn in cases:
        torch.cuda.nvtx.range_push(label)
        fn()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled:", ", ".join(label for label, _ in cases))


#: ncu metric names (as printed in --page details) -> column title
METRICS = {
    "Duration": "us",
    "DRAM Throughput": "DRAM %",
    "Compute (SM) Throughput": "SM %",
    "Achieved Occupancy": "occup %",
    "Registers Per Thread": "regs",
}


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
        if name.startswith("Stall ") or "stall" in name.lower():
            try:
                stalls[key].append((float(value.replace(",", "")), name))
            except ValueError:
                pass
    cols = list(METRICS.values())
    print(f"{'id':>4} {'kernel':40} " + " ".join(f"{c:>8}" for c in cols) + "  top stall")
    for key, vals in rows.items():
        top = max(stalls[key])[1] if stalls[key] else ""
        print(f"{key[0]:>4} {key[1]:40} " + " ".join(f"{vals.get(c, ''):>8}" for c in cols) + f"  {top}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="A,B")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--summarize", metavar="CSV", help="print the summary of an ncu --csv --page details file")
    args = parser.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return 0
    run_cases(args.seeds.split(","), args.dtypes.split(","))
    return 0


if __name__ == "__main__":
    sys.exit(main())
