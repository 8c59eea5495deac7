"""Run a rewritten graph that holds only fused ops and glue as plain FX code, without a compiler.

WHY: AOTAutograd and Inductor earn their host time by fusing what is left around our fused ops.  When
nothing is left (the ConvTranspose3d -> leaky -> x m -> leaky -> MaxPool3d pipeline: the whole graph
is one ``conv_epilogue`` call, which absorbs the dtype casts of autocast) they fuse nothing, yet each
step still pays their runtime wrappers, which matters where such a step is host-bound (measured:
``ops/direct_impls.py``).  Such a graph is run as its own
``GraphModule.forward`` with every fused call retargeted to its direct implementation, an
``autograd.Function`` that calls the kernels with no dispatcher layers.  Eager autograd then records
the backward, exactly as for a module the user wrote by hand.

Which graphs qualify (``why_not_direct`` returns ``None``): every node is a placeholder, a
``get_attr``, the output, a call of a fused op that has a direct implementation, or *glue*: ops that launch at
most one copy kernel and that Inductor could not do better (``.to``/``.type_as`` casts, views,
``getitem``).  Anything else (an add, a softmax...) is Inductor's to fuse, so the graph goes to
Inductor whole.  Running a graph eagerly is always correct, so this list is about speed only.

Contract of :func:`direct_module`: a new ``GraphModule`` computing what ``gm`` computes (same
placeholders, same outputs) whose fused calls go to their direct implementations; ``gm`` itself is unchanged.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..frontend.normalize import AUTOCAST_MARKERS
from ..ops import bn_fold, upsample_fold
from ..ops.batched_cast import CAST_BATCHED
from ..ops.direct_impls import direct_impl

#: ``call_method`` targets that are glue (casts and views: at most one copy kernel each).
GLUE_METHODS = frozenset({
    "to", "type_as", "float", "half", "bfloat16", "double", "contiguous",
    "view", "reshape", "unsqueeze", "squeeze", "flatten", "expand", "permute", "transpose",
})
#: ``call_function`` targets that are glue.  Dynamo records an autocast region inside the compiled
#: code as ``_enter_autocast``/``_exit_autocast`` calls (no kernels, the casts are separate nodes).
#: Batch norm's folded scale and shift (``ops/bn_fold.py``) count as glue too: one small kernel on
#: per-channel tensors (its direct implementation; batched, one for the graph's batch norms:
#: ``match/batch_glue.py``), never on activations; the region's measured decision times it with it.  So
#: do the batched casts of the fused calls' weights (``ops/batched_cast.py``): one copy of parameters,
#: and a folded upsample's transposed-conv weight (``ops/upsample_fold.py``): a few small passes over one.
GLUE_FUNCTIONS = frozenset({
    operator.getitem, torch.reshape, torch.unsqueeze, torch.squeeze, torch.flatten, torch.permute,
    torch.transpose, torch.narrow, bn_fold.scale_and_shift, bn_fold.BATCHED, CAST_BATCHED,
    upsample_fold.upsampled_conv_weight,
    *AUTOCAST_MARKERS,
})


def _describe(node: fx.Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return f"{node.name} ({node.op} {target})"


def why_not_direct(gm: fx.GraphModule) -> str | None:
    """``None`` when ``gm`` can run directly (see the module docstring), else the reason, naming the
    first few nodes that are neither fused ops with a direct implementation nor glue."""
    blocking: list[str] = []
    fused = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        if node.op == "call_method" and node.target in GLUE_METHODS:
            continue
        if node.op == "call_function" and node.target in GLUE_FUNCTIONS:
            continue
        if node.op == "call_function" and direct_impl(node.target) is not None:
            fused += 1
            continue
        blocking.append(_describe(node))
    if blocking:
        more = f" and {len(blocking) - 3} more" if len(blocking) > 3 else ""
        return f"the graph holds ops for Inductor besides the fused ops: {', '.join(blocking[:3])}{more}"
    if fused == 0:
        return "the graph holds no fused op"
    return None


def direct_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose fused calls go to their direct implementations (see the module docstring)."""
    import copy

    graph = copy.deepcopy(gm.graph)
    for node in graph.nodes:
        if node.op == "call_function":
            direct = direct_impl(node.target)
            if direct is not None:
                node.target = direct
    module = fx.GraphModule(gm, graph, class_name="FusionDirectGraph")
    module.recompile()
    return module
