"""Growing a pointwise chain over canonical ops, shared by the families that fuse one.

A chain starts at a value (a conv output, or a reduction's result) and grows one user at a time;
``ChainValues`` records what it has computed so that a later step may read an earlier value again
(a DAG chain: ``y + torch.tanh(y)``) and where the chain may end (every value but its last read only
inside the region).  ``pointwise_step`` turns one canonical ``Pointwise`` op into a ``ChainStep``
(or a ``NearMiss`` saying why it cannot join).

The region object a ``ChainValues`` works on is duck-typed: it has the lists ``steps``
(``ChainStep``s), ``step_nodes`` (the graph nodes after the start, one per op), ``operands`` (the fused
op's tensor operands) and ``labels`` (one per step node, for the summary); ``ChainPart`` is the plain
one.  ``grow_chain`` is the loop that grows every chain of a conv walk (``match/conv_walk.py``:
before a centre, after it, or the whole chain of a walk with none).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.fx as fx

from ..frontend.canonical import ParamRef, Pointwise
from ..ops.chain import MAX_CHAIN_LENGTH, ChainStep, ChainValue, PointwiseKind, TensorRef
from ..report import NearMiss, ReasonKind
from .engine import MatchContext, fake_of


class ChainValues:
    """What a growing chain, started at ``anchor``, has computed, so that it may read a value again (a DAG epilogue:
    ``y * torch.sigmoid(2 * y)``, ``y + torch.tanh(y)``).

    * ``position[node]``: the step whose input the region node is (``ChainValue(position)``);
    * ``downstream``: every node computed from the conv output; one of them outside the chain cannot be
      an operand (the fused op would read its own result);
    * the prefixes the region could end at, as the lengths of its ``steps``, ``step_nodes`` and
      ``operands`` there: a region may end at a node only if no node before it is read outside the
      region (``longest_closed_prefix``).
    """

    def __init__(self, anchor: fx.Node) -> None:
        self.anchor = anchor
        self.position: dict[fx.Node, int] = {anchor: 0}
        self.downstream = computed_from(anchor)
        self._prefixes: list[tuple[int, int, int]] = []

    def prefix_ends_at(self, region: Any) -> None:
        """Record that ``region``, as it is now, could end at its last node."""
        self._prefixes.append((len(region.steps), len(region.step_nodes), len(region.operands)))

    def computed(self, node: fx.Node, steps: int) -> fx.Node:
        """Record ``node`` as the chain's value after its first ``steps`` steps; returns it."""
        self.position[node] = steps
        return node

    def label(self, step: ChainStep) -> str:
        """The step's kind, with the earlier value it reads again: ``add(conv2d)``."""
        reads = [o for o in step.operands if isinstance(o, ChainValue)]
        if not reads:
            return step.kind.name.lower()
        node = next(n for n, p in self.position.items() if p == reads[0].position)
        return f"{step.kind.name.lower()}({node.name})"

    def operand(self, value: Any, kind: PointwiseKind, index: int) -> Union[ChainValue, str, None]:
        """``ChainValue`` for a value the chain holds, a reason for one computed from the conv output
        outside the chain, None for anything else (an outside operand)."""
        if not isinstance(value, fx.Node) or (value not in self.position and value not in self.downstream):
            return None
        if value not in self.position:
            return f"operand `{value.name}` is computed from the conv output outside the chain"
        if index not in kind.differentiable_operands:
            return f"{kind.name.lower()} cannot read the chain's own value `{value.name}` as operand {index}"
        return ChainValue(self.position[value])

    def next_user(self, ctx: MatchContext, current: fx.Node, fusible: tuple[type, ...]) -> tuple[Optional[fx.Node], str]:
        """The op the chain continues with: ``current``'s only user, or of several users the only
        ``fusible`` one (by canonical op type) whose other inputs the chain holds (the others must
        join later); else ``(None, why)``."""
        user, why = ctx.sole_user(current)
        if user is not None:
            return user, ""
        ready = [u for u in current.users if u.op != "output" and isinstance(ctx.op(u), fusible)
                 and all(n in self.position or n not in self.downstream for n in u.all_input_nodes)]
        if len(ready) == 1:
            return ready[0], ""
        return None, why + (" (the chain would branch)" if len(ready) > 1 else "")

    def closed(self, region: Any, result: fx.Node, step_nodes: Optional[int] = None) -> bool:
        """Whether the conv, the first ``step_nodes`` of ``region``'s step nodes (all by default) and
        ``result`` form a region whose only value read outside is ``result``."""
        inside = {self.anchor, *region.step_nodes[:step_nodes], result}
        return all(u in inside for n in inside if n is not result for u in n.users)

    def longest_closed_prefix(self, region: Any, max_steps: Optional[int] = None) -> tuple[fx.Node, Optional[fx.Node]]:
        """Cut ``region`` (no pool) back to its longest prefix that is ``closed`` (and holds at most
        ``max_steps`` steps where given): ``(its result, the first node of the whole region read
        outside it)`` (None when the whole chain was closed)."""
        held = [self.anchor, *region.step_nodes]
        read_outside = next((n for n in held[:-1] if any(u not in held for u in n.users)), None)
        for steps, step_nodes, operands in reversed(self._prefixes):
            if max_steps is not None and steps > max_steps:
                continue
            result = held[step_nodes]
            if self.closed(region, result, step_nodes):
                del region.steps[steps:], region.step_nodes[step_nodes:], region.operands[operands:]
                del region.labels[step_nodes:]  # one label per step node
                return result, read_outside
        raise AssertionError("the conv output alone is always a closed region")

    @staticmethod
    def outside_users(node: fx.Node) -> str:
        return f"`{node.name}` is read again outside the chain (by " + ", ".join(
            "the graph output" if u.op == "output" else f"`{u.name}`" for u in node.users) + ")"


def computed_from(anchor: fx.Node) -> set[fx.Node]:
    """Every node computed (directly or not) from ``anchor``'s value."""
    seen: set[fx.Node] = set()
    todo = list(anchor.users)
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(node.users)
    return seen


def pointwise_step(
    ctx: MatchContext, pattern: str, anchor: fx.Node, op: Pointwise, flowing: fx.Node, operands: list[Any],
    y: Any, chain: ChainValues, dtypes: Sequence[torch.dtype], scalar_operands: bool = False,
    residual: bool = False,
) -> Union[ChainStep, NearMiss]:  # fmt: skip
    """``op`` as the chain's next step, reading the chain's value ``flowing``, or the near miss (of
    ``pattern``, anchored at ``anchor``) saying why it cannot be.

    ``operands``: the region's tensor operands so far; a new one is appended only when the step is
    accepted.  ``y``: the fake value whose dim 1 is "the channels" a per-channel operand must match
    (``MatchContext.classify_operand``).  ``dtypes``: the result dtypes a fused step may have.
    ``scalar_operands``: accept only numbers and one-element tensors (a chain after a reduction over
    the channels has no channel dim).  ``residual``: an ``add`` may also read one tensor of the flowing
    value's full shape and dtype, computed outside the region (a residual branch; at most one per
    region, ``full_size_operand``).
    """
    seen = op.with_flowing(flowing)
    if isinstance(seen, str):
        return ctx.near_miss(pattern, anchor, op.node, ReasonKind.UNSUPPORTED_OPERAND, seen)
    kind, values = seen
    out = fake_of(op.node)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(fake_of(flowing).shape):
        return ctx.near_miss(pattern, anchor, op.node, ReasonKind.UNSUPPORTED_OPERAND,
                             f"`{op.node.name}` changes the shape (an operand broadcasts the result)")
    if out.dtype not in dtypes:
        return ctx.near_miss(pattern, anchor, op.node, ReasonKind.UNSUPPORTED_DTYPE, f"`{op.node.name}` yields {out.dtype}")
    found = []
    trial = list(operands)
    for i, value in enumerate(values):
        got = chain.operand(value, kind, i)
        if got is None and scalar_operands and isinstance(value, fx.Node):
            fake = fake_of(value)
            if isinstance(fake, torch.Tensor) and fake.numel() != 1:
                got = (f"operand `{value.name}` has shape {list(fake.shape)}; after a reduction over the channels "
                       "only numbers and one-element tensors fuse")
        if got is None:
            got = ctx.classify_operand(value, y, trial)
            if isinstance(got, str) and residual and kind is PointwiseKind.ADD and _full_size(value, out):
                if full_size_operand(ctx, trial, y) is not None:
                    got = "the region reads one full-size operand (a residual) already"
                else:
                    got = TensorRef(operand_index(value, trial))
        if isinstance(got, str):
            return ctx.near_miss(pattern, anchor, op.node, ReasonKind.UNSUPPORTED_OPERAND, got)
        found.append(got)
    for i, got in enumerate(found):
        if isinstance(got, TensorRef) and i not in kind.differentiable_operands:
            fake = fake_of(trial[got.index])
            if getattr(fake, "requires_grad", False):
                return ctx.near_miss(pattern, anchor, op.node, ReasonKind.UNSUPPORTED_OPERAND,
                                     f"the {kind.name.lower()} parameter `{trial[got.index].name}` requires grad; only arithmetic operands and the bound of clamp_min / clamp_max get gradients")
    operands[:] = trial
    return ChainStep(kind, tuple(found))


def _full_size(value: Any, like: torch.Tensor) -> bool:
    fake = fake_of(value) if isinstance(value, fx.Node) else None
    return (isinstance(fake, torch.Tensor) and tuple(fake.shape) == tuple(like.shape) and fake.dtype == like.dtype
            and like.numel() > 0)


def full_size_operand(ctx: MatchContext, operands: Sequence[Any], y: Any) -> Optional[int]:
    """The index of the region's full-size operand (its residual), if it has one: the operand (graph
    nodes) the generic classifier refuses (``MatchContext.classify_operand``; ``y`` as there).  A
    tensor of the output's shape that is also one value per channel (an output of one position) is
    read as per-channel: the same values either way."""
    for i, node in enumerate(operands):
        fake = fake_of(node) if isinstance(node, fx.Node) else None  # (folded operands are made later)
        if (isinstance(fake, torch.Tensor) and tuple(fake.shape) == tuple(y.shape)
                and isinstance(ctx.classify_operand(node, y, []), str)):
            return i
    return None


def per_channel_problem(value: Any, channels: int) -> Optional[str]:
    """Why a normalization's weight, bias or statistic ``value`` cannot be read as one floating-point
    value per conv output channel, or None (``None`` and parameters of the module are fine)."""
    if value is None or isinstance(value, ParamRef):
        return None
    if not isinstance(value, fx.Node):
        return f"{value!r} is not a tensor"
    fake = fake_of(value)
    if not isinstance(fake, torch.Tensor) or tuple(fake.shape) != (channels,):
        shape = list(fake.shape) if isinstance(fake, torch.Tensor) else "unknown"
        return f"`{value.name}` has shape {shape}, not one value per conv output channel ({channels})"
    if not fake.is_floating_point():
        return f"`{value.name}` is {fake.dtype}, not floating point"
    return None


def operand_index(value: Any, operands: list[Any]) -> Optional[int]:
    """``value``'s index among a region's operands (appended when new), None for no value."""
    if value is None:
        return None
    if value not in operands:
        operands.append(value)
    return operands.index(value)


@dataclass
class ChainPart:
    """One chain of a region (before or after its norm or reduction), in the layout ``ChainValues``
    works on; ``operands`` may be shared by a region's two chains."""

    operands: list[Any]
    steps: list[ChainStep] = field(default_factory=list)
    step_nodes: list[fx.Node] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)


@dataclass
class ChainEnd:
    """Where ``grow_chain`` stopped: ``last`` the chain's value there; ``user`` the op that did not
    join (None where ``last`` has no single next op, ``why`` then says why); ``miss`` the near miss
    of a pointwise op that could not join (too long a chain, an operand, a dtype), else None."""

    last: fx.Node
    user: Optional[fx.Node]
    why: str = ""
    miss: Optional[NearMiss] = None


def grow_chain(
    ctx: MatchContext, pattern: str, anchor: fx.Node, start: fx.Node, part: ChainPart, values: ChainValues,
    y: Any, dtypes: Sequence[torch.dtype], fusible: tuple[type, ...], where: str, scalar_operands: bool = False,
    residual: bool = False,
) -> ChainEnd:  # fmt: skip
    """Grow ``part`` with the pointwise ops that follow ``start`` (one user at a time,
    ``ChainValues.next_user`` with ``fusible`` as there) until the first op that is not pointwise,
    an op another region claimed already (a ``CLAIMED`` near miss), ``MAX_CHAIN_LENGTH`` steps, or a
    step ``pointwise_step`` refuses (``y``, ``dtypes`` and
    ``scalar_operands`` and ``residual`` as there); near misses are of ``pattern``, anchored at ``anchor``.

    The one loop every chain of a conv walk grows by (``match/conv_walk.py``): before a centre,
    after it, and the whole chain of a walk with none; the caller decides what the end means.
    Before each step it records the prefix the region could end at (``ChainValues.prefix_ends_at``).
    ``where`` names the chain in the length near miss ("the chain after the batch norm").
    """
    current = start
    while True:
        values.prefix_ends_at(part)
        user, why = values.next_user(ctx, current, fusible=fusible)
        if user is None:
            return ChainEnd(current, None, why)
        op = ctx.op(user)
        if not isinstance(op, Pointwise):
            return ChainEnd(current, user)
        if user in ctx.claimed:  # a residual add another conv's region took (the two convs' outputs meet there)
            return ChainEnd(current, user, miss=ctx.near_miss(pattern, anchor, user, ReasonKind.CLAIMED,
                                                              f"`{user.name}` is already part of another fused region"))
        if len(part.steps) == MAX_CHAIN_LENGTH:
            return ChainEnd(current, user, miss=ctx.near_miss(pattern, anchor, user, ReasonKind.CHAIN_TOO_LONG,
                                                              f"{where} holds at most {MAX_CHAIN_LENGTH} ops"))
        step = pointwise_step(ctx, pattern, anchor, op, current, part.operands, y, values, dtypes,
                              scalar_operands=scalar_operands, residual=residual)  # fmt: skip
        if isinstance(step, NearMiss):
            return ChainEnd(current, user, miss=step)
        part.steps.append(step)
        part.step_nodes.append(user)
        part.labels.append(values.label(step))
        current = values.computed(user, len(part.steps))
