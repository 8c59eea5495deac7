"""Batch the rewritten graph's per-region glue into one op per graph: eval BatchNorm scale and shift,
and the casts of the fused convs' weights under autocast.

A conv region that folds an eval batch norm (``ops/bn_fold.py``) calls ``scale_and_shift`` on the
batch norm's statistics, once per region: in a network's inference graph one tiny kernel per conv
(53 in ResNet-50), each a launch of its own, under CUDA graphs too.  Where nothing differentiates
through those statistics, :func:`batch_scale_and_shift` replaces the calls that can share one
(the same ``eps``, the same statistics dtypes, device and presence of gamma and beta) with one call
of ``bn_fold.BATCHED``, whose fp32 results each region reads as a slice (a view: no copy).

Contract: ``gm``'s graph is changed in place (not recompiled: the caller does).  A call is replaced
where it reads graph inputs or attributes alone (placeholders, ``get_attr`` nodes), of at most 32
bits, that no other node reads (which could write them between the calls), and, with grad mode on,
that do not require grad; the others stay as they were.  The batched call and every region's views go
right before the first of the calls it replaces (a ``get_attr`` a later region's rewrite made after
it moves up: it has no inputs).  The values are the calls' own (one kernel over the concatenated
statistics, the same arithmetic).

Likewise a fused call under autocast casts its weight and bias from the parameters' dtype to its
conv's on every call, one copy kernel each; :func:`batch_casts` casts those that can share a launch
(the same device, source and target dtypes) with one ``batched_cast.CAST_BATCHED`` call, each fused
call reading its own result, under the same conditions (graph inputs or attributes read by that
call alone, no gradient through them, non-overlapping and dense, static shapes).  The values are
``Tensor.to``'s, which the call would have made.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from typing import Any

import torch
import torch.fx as fx

from ..ir.fakes import fake_of
from ..kernels.host import is_dense
from ..ops import bn_fold
from ..ops.batched_cast import CAST_BATCHED
from ..ops.declare import declared_op


def _tensor_of(gm: fx.GraphModule, node: Any) -> Any:
    """The tensor (real or fake) a statistic's node stands for, or None."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "get_attr":
        value: Any = gm
        for part in str(node.target).split("."):
            value = getattr(value, part, None)
        return value
    return fake_of(node)


def _constant_input(gm: fx.GraphModule, node: Any) -> torch.Tensor | None:
    """The floating tensor (real or fake) of a graph input or attribute node that nothing differentiates
    through (with grad mode on, it does not require grad), else None: what a batched call may read."""
    if not isinstance(node, fx.Node) or node.op not in ("placeholder", "get_attr"):
        return None
    t = _tensor_of(gm, node)
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or (torch.is_grad_enabled() and t.requires_grad):
        return None
    return t


def _hoist(reads: Any, first: fx.Node, order: dict[fx.Node, int]) -> None:
    """Move each of ``reads`` that comes after ``first`` right before it: a ``get_attr`` a later region's
    rewrite made (it has no inputs), which the batched call going before ``first`` reads."""
    for read in reads:
        if order[read] > order[first]:
            first.prepend(read)


def _group_key(gm: fx.GraphModule, call: fx.Node) -> tuple | None:
    """What the calls batched together share, or None where ``call`` stays on its own."""
    *stats, eps, _spatial = call.args
    tensors = [None if s is None else _constant_input(gm, s) for s in stats]
    for node, t in zip(stats, tensors, strict=True):
        if node is None:
            continue
        if t is None or t.dtype == torch.float64:
            return None
        if not isinstance(t.numel(), int) or any(u.target is not bn_fold.scale_and_shift for u in node.users):
            return None  # read by anything else (which could write it between the calls): left where it is
    if any(node is not None and t.numel() != tensors[1].numel() for node, t in zip(stats, tensors, strict=True)):
        return None
    return (float(eps), tensors[1].device, *((None if t is None else t.dtype) for t in tensors))


def batch_scale_and_shift(gm: fx.GraphModule) -> int:
    """Replace the graph's batchable ``scale_and_shift`` calls (module docstring); the number replaced."""
    graph = gm.graph
    groups: dict[tuple, list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if node.op == "call_function" and node.target is bn_fold.scale_and_shift:
            key = _group_key(gm, node)
            if key is not None:
                groups[key].append(node)
    order = {node: i for i, node in enumerate(graph.nodes)}
    replaced = 0
    for key, calls in groups.items():
        if len(calls) < 2:
            continue
        first = min(calls, key=order.__getitem__)
        stats = [[c.args[i] for c in calls] for i in range(4)]
        _hoist({n for column in stats for n in column if n is not None}, first, order)
        with graph.inserting_before(first):
            batched = graph.call_function(bn_fold.BATCHED, (
                stats[0], stats[1], stats[2] if stats[2][0] is not None else [],
                stats[3] if stats[3][0] is not None else [], key[0]))  # fmt: skip
            parts = [graph.call_function(operator.getitem, (batched, i)) for i in (0, 1)]
            offset, views = 0, {}
            for call in calls:
                channels = _tensor_of(gm, call.args[1]).numel()
                per_channel = (-1, *(1,) * call.args[5])
                views[call] = [graph.call_method("view", (graph.call_function(
                    torch.narrow, (part, 0, offset, channels)), per_channel)) for part in parts]  # fmt: skip
                if any(not _is_getitem_of(user, call) for user in call.users):  # the tuple itself is read too
                    call.replace_all_uses_with(graph.call_function(tuple, (views[call],)))
                offset += channels
        for call in calls:  # (after the insertions before ``first``, which goes too)
            for user in list(call.users):
                user.replace_all_uses_with(views[call][user.args[1]])
                graph.erase_node(user)
            graph.erase_node(call)
            replaced += 1
    return replaced


def _is_getitem_of(node: fx.Node, call: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem and node.args[0] is call


def batch_casts(gm: fx.GraphModule) -> int:
    """Cast the weights and biases the graph's fused calls would cast themselves in one batched call per
    group (module docstring); the number of tensors whose cast moved."""
    graph = gm.graph
    groups: dict[tuple, list[tuple[fx.Node, int, fx.Node]]] = defaultdict(list)
    for node in graph.nodes:
        op = declared_op(node.target) if node.op == "call_function" else None
        x = fake_of(node.args[0]) if op is not None and op.d.casts_weight and node.args else None
        if not isinstance(x, torch.Tensor) or len(node.args) < 5 or not isinstance(node.args[4], str):
            continue
        dtype = op.d.compute_dtype(op.d.config.from_json(node.args[4]), x)
        for index in (1, 2):  # the weight and the bias
            key = _cast_key(gm, node.args[index], dtype)
            if key is not None:
                groups[key].append((node, index, node.args[index]))
    order = {node: i for i, node in enumerate(graph.nodes)}
    moved = 0
    for key, entries in groups.items():
        if len(entries) < 2:
            continue
        first = min((call for call, _, _ in entries), key=order.__getitem__)
        sources = [source for _, _, source in entries]
        _hoist(sources, first, order)
        with graph.inserting_before(first):
            batched = graph.call_function(CAST_BATCHED, (sources, key[2]))
            items = [graph.call_function(operator.getitem, (batched, i)) for i in range(len(entries))]
        for (call, index, source), item in zip(entries, items, strict=True):
            fake = fake_of(source)
            if isinstance(fake, torch._subclasses.FakeTensor):
                item.meta["val"] = fake.new_empty_strided(fake.size(), fake.stride(), dtype=key[2])
            call.args = (*call.args[:index], item, *call.args[index + 1:])
            moved += 1
    return moved


def _cast_key(gm: fx.GraphModule, source: Any, dtype: torch.dtype) -> tuple | None:
    """``(device, source dtype, dtype)`` where ``source``'s cast to ``dtype`` may join a batched one
    (module docstring), else None."""
    t = _constant_input(gm, source)
    if t is None or len(source.users) != 1 or t.dtype == dtype or not dtype.is_floating_point:
        return None
    if not all(isinstance(v, int) for v in (*t.shape, *t.stride())) or not is_dense(t):
        return None
    return (t.device, t.dtype, dtype)
