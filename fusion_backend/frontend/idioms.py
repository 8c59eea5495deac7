"""Multi-node spellings of one pointwise op, folded into that op's node before matching.

Older models spell some activations out, reading the flowing tensor twice:

* SiLU / Swish: ``y * torch.sigmoid(y)`` (either operand order, any spelling of ``mul`` and of
  ``sigmoid``) becomes ``F.silu(y)``;
* Mish (YOLOv4-era code): ``y * torch.tanh(F.softplus(y))`` (softplus with its defaults, ``beta=1``,
  ``threshold=20``) becomes ``F.mish(y)``;
* leaky ReLU: ``torch.where(y > 0, y, a * y)`` or ``y.where(y > 0, a * y)`` (``0 < y`` too; ``a * y`` or
  ``y * a``, ``a`` a Python number) becomes ``F.leaky_relu(y, a)``.

Left as they are, ``y`` has two users and the chain stops there (a shared intermediate).  Folded,
the chain runs through them.  Each fold is exact in value and in gradient, including at the
boundaries: ``where(y > 0, ...)`` sends the gradient at ``y == 0`` to the ``a * y`` branch, as
``leaky_relu``'s backward does (``y >= 0`` would not, and is left alone), and NaN propagates the
same way.  A fold needs the intermediate nodes (the ``sigmoid``; the comparison and the product) to
have no other user, and ``y`` to be a conv's, a pointwise op's or a norm's result: a fresh tensor
inside a chain, never a graph input.

Contract of :func:`fold_idioms`: rewrites ``gm``'s graph in place (new node before the last node of
the idiom, uses moved to it, the idiom's nodes erased) and returns how many idioms it folded; the
caller re-normalises when that is not 0.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..ops.chain import PointwiseKind as K
from .canonical import BatchNorm, CanonicalOp, Conv, GroupNorm, LayerNorm, Pointwise

_SOFTPLUS = {F.softplus}
_GREATER = {operator.gt, torch.gt, "gt"}
_LESS = {operator.lt, torch.lt, "lt"}
_WHERE = {torch.where, "where"}


def fold_idioms(gm: fx.GraphModule, canonical: dict[fx.Node, CanonicalOp]) -> int:
    """Fold every SiLU, Mish and leaky-ReLU idiom of ``gm`` (see the module docstring); the count."""
    folded = 0
    for node in list(gm.graph.nodes):
        if node.graph is not gm.graph:  # erased by an earlier fold
            continue
        op = canonical.get(node)
        if isinstance(op, Pointwise) and op.kind is K.MUL and not op.inplace:
            folded += _fold_product(gm, node, op, canonical)
        elif _target_in(node, _WHERE):
            folded += _fold_leaky_relu(gm, node, canonical)
    if folded:
        gm.graph.lint()
        gm.recompile()
    return folded


def _target_in(node: fx.Node, targets: set[Any]) -> bool:
    if node.op == "call_function":
        return node.target in targets
    return node.op == "call_method" and node.target in targets


def _fresh(value: Any, canonical: dict[fx.Node, CanonicalOp]) -> bool:
    """A conv's, a pointwise op's or a norm's result (not a graph input, not a view of one)."""
    return isinstance(value, fx.Node) and isinstance(canonical.get(value), (Conv, Pointwise, BatchNorm, GroupNorm,
                                                                            LayerNorm))


def _only_user(node: fx.Node, user: fx.Node) -> bool:
    return set(node.users) == {user}


def _replace(gm: fx.GraphModule, old: fx.Node, target: Any, args: tuple, dead: list[fx.Node]) -> None:
    with gm.graph.inserting_before(old):
        new = gm.graph.call_function(target, args)
    # the value (Dynamo's "example_value", a fake tensor) and the source position stay; what named
    # the old node's function does not
    new.meta.update({k: v for k, v in old.meta.items() if k not in ("source_fn_stack", "torch_fn", "original_aten")})
    old.replace_all_uses_with(new)
    for node in (old, *dead):
        gm.graph.erase_node(node)


def _fold_product(gm: fx.GraphModule, mul: fx.Node, op: Pointwise, canonical: dict[fx.Node, CanonicalOp]) -> int:
    """``y * sigmoid(y)`` -> ``silu(y)``; ``y * tanh(softplus(y))`` -> ``mish(y)`` (either operand order)."""
    if len(op.args) != 2:
        return 0
    for y, s in (op.args, op.args[::-1]):
        act = canonical.get(s) if isinstance(s, fx.Node) else None
        if not (isinstance(act, Pointwise) and not act.inplace and act.args and _fresh(y, canonical)
                and _only_user(s, mul)):  # fmt: skip
            continue
        if act.kind is K.SIGMOID and act.args[0] is y:
            _replace(gm, mul, F.silu, (y,), [s])
            return 1
        sp = act.args[0]
        if act.kind is K.TANH and isinstance(sp, fx.Node) and _is_default_softplus_of(sp, y) and _only_user(sp, s):
            _replace(gm, mul, F.mish, (y,), [s, sp])
            return 1
    return 0


def _is_default_softplus_of(node: fx.Node, y: fx.Node) -> bool:
    if not (_target_in(node, _SOFTPLUS) and _arg(node, 0, "input") is y):
        return False
    beta, threshold = _arg(node, 1, "beta"), _arg(node, 2, "threshold")
    return beta in (None, 1) and threshold in (None, 20) and not isinstance(beta, bool)


def _arg(node: fx.Node, index: int, name: str) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def _fold_leaky_relu(gm: fx.GraphModule, where: fx.Node, canonical: dict[fx.Node, CanonicalOp]) -> int:
    if where.op == "call_method":  # y.where(condition, other): the tensor comes first
        y, cond, other = (_arg(where, i, n) for i, n in enumerate(("self", "condition", "other")))
    else:
        cond, y, other = (_arg(where, i, n) for i, n in enumerate(("condition", "input", "other")))
    if not (isinstance(cond, fx.Node) and isinstance(other, fx.Node) and _fresh(y, canonical)):
        return 0
    lhs, rhs = _arg(cond, 0, "input"), _arg(cond, 1, "other")
    positive = (_target_in(cond, _GREATER) and lhs is y and rhs == 0 and not isinstance(rhs, bool)) or (
        _target_in(cond, _LESS) and rhs is y and lhs == 0 and not isinstance(lhs, bool))  # fmt: skip
    scaled = canonical.get(other)
    if not (positive and isinstance(scaled, Pointwise) and scaled.kind is K.MUL and not scaled.inplace
            and len(scaled.args) == 2):  # fmt: skip
        return 0
    slopes = [a for a in scaled.args if a is not y]
    if len(slopes) != 1 or y not in scaled.args or not isinstance(slopes[0], (int, float)) or isinstance(slopes[0], bool):
        return 0
    if not (_only_user(cond, where) and _only_user(other, where)):
        return 0
    _replace(gm, where, F.leaky_relu, (y, float(slopes[0])), [cond, other])
    return 1
