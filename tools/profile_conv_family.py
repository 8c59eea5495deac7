"""Launch the conv family's forward once per hook variant inside a profiler range, for Nsight Compute.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section LaunchStats \\
        --section Occupancy --section WarpStateStats --section InstructionStats \\
        --metrics "$(python tools/profile_conv_kernels.py --stall-metrics)" --csv --page details \\
        python tools/profile_conv_family.py demos/realnets/resnet50.py --filter '*64x64x56x56 -> 64 k3x3*' \\
        --tile 128,64,64,4,3 > ncu.csv
    python tools/profile_conv_kernels.py --summarize ncu.csv

Each distinct conv of the model files that ``--filter`` keeps (``tools/conv_shapes.py``, selected as
``tools/bench_conv.py`` selects) runs its forward four ways (``bench_conv.fprop_case``, the benchmark's
own calls): plain, with its output's statistics, with the BatchNorm + ReLU prologue, and with both; on
the tile ``--tile`` gives (block_m, block_n, block_k, warps, stages: the gather kernel) or each call's
tuned one.  Every call runs twice before the range (compiling, tuning), then once inside it, so ncu
sees one launch of each kernel, the statistics' combine launches included, in that order.  Without
ncu it prints the labels it would profile (``--list``), or needs CUDA (on CPU: ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_conv  # noqa: E402
from conv_shapes import collect  # noqa: E402
from profile_conv_kernels import launch_in_profiler_range  # noqa: E402

#: variant -> (the prologue, the statistics)
VARIANTS = {"plain": (False, False), "statistics": (False, True), "bn+relu prologue": (True, False),
            "both": (True, True)}  # fmt: skip


def parse_tile(text: str | None) -> Any:
    """``block_m,block_n,block_k,warps,stages`` as a gather-kernel ``TileConfig``; None for None."""
    if text is None:
        return None
    from fusion_backend.kernels.conv.tiles import TileConfig

    try:
        block_m, block_n, block_k, warps, stages = (int(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"--tile takes block_m,block_n,block_k,warps,stages (five ints), got {text!r}") from None
    return TileConfig(block_m, block_n, block_k, warps, stages)


def cases(models: list[str], patterns: str | None, dtype: str, tile: Any,
          device: torch.device) -> list[tuple[str, Callable[[], Any]]]:  # fmt: skip
    """``(label, call)`` for every selected conv and variant, in launch order."""
    collection = collect(bench_conv.model_files(models))
    built = []
    for shape in bench_conv.select(collection, patterns, None, None):
        inputs = bench_conv._Inputs.make(shape, bench_conv.DTYPES[dtype], device)
        for variant, (prologue, stats) in VARIANTS.items():
            steps, _ = bench_conv.fprop_case(inputs, prologue or stats, tile, prologue_part="bn-relu" if prologue else "",
                                             stats_part=stats)  # fmt: skip
            built.append((f"{shape.label()} {dtype} {variant}", steps["hooked" if prologue or stats else "kernel"]))
    return built


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="model files or folders (the benchmark layout)")
    parser.add_argument("--filter", help="comma-separated patterns of the convs to keep (tools/bench_conv.py's)")
    parser.add_argument("--dtype", default="bf16", choices=tuple(bench_conv.DTYPES))
    parser.add_argument("--tile", help="block_m,block_n,block_k,warps,stages (default: each call's tuned tile)")
    parser.add_argument("--list", action="store_true", help="print the calls' labels and exit (no launch)")
    args = parser.parse_args()
    tile = parse_tile(args.tile)
    if args.list:
        for shape in bench_conv.select(collect(bench_conv.model_files(args.models)), args.filter, None, None):
            print("\n".join(f"{shape.label()} {args.dtype} {variant}" for variant in VARIANTS))
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    launch_in_profiler_range(cases(args.models, args.filter, args.dtype, tile, device), warm_runs=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
