"""Time the conv family's passes over a grid of tiles on every distinct conv of the given models, to
choose ``kernels/conv/tiles.py``'s ``CANDIDATES`` (CUDA only).

    python tools/sweep_conv_tiles.py demos/realnets/resnet50.py --passes fprop,dgrad,wgrad --max-shapes 8
    python tools/sweep_conv_tiles.py --out /tmp/sweep.json --budget-s 300

Per shape (``conv_shapes``, largest first) and pass: cuDNN's time, the tuned launch's (whatever
``tiles.tuned_tile`` picks), and every tile of :data:`GRID` that fits the problem, each its GPU time per
call (``impl_choice.gpu_ms_per_call``, as ``tools/bench_conv.py`` times: calls queued behind a GPU spin,
L2 warm, so that neither the host's launch cost nor a busy host moves the ranking; NOTE: with
``triton.testing.do_bench`` instead, the hooked forward's steps read about 0.07 ms above the
conv-kernels report's for the same tile, on a host whose other GPU ran a benchmark, docs/perf/RESULTS.md)
on channels-last bf16 (``--dtype``) tensors; with ``--box`` each gradient tile also
loading boxes (``tiles.box_width``'s shape; where the call refuses a box, the tile's gather time stands
for it, as the timed choice would then run the gather), and with ``--halo`` each halo forward tile as box
tiles too (``tiles.halo_box_width``); with ``--taps`` each tap-major weight-gradient
tile also taking 3 (or 2) taps per program (``TileConfig.taps_per_program``); with ``--tma`` each forward
tile and input-gradient tile of a 1x1 conv also as the TMA row kernel's (``TileConfig.tma``; a call it
does not take, stride 2 or fp32, is skipped) and the TMA weight gradient's tiles timed beside the grid's (``tiles.tma_wgrad_tiles``);
with ``--halo`` each forward tile and depthwise weight-gradient tile also with the halo
(``TileConfig.halo``, ``kernels/conv/halo.py``; a call it does not take is skipped); with ``--per-sm 1,4`` each weight-gradient tile also with its split aiming at those programs per SM
(``TileConfig.programs_per_sm``; the split's cost against its programs); with ``--hooked`` the passes with their hooks
(``tools/bench_conv.py``'s: the forward with a BatchNorm + ReLU prologue and the output statistics, the
input gradient with relu' and the BatchNorm sums, the weight gradient with the prologue recomputed),
against cuDNN plus the Inductor passes the hooks replace (``unfused``); ``--fprop-hooks`` names what the
forward's hooked step fuses (``bench_conv.py``'s option: ``gn-silu``, the GroupNorm + SiLU prologue);
``--grid 'MxNxK wW sS,...'`` times those tiles instead of :data:`GRID`.  Prints one line per row
and, at the end, per pass: each tile's time as a fraction of the row's best (geometric mean over
rows) and the best set of ``--set-size`` tiles, what the candidates of a timed choice should be.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from bench_conv import DEFAULT_MODELS, FPROP_HOOKS, _Inputs, pass_case, select  # noqa: E402
from conv_shapes import collect  # noqa: E402

#: ``(block_m, block_n, block_k, num_warps, num_stages)`` tried per pass.
GRID = [(64, 64, 64, 4, 3), (128, 64, 64, 4, 3), (64, 128, 64, 4, 3), (128, 128, 64, 4, 3), (128, 128, 64, 8, 3),
        (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 32, 4, 4), (256, 64, 64, 8, 3),
        (64, 256, 64, 8, 3), (64, 64, 128, 4, 3), (128, 128, 128, 8, 3), (64, 256, 128, 8, 3),
        (128, 64, 64, 8, 3), (64, 128, 64, 8, 3)]  # fmt: skip
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: a row's baseline, ``bench_conv``'s step of that name: cuDNN's pass, or with ``--hooked`` cuDNN's plus the
#: passes the hooks replace
BASELINES = ("cudnn", "unfused")


def _steps(t: _Inputs, pass_name: str, tile: object, hooked: bool = False, fprop_hooks: str = "bn-relu-stats") -> object:
    """One call of ``pass_name`` with ``tile`` (None: the tuned choice's): ``bench_conv``'s plain or, where
    ``hooked``, hooked step."""
    return pass_case(t, pass_name, hooked, tile, fprop_hooks)[1]["hooked" if hooked else "kernel"]


def _baseline(t: _Inputs, pass_name: str, hooked: bool, fprop_hooks: str = "bn-relu-stats") -> object:
    """cuDNN's pass, or with ``hooked`` cuDNN's plus the Inductor passes the hooks replace (``bench_conv``'s
    ``cudnn`` or ``unfused`` step)."""
    return pass_case(t, pass_name, hooked, None, fprop_hooks)[1][BASELINES[hooked]]


def _grid(text: str) -> list[tuple[int, int, int, int, int]]:
    """``--grid``: comma-separated tiles as ``bench_conv`` labels them, ``MxNxK wW sS`` (e.g. ``128x256x64
    w8 s3``), the variant options adding their forms of each."""
    grid = []
    for spec in (part.strip() for part in text.split(",") if part.strip()):
        try:
            blocks, warps, stages = spec.split()
            bm, bn, bk = (int(v) for v in blocks.split("x"))
            grid.append((bm, bn, bk, int(warps.removeprefix("w")), int(stages.removeprefix("s"))))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--grid takes tiles as 'MxNxK wW sS', got {spec!r}") from None
    if not grid:
        raise argparse.ArgumentTypeError("--grid names no tile")
    return grid


def _score(rows: list[dict[str, float]], chosen: tuple[str, ...]) -> float:
    """The geometric mean over ``rows`` of the best time / the best time among ``chosen`` tiles."""
    return math.exp(sum(math.log(min(m[k] for k in m if k not in BASELINES) / min(m[k] for k in chosen))
                        for m in rows) / len(rows))  # fmt: skip


def _per_sm(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or any(not 1 <= v <= 4 for v in values):
        raise argparse.ArgumentTypeError(f"--per-sm takes comma-separated programs per SM from 1 to 4, got {text!r}")
    return values


def tile_variants(tile: Any, shape: Any, pass_name: str, box: bool, taps: bool, tma: bool,
                  per_sm: tuple[int, ...], halo: bool = False) -> list[Any]:  # fmt: skip
    """``tile`` and the variants the options add for ``pass_name`` on ``shape``: a box load of the same
    tile (``box``, the gradients), 3 or 2 taps per program (``taps``, a tap-major weight gradient), the TMA
    row kernel's (``tma``, a 1x1 forward or input gradient without padding), the halo's (``halo``: a
    forward tile, and a depthwise conv's weight-gradient tile, wider than 1x1; a call the halo does not
    take is skipped), then every weight-gradient variant again at each of ``per_sm``'s
    programs per SM."""
    from fusion_backend.kernels.conv.tiles import box_width, halo_box_width, several_taps

    cin_g = shape.w_shape[1]
    variants = [tile]
    if box and not tile.flat_k and pass_name != "fprop":
        spatial = (shape.x_shape if pass_name == "dgrad" else shape.out_shape)[2:]
        plane = (1, *spatial)[-2:]  # a 1d conv's one row
        variants.append(dataclasses.replace(tile, box_w=box_width(*plane, tile.block_m)))
    n_taps = math.prod(shape.w_shape[2:])
    if taps and pass_name == "wgrad" and not tile.flat_k and cin_g > 1 and n_taps > 1:
        per = several_taps(n_taps)
        if per > 1:
            variants.append(dataclasses.replace(tile, taps_per_program=per))
    if (tma and pass_name in ("fprop", "dgrad") and not tile.flat_k and tile.block_m >= 64
            and tile.num_warps in (4, 8) and n_taps == 1 and not any(shape.padding)):  # fmt: skip
        variants.append(dataclasses.replace(tile, tma=True))
    if halo and not tile.flat_k and n_taps > 1:
        halos = [dataclasses.replace(v, halo=True) for v in list(variants) if not v.box_w and not v.tma
                 and (pass_name == "fprop" or (pass_name == "wgrad" and cin_g == 1))]  # fmt: skip
        if box and pass_name == "fprop" and cin_g > 1:  # the halo's box tiles too (``tiles.halo_box_width``)
            plane, kernel, dilation = ((1, *dims)[-2:] for dims in (shape.out_shape[2:], shape.w_shape[2:],
                                                                    shape.dilation))  # fmt: skip
            halos += [dataclasses.replace(v, box_w=halo_box_width(plane, v.block_m, kernel, dilation)) for v in halos]
        variants += halos
    if pass_name == "wgrad":
        variants += [dataclasses.replace(v, programs_per_sm=n) for n in per_sm for v in list(variants)
                     if n != v.programs_per_sm]  # fmt: skip
    return variants


def tma_wgrad_variants(shape: Any, hooked: bool, per_sm: tuple[int, ...]) -> list[Any]:
    """The TMA weight gradient's tiles the timed choice weighs on ``shape`` (``tiles.tma_wgrad_tiles``, stride
    1 and one group only), and each at ``per_sm``'s programs per SM besides."""
    from fusion_backend.kernels.conv.tiles import tma_wgrad_tiles
    from fusion_backend.kernels.conv.tma_wgrad import clippable_for_shapes

    if any(s != 1 for s in shape.stride) or shape.groups != 1:
        return []
    taps = math.prod(shape.w_shape[2:])
    plane = tuple((1, *shape.out_shape[2:])[-2:])  # the output's last two dims (a 1d conv's one row)
    clippable = clippable_for_shapes(shape.x_shape, shape.w_shape, shape.padding, shape.dilation)
    tiles = tma_wgrad_tiles(shape.x_shape[1], shape.w_shape[0], taps, plane, taps == 1 and not any(shape.padding),
                            hooked, clippable)  # fmt: skip
    return list(dict.fromkeys([*tiles, *(dataclasses.replace(t, programs_per_sm=n) for n in per_sm for t in tiles)]))


def main(argv: list[str] | None = None) -> int:
    from fusion_backend.impl_choice import gpu_ms_per_call
    from fusion_backend.kernels.conv import TileConfig
    from fusion_backend.kernels.plan_cache import ContractError

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=[str(m) for m in DEFAULT_MODELS])
    parser.add_argument("--passes", default="fprop,dgrad,wgrad")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--max-shapes", type=int, default=8)
    parser.add_argument("--filter", default=None,
                        help="comma-separated patterns on shape labels and model names (bench_conv.py's)")
    parser.add_argument("--budget-s", type=float, default=math.inf, help="stop starting rows after this long")
    parser.add_argument("--set-size", type=int, default=3)
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--box", action="store_true",
                        help="also time each gradient tile loading boxes (with --halo the halo forward's box tiles too)")
    parser.add_argument("--taps", action="store_true",
                        help="also time each tap-major weight-gradient tile with 3 (or 2) taps per program")
    parser.add_argument("--tma", action="store_true",
                        help="also time each 1x1 forward tile as the Gluon TMA forward's, and the TMA weight "
                             "gradient's tiles (tiles.tma_wgrad_tiles)")
    parser.add_argument("--halo", action="store_true",
                        help="also time each forward tile, and each depthwise weight-gradient tile, with the "
                             "halo (kernels/conv/halo.py; 'same' stride-1 convs wider than 1x1)")
    parser.add_argument("--per-sm", type=_per_sm, default=(),
                        help="comma-separated programs per SM (1-4): also time each weight-gradient tile with "
                             "its split aiming at these (TileConfig.programs_per_sm)")
    parser.add_argument("--hooked", action="store_true",
                        help="time the passes with their hooks, against cuDNN plus the passes they replace")
    parser.add_argument("--fprop-hooks", choices=tuple(FPROP_HOOKS), default="bn-relu-stats",
                        help="what the forward's hooked step fuses (bench_conv.py's option)")
    parser.add_argument("--grid", type=_grid, default=GRID,
                        help="comma-separated tiles 'MxNxK wW sS' to time instead of the built-in grid")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_conv_tiles: needs CUDA")
        return 2
    began, dtype = time.time(), DTYPES[args.dtype]
    shapes = sorted(select(collect(args.models, "cuda"), args.filter, None, None), key=lambda s: -s.macs)
    shapes = shapes[: args.max_shapes]
    rows = []
    for shape, pass_name in itertools.product(shapes, args.passes.split(",")):
        if time.time() - began > args.budget_s:
            break
        t = _Inputs.make(shape, dtype, torch.device("cuda"))
        cin_g, cout_g = shape.w_shape[1], shape.w_shape[0] // shape.groups
        n_extent, k_extent = (cin_g, cout_g) if pass_name == "dgrad" else (cout_g, cin_g)
        base = BASELINES[args.hooked]
        times = {base: gpu_ms_per_call(_baseline(t, pass_name, args.hooked, args.fprop_hooks)),
                 "tuned": gpu_ms_per_call(_steps(t, pass_name, None, args.hooked, args.fprop_hooks))}  # fmt: skip
        for bm, bn, bk, warps, stages in args.grid:
            if bn > 2 * max(16, 1 << (n_extent - 1).bit_length()) or bk > max(16, k_extent):
                continue
            variants = tile_variants(TileConfig(bm, bn, bk, warps, stages, flat_k=cin_g < 16), shape, pass_name,
                                     args.box, args.taps, args.tma, args.per_sm, args.halo)  # fmt: skip
            if pass_name == "wgrad" and args.tma and (bm, bn, bk, warps, stages) == args.grid[0]:  # once per row
                variants += tma_wgrad_variants(shape, args.hooked, args.per_sm)
            for variant in variants:
                try:
                    times[variant.label()] = gpu_ms_per_call(_steps(t, pass_name, variant, args.hooked,
                                                                    args.fprop_hooks))  # fmt: skip
                except ContractError:  # a box the call refuses: the choice would run the gather
                    if variant.tma or variant.halo:
                        continue
                    if variants[0].label() in times:
                        times[variant.label()] = times[variants[0].label()]
                except Exception as exc:  # noqa: BLE001 - a tile that does not fit is reported, not fatal
                    print(f"  {variant.label()}: {type(exc).__name__}")
        best = min((k for k in times if k != base), key=times.get)
        rows.append({"shape": shape.label(), "pass": pass_name, "ms": times})
        print(f"{pass_name} {shape.label():48s} {base} {times[base]:.4f}  tuned {times['tuned']:.4f} "
              f"({times[base] / times['tuned']:.2f}x)  best {best} {times[best]:.4f}", flush=True)  # fmt: skip
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=1))
    for pass_name in args.passes.split(","):
        mine = [r["ms"] for r in rows if r["pass"] == pass_name]
        tiles = set.intersection(*(set(m) - {*BASELINES, "tuned"} for m in mine)) if mine else set()
        if not tiles:
            continue

        for tile in sorted(tiles, key=lambda k: -_score(mine, (k,))):
            print(f"{pass_name} {tile:22s} {_score(mine, (tile,)):.2f} of the best on average")
        sets = sorted(itertools.combinations(sorted(tiles), min(args.set_size, len(tiles))),
                      key=lambda chosen: _score(mine, chosen), reverse=True)  # fmt: skip
        print(f"{pass_name} best set of {args.set_size}: {', '.join(sets[0])} ({_score(mine, sets[0]):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
