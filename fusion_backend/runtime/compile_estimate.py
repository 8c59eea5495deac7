"""Inductor's compile time of a graph, estimated before it compiles.

Two decisions need it before the compile they are about:

- under CUDA graphs a graph's regions are decided during its compile, within a budget that is a
  multiple of Inductor's compile of the graph (option ``decide_budget``); compiling the graph as
  given only to learn that time would compile it twice wherever a region is kept;
- a deferred graph's settle compiles the graph again with the regions it keeps only where that
  compile fits what is left of its decision budget (``backend._settle``).

The estimate: Inductor's seconds per node of the latest graph as given (nothing rewritten) of at least
``RATE_MIN_NODES`` operations this machine compiled past Inductor's caches, of the same kind (training
or inference, with or without CUDA graphs), times this graph's nodes.  The rate is kept in the measurement cache (``measurements.py``), so a later process starts
with it.  A compile served by Inductor's caches is not a rate (``served_by_caches``).  Where no
graph of its kind was compiled yet, ``estimate`` is zero (a deferred settle then compiles nothing
it cannot afford), and ``expected`` falls back on a prior rate (``PRIOR_SECONDS_PER_NODE``): the
budget under CUDA graphs, spent before the graph's first compile on the machine, needs a number.
"""

from __future__ import annotations

from pathlib import Path

import torch.fx as fx

from .. import measurements

KIND = "inductor_compile"


def graph_size(gm: fx.GraphModule) -> int:
    """The number of operations in ``gm`` (its call nodes), the unit the rate is kept in."""
    return sum(1 for node in gm.graph.nodes if node.op.startswith("call_"))


def inductor_cache_counts() -> tuple[int, int]:
    """Inductor's graph-cache lookups so far in this process: (hits, compiles), where an AOTAutograd
    cache hit counts as a hit and a graph compiled past the cache (a miss or a bypass) as a compile;
    read before and after a compile for :func:`served_by_caches`."""
    try:
        from torch._dynamo.utils import counters

        inductor = counters["inductor"]
        hits = inductor["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
        return int(hits), int(inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_bypass"])
    except Exception:  # private API drift: the reading is a nicety
        return 0, 0


def served_by_caches(before: tuple[int, int], after: tuple[int, int]) -> bool:
    """Whether the compile between two ``inductor_cache_counts`` readings came from Inductor's
    caches: some lookups hit and none compiled.  (A compile with the caches off counts neither.)"""
    return after[0] > before[0] and after[1] == before[1]


def _key(training: bool, cuda_graphs: bool) -> str:
    return measurements.key(KIND, {"training": training, "cuda_graphs": cuda_graphs})


# NOTE: a small graph's compile is mostly what any compile costs, not its nodes: under CUDA graphs
# Inductor's first call of the seeds' graphs of a few operations took 1.1-2.9 s (0.3-0.7 s per node; H100,
# ``docs/perf/h100/cudagraphs``), ResNet-50's of 175 operations 13.6-14.4 s (0.08 s per node; H200,
# ``docs/perf/h200/realnets/cudagraphs-first-process``): a rate taken from a small graph made a large
# one's estimate, and the budget under CUDA graphs three times it, several times too large.
#: The fewest operations of a graph whose compile is kept as a rate.
RATE_MIN_NODES = 50


def record(size: int, seconds: float, *, training: bool, cuda_graphs: bool, cache_dir: Path) -> None:
    """Keep Inductor's compile of a graph of ``size`` nodes (``seconds``) as the rate of its kind, where
    the graph has at least ``RATE_MIN_NODES`` of them."""
    if size >= RATE_MIN_NODES and seconds > 0:
        measurements.store(_key(training, cuda_graphs), {"kind": KIND, "seconds_per_node": seconds / size,
                                                         "nodes": size, "seconds": seconds}, cache_dir)


# NOTE: compiling the graph as given for the budget doubled a ResNet-50 training graph's compile under
# CUDA graphs (H200, bf16, batch 64, cold caches: 28.8 s for the graph as given, then 20.7 s for the
# rewritten one; ``python3 tools/first_call.py demos/realnets/resnet50.py --backends fusion --mode train
# --dtype bf16 --compile-mode reduce-overhead --log``).
def estimate(size: int, *, training: bool, cuda_graphs: bool, cache_dir: Path) -> float:
    """Seconds Inductor is expected to take compiling a graph of ``size`` nodes: 0.0 where no graph of
    its kind was timed."""
    entry = measurements.lookup(_key(training, cuda_graphs), cache_dir,
                                lambda e: e.get("kind") == KIND and isinstance(e.get("seconds_per_node"), float))
    return 0.0 if entry is None else entry["seconds_per_node"] * size


# NOTE: Inductor's compile of ResNet-50 under CUDA graphs (bf16, batch 64, fresh caches) took 11.5 s for
# the inference graph and 36.6 s for the training graph, 175 operations each, on an H200's host
# (``python -m fusion_backend bench --suite demos/realnets/resnet50.py --dtype bf16 --mode infer,train
# --backends inductor --compile-mode reduce-overhead``).  A slower host compiles slower: the prior's
# budget is then a smaller multiple of its compile, never a larger one.
#: Seconds per node of Inductor's compile where this machine timed none yet: (inference, training).
PRIOR_SECONDS_PER_NODE = (0.065, 0.2)


def expected(size: int, *, training: bool, cuda_graphs: bool, cache_dir: Path) -> float:
    """``estimate``, or where it is not known, ``size`` times the prior rate of its kind."""
    return (estimate(size, training=training, cuda_graphs=cuda_graphs, cache_dir=cache_dir)
            or PRIOR_SECONDS_PER_NODE[training] * size)
