"""The conv walk: conv → pointwise chain → centre → pointwise chain → optional pool, written once.

A family of this shape subclasses ``ConvWalkPattern`` and declares its ``Centre``: the canonical op
type it is built around (a norm, a reduction), the checks that say why one cannot join (a typed
``Refusal``), what the config needs from it (``facts``), whether a pool may end the region, and its
summary label; it writes its ``rewrite`` (the config and the fused op call) and ``claim`` (how the
other families' near misses name an op it takes).  A family with no centre (``conv_epilogue``) is the
chain alone.

The walk from a conv whose output is batched and floating point (``FUSED_DTYPES``):

1. With a centre, the conv is the family's only where an op of the centre's type that the centre
   accepts (``Centre.in_sight``) reads its chain within ``Centre.lookahead`` pointwise steps; every
   other conv is silently not its own, so that a family reports near misses only for the convs it
   could have taken.  Without a centre every conv is its own, and one without metadata, with an
   unbatched output or another dtype is a near miss.
2. The chain before the centre grows from the conv output (``chain_walk.grow_chain``) up to the first
   op of the centre's type; any other stop is the region's near miss.  A centre that takes no chain
   before it (``Centre.chain_before``) is the op in sight itself, and its checks say why it does not
   read the conv output.
3. The centre's checks (``Centre.refusal``); then the centre must read the chain's value and the
   chain before it must be read only inside the region; then the centre's value
   (``Centre.value_nodes``: its node, or for ``torch.min`` its ``[0]``) must have metadata and a
   fused dtype.  ``Centre.facts`` then takes what the config needs (appending the centre's own
   operands, e.g. a norm's weight, after the chain's).
4. The chain after the centre grows from its value and ends quietly at the first op that is not
   pointwise (``Centre.refuse_after`` may name one that ends it with a near miss, e.g. a second
   reduction); where one of its values is read outside, it is cut to its longest prefix that is not.
   ``Centre.region_refusal`` may then refuse the whole region.
5. A max / avg pool may end the region where the centre allows one (``match/pool_end.py``).

Either walk first takes in a nearest upsample that only the conv reads, where the pair folds into a
transposed conv (``input_upsample``, ``ops/upsample_fold.py``): the region's conv is then that
transposed conv on the upsample's input, its weight made from the conv's when the region is
rewritten, and its summary opens ``upsample(2) -> conv2d``.

Without a centre the one chain grows from the conv output through pointwise ops and the ops the
family folds into its chain (``ConvWalkPattern.folds`` / ``fold``), up to a pool that may end it.
There the chain is the region, so where it stopped is reported (unless at the graph output or the
next conv), an op another family claims is named as that family's (``claimed_elsewhere``), and a
pool whose input is read elsewhere quietly ends the region before it (the chain's value is needed
full-size anyway).  A conv with neither a chain nor a
pool after it is a ``NO_EPILOGUE`` near miss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.fx as fx

from ..frontend.canonical import BatchNorm, CanonicalOp, Conv, GroupNorm, Opaque, Pointwise, Pool, Upsample
from ..frontend.normalize import describe_target
from ..ops.chain import ChainStep, Const
from ..ops.chain_lowering import family_activation
from ..ops.upsample_fold import transposed_equivalent, upsample_fold_problem
from ..report import NearMiss, ReasonKind
from .chain_walk import ChainPart, ChainValues, full_size_operand, grow_chain, per_channel_problem
from .engine import (
    Candidate,
    ConvAnchoredPattern,
    MatchContext,
    Precedence,
    fake_of,
    precedence_order,
    registered_patterns,
)
from .pool_end import pool_after, pool_refusal
from .rewrite import Deferred, materialize

#: The conv-output dtypes (and the chain's value dtypes) the fused conv ops take.
FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Refusal:
    """Why a centre (or an op folded into a chain) cannot join: the near miss's typed ``reason``, its
    ``message``, and the node it names (``at``; the centre's own node when None).  A ``reason`` of
    None (``NOT_MATCHED``) is no near miss: the region is not this family's and there is nothing to
    report (torch itself rejects the op, e.g. groups that do not divide the channels)."""

    reason: Optional[ReasonKind]
    message: str = ""
    at: Optional[fx.Node] = None


NOT_MATCHED = Refusal(None)


@dataclass
class CentreSite:
    """What a centre's checks see: the conv, its output's fake value ``y``, the centre's canonical
    ``op``, the chain's value ``flowing`` it should read (the conv output where no chain may come
    before it), and the region's tensor ``operands`` so far (``Centre.facts`` appends the centre's)."""

    ctx: MatchContext
    conv: Conv
    y: torch.Tensor
    op: Any
    flowing: fx.Node
    operands: list[Any]

    @property
    def anchor(self) -> fx.Node:
        return self.conv.node

    @property
    def node(self) -> fx.Node:
        return self.op.node


@dataclass(frozen=True)
class InputGate:
    """``conv(source * gate)``: the elementwise product (``node``) the conv reads as its input, of a
    full-size ``source`` and a ``gate`` of one value per sample and input channel (a squeeze-and-
    excitation gate), which the conv applies as it loads its input (``ConvWalkPattern.input_prologue``)."""

    node: fx.Node
    source: fx.Node
    gate: fx.Node

    @property
    def nodes(self) -> tuple[fx.Node, ...]:
        return (self.node,)

    @property
    def labels(self) -> list[str]:
        return ["mul(gate)"]


@dataclass(frozen=True)
class InputNorm:
    """``conv(act(group_norm(source)))``: a group norm (``norm``, its canonical op) of the full-size
    ``source`` and the optional activation after it (``act``: its node and its chain step), which the
    conv applies as it loads its input (``ConvWalkPattern.input_prologue``)."""

    norm: GroupNorm
    act: Optional[tuple[fx.Node, ChainStep]] = None

    @property
    def source(self) -> fx.Node:
        return self.norm.input

    @property
    def nodes(self) -> tuple[fx.Node, ...]:
        return (self.norm.node,) + ((self.act[0],) if self.act else ())

    @property
    def labels(self) -> list[str]:
        groups = "instance" if self.norm.groups is None else self.norm.groups
        return [f"group_norm({groups})"] + ([self.act[1].kind.name.lower()] if self.act else [])


@dataclass(frozen=True)
class InputUpsample:
    """``conv(upsample(source, scale))``: a nearest upsample (``node``) by an integer ``scale`` per
    spatial dim that only ``conv`` reads, folded into it: the region's conv is ``folded``, the
    transposed conv of stride ``scale`` on ``source`` that computes the same (``ops/upsample_fold.py``;
    its weight a ``Deferred``, made from the conv's when the region is rewritten: a family's rewrite
    passes it as the conv's)."""

    node: fx.Node
    source: fx.Node
    scale: tuple[int, ...]
    conv: Conv
    folded: Conv

    @property
    def nodes(self) -> tuple[fx.Node, ...]:
        return (self.node,)

    @property
    def labels(self) -> list[str]:
        scale = self.scale[0] if len(set(self.scale)) == 1 else "x".join(map(str, self.scale))
        return [f"upsample({scale})"]


#: What a conv may apply to its input as it loads it, taken into its region (its nodes come first).
InputPrologue = Union[InputGate, InputNorm, InputUpsample]


def input_upsample(ctx: MatchContext, conv: Conv, family: str) -> Union[InputUpsample, NearMiss, None]:
    """The nearest upsample ``conv`` reads, where it folds into the conv (``ops/upsample_fold.py``):
    read by the conv alone, every spatial size multiplied by an integer power of two (a scale whose
    reciprocal is exact, so that the upsample's source index is ``o // s`` as the fold assumes), a
    conv of stride and dilation 1 and padding below its kernel.  The scale is the ``scale_factor``
    the call gave, or with a ``size`` the ratio of the sizes where they are numbers (not symbols:
    dynamic shapes).  A nearest upsample that does not fold is ``family``'s ``NearMiss`` saying why
    (its region then opens at the conv); no nearest upsample (or one without metadata, or claimed): None."""
    node = conv.input
    op = ctx.op(node) if isinstance(node, fx.Node) else None
    if not isinstance(op, Upsample) or not isinstance(op.input, fx.Node) or node in ctx.claimed:
        return None
    source, upsampled, weight = fake_of(op.input), fake_of(node), fake_of(conv.weight) if isinstance(
        conv.weight, fx.Node) else None  # fmt: skip
    dims = conv.spec.spatial_dims
    if not all(isinstance(t, torch.Tensor) for t in (source, upsampled, weight)) or source.dim() != dims + 2 \
            or upsampled.dim() != dims + 2:
        return None

    def miss(reason: ReasonKind, why: str) -> NearMiss:
        return ctx.near_miss(family, conv.node, node, reason, f"the nearest upsample `{node.name}` is not "
                             f"folded into the conv: {why}")  # fmt: skip

    if len(node.users) != 1:
        return miss(ReasonKind.SHARED_INTERMEDIATE, "its result is read outside the conv too")
    given = op.scale_factor
    if given is not None:  # the scale the call gave (sizes may be symbolic: dynamic shapes)
        given = given if isinstance(given, tuple) else (given,) * dims
        if len(given) != dims or any(float(g) != int(g) or int(g) < 1 for g in given):
            return miss(ReasonKind.UNSUPPORTED_ARGUMENT, f"scale_factor {op.scale_factor} is not a whole number per dim")
        scale = tuple(int(g) for g in given)
    else:  # a size: the scale from the sizes, where they are numbers
        sizes = list(zip(source.shape[2:], upsampled.shape[2:], strict=True))
        if not all(isinstance(a, int) and isinstance(b, int) for a, b in sizes):
            return miss(ReasonKind.UNSUPPORTED_ARGUMENT, "its size is not known when compiling (dynamic shapes: a "
                        "scale_factor folds)")  # fmt: skip
        if not all(a > 0 and b % a == 0 for a, b in sizes):
            return miss(ReasonKind.UNSUPPORTED_ARGUMENT, f"its sizes {tuple(b for _, b in sizes)} are not whole "
                        f"multiples of {tuple(a for a, _ in sizes)}")  # fmt: skip
        scale = tuple(b // a for a, b in sizes)
    if any(s & (s - 1) for s in scale):
        return miss(ReasonKind.UNSUPPORTED_ARGUMENT, f"scale {scale} is not a power of two (the fold reads source "
                    "index o // s, which is nearest's where 1/s is exact)")  # fmt: skip
    kernel = tuple(int(k) for k in weight.shape[2:])
    why = upsample_fold_problem(conv.spec, kernel, scale)
    if why is not None:
        return miss(ReasonKind.UNSUPPORTED_ARGUMENT, why)
    folded = Conv(conv.node, op.input, _folded_weight(conv, scale), conv.bias,
                  transposed_equivalent(conv.spec, kernel, scale))  # fmt: skip
    return InputUpsample(node, op.input, scale, conv, folded)


def _folded_weight(conv: Conv, scale: tuple[int, ...]) -> Deferred:
    """The transposed conv's weight, made from ``conv``'s when the region is rewritten: in the graph,
    where Inductor makes one kernel of it and autograd differentiates it (``ops/upsample_fold.py``)."""
    from ..ops.upsample_fold import upsampled_conv_weight

    groups, dtype = conv.spec.groups, fake_of(conv.node).dtype  # in the conv's dtype: no cast after it
    return Deferred(lambda graph, inputs: graph.call_function(
        upsampled_conv_weight, (materialize(graph, inputs[0]), scale, groups, dtype)), (conv.weight,))


@dataclass
class ConvRegion:
    """A region the walk found: the conv, the chain before the centre (``pre``), the centre's
    canonical op and what its config needs (``facts``, ``Centre.facts``' answer), the chain after it
    (``post``; the whole chain of a walk with no centre), the pool that ends it and what the conv
    applies to its input as it loads it (``prologue``: a gate, a group norm, or a folded upsample, whose
    region's ``conv`` is then the transposed conv it folds into; its nodes come first).  ``pre`` and
    ``post`` share one operand list: the fused op's tensor operands in order."""

    conv: Conv
    pre: ChainPart
    post: ChainPart
    centre: Any = None
    facts: Any = None
    pool: Optional[Pool] = None
    prologue: Optional[InputPrologue] = None


def _accept_any(op: Any, rank: int) -> bool:
    return True


def _no_facts(site: CentreSite) -> None:
    return None


def _no_refusal(site: CentreSite) -> None:
    return None


def _own_node(site: CentreSite) -> list[fx.Node]:
    return [site.node]


def _keeps_channels(op: Any) -> bool:
    return True


def _nothing_refused_after(node: fx.Node, op: CanonicalOp, last: fx.Node) -> None:
    return None


def _region_accepted(region: ConvRegion) -> None:
    return None


@dataclass(frozen=True)
class Centre:
    """The op a family's region is built around, declared as data (one per family).

    * ``op_type``: the canonical op type(s) (``frontend/canonical.py``) the centre is;
    * ``what``: how near misses name it ("the group norm");
    * ``label(region)``: its part of the region's summary ("group_norm(4)");
    * ``in_sight(op, rank)``: whether an op of that type, reading the chain of a conv output of
      ``rank`` dims, makes the conv this family's (by default every one does);
    * ``lookahead``: how many pointwise steps after the conv the walk looks for it;
    * ``chain_before``: whether a pointwise chain may come before it (else it reads the conv output);
    * ``static_channels``: whether the conv's channel count must be known at compile time, checked
      before anything else (a dynamic count is a ``DIMENSION_MISMATCH`` of the conv);
    * ``trailing_pool``: whether a max / avg pool may end the region;
    * ``refusal(site)``: the centre's checks, in order: a ``Refusal`` or None (it joins);
    * ``value_nodes(site)``: the nodes that compute the centre's value, the value last (by default
      the centre's node), or a ``Refusal``;
    * ``facts(site)``: what the config needs from the centre, appending its tensor operands to
      ``site.operands``;
    * ``keeps_channels(op)``: whether the centre's value still has the conv's channels (else the
      chain after it takes only numbers and one-element tensors as operands);
    * ``refuse_after(node, op, last)``: why ``node``, an op after the chain that follows the centre
      (``last`` its value so far), ends the region with a near miss, or None (it ends it quietly);
    * ``region_refusal(region)``: a last check of the whole region, after the chain that follows.
    """

    op_type: Union[type, tuple[type, ...]]
    what: str
    label: Callable[[ConvRegion], str]
    refusal: Callable[[CentreSite], Optional[Refusal]] = _no_refusal
    facts: Callable[[CentreSite], Any] = _no_facts
    in_sight: Callable[[Any, int], bool] = _accept_any
    lookahead: int = 8
    chain_before: bool = True
    static_channels: bool = True
    trailing_pool: bool = False
    value_nodes: Callable[[CentreSite], Union[list[fx.Node], Refusal]] = _own_node
    keeps_channels: Callable[[Any], bool] = _keeps_channels
    refuse_after: Callable[[fx.Node, CanonicalOp, fx.Node], Optional[str]] = _nothing_refused_after
    region_refusal: Callable[[ConvRegion], Optional[Refusal]] = _region_accepted

    @property
    def op_types(self) -> tuple[type, ...]:
        return self.op_type if isinstance(self.op_type, tuple) else (self.op_type,)


@dataclass(frozen=True)
class Folded:
    """An op folded into a chain (``ConvWalkPattern.fold``): the chain ``steps`` it becomes (their
    ``TensorRef``s index the region's operands with ``operands`` appended), and its summary label."""

    steps: tuple[ChainStep, ...]
    operands: tuple[Any, ...]
    label: str


def claim_wording(subject: str, family: str) -> str:
    """A near miss's words for an op ``family`` takes: ``subject`` (what the op is or does, in the
    claiming family's words), then whose it is."""
    return f"{subject} the {family} family's (its near miss says why it did not fuse)"


def claimed_elsewhere(node: fx.Node, op: CanonicalOp, rank: int, asking: str) -> Optional[str]:
    """What the first family other than ``asking`` (in precedence order) that claims ``node`` says of
    it (``Pattern.claim``), or None where no family claims it."""
    registry = registered_patterns()
    for name in precedence_order():
        if name != asking:
            said = registry[name].claim(node, op, rank)
            if said is not None:
                return said
    return None


def conv_label(conv: Conv) -> str:
    """The conv's part of a region's summary: ``conv2d``, ``conv_transpose3d``."""
    spec = conv.spec
    return f"conv{'_transpose' if spec.transposed else ''}{spec.spatial_dims}d"


class ConvWalkPattern(ConvAnchoredPattern):
    """A family of the conv walk (module docstring): it sets ``centre`` (None: the chain alone) and,
    for a walk with no centre, may fold ops of the types ``folds`` into its chain (``fold``)."""

    centre: Optional[Centre] = None
    folds: tuple[type, ...] = ()
    trailing_pool: bool = False
    """Whether a pool may end a walk with no centre (a centred walk asks its ``Centre``)."""
    residual: bool = False
    """Whether a walk with no centre may add one full-size tensor (a residual branch) in its chain
    (``chain_walk.pointwise_step``); a pool then does not join."""

    @property
    def precedence(self) -> Precedence:  # type: ignore[override]
        return Precedence.CHAIN_ONLY if self.centre is None else Precedence.CLAIMS_AN_OP

    def input_prologue(self, ctx: MatchContext, conv: Conv) -> Optional[InputPrologue]:
        """For a walk with no centre and a conv that reads no foldable upsample (every walk takes
        that in: ``input_upsample``): what made the conv's input (a gate it is multiplied by, a
        group norm and its activation), where the family takes it into the region (its nodes then
        join the region, before the conv); None otherwise."""
        return None

    def chain_limit(self, ctx: MatchContext, conv: Conv, part: ChainPart, y: torch.Tensor) -> Optional[tuple[int, Refusal]]:
        """For a walk with no centre, once its chain has grown: the most steps the region may keep and
        why, where the family keeps fewer than the chain holds; None to keep them all."""
        return None

    def fold(self, ctx: MatchContext, op: Any, flowing: fx.Node, part: ChainPart, y: torch.Tensor) -> Union[Folded, Refusal]:
        """``op`` (of a type in ``folds``, reading the chain's value ``flowing``) as chain steps, or
        why it cannot be (the chain then ends before it, with that near miss)."""
        raise NotImplementedError(f"{type(self).__name__} folds {self.folds} but does not define fold()")

    def match_conv(self, ctx: MatchContext, conv: Conv) -> Optional[Union[Candidate, NearMiss]]:
        upsample = input_upsample(ctx, conv, self.name)
        unfolded = upsample if isinstance(upsample, NearMiss) else None
        upsample = upsample if isinstance(upsample, InputUpsample) else None
        if self.centre is None:
            found = self._walk_chain(ctx, conv, upsample)
        else:
            found = self._walk_to_centre(ctx, conv, self.centre, upsample)
        if unfolded is not None and isinstance(found, Candidate):  # the region opens at the conv: say why
            found.notes.append(unfolded)
        return found

    def _miss(self, ctx: MatchContext, conv: Conv) -> Callable[[fx.Node, ReasonKind, str], NearMiss]:
        return lambda at, reason, message: ctx.near_miss(self.name, conv.node, at, reason, message)

    # -- a walk with a centre -------------------------------------------------------------------

    def _walk_to_centre(self, ctx: MatchContext, conv: Conv, centre: Centre,
                        upsample: Optional[InputUpsample]) -> Optional[Union[Candidate, NearMiss]]:  # fmt: skip
        if upsample is not None:
            conv = upsample.folded  # the region's conv is the transposed conv it folds into
        anchor = conv.node
        y = fake_of(anchor)
        if not isinstance(y, torch.Tensor) or y.dim() != conv.spec.spatial_dims + 2:
            return None
        in_sight = centre_in_sight(ctx, anchor, centre, y.dim())
        if in_sight is None:
            return None  # no centre in sight: not this family's conv
        miss = self._miss(ctx, conv)
        if y.dtype not in FUSED_DTYPES:
            return miss(anchor, ReasonKind.UNSUPPORTED_DTYPE, f"conv output dtype {y.dtype} is not a floating type the fused op supports")
        channels = y.shape[1]
        if centre.static_channels and isinstance(channels, torch.SymInt) and not channels.node.expr.is_number:
            return miss(anchor, ReasonKind.DIMENSION_MISMATCH, f"the conv has a dynamic number of channels ({channels})")

        # 1. the chain before the centre
        pre = ChainPart([])
        values = ChainValues(anchor)
        if centre.chain_before:
            end = grow_chain(ctx, self.name, anchor, anchor, pre, values, y, FUSED_DTYPES, (Pointwise, *centre.op_types),
                             f"the chain before {centre.what}")  # fmt: skip
            if end.miss is not None:
                return end.miss
            if end.user is None:
                return miss(end.last, ReasonKind.SHARED_INTERMEDIATE, end.why)
            if not isinstance(ctx.op(end.user), centre.op_types):
                return miss(end.user, ReasonKind.UNSUPPORTED_OP,
                            f"`{end.user.name}` ({describe_target(end.user)}) before {centre.what} is not a fusible "
                            "pointwise op")  # fmt: skip
            site = CentreSite(ctx, conv, y, ctx.op(end.user), end.last, pre.operands)
        else:
            site = CentreSite(ctx, conv, y, in_sight, anchor, pre.operands)

        # 2. the centre
        user = site.node
        refused = centre.refusal(site)
        if refused is not None:
            return self._refused(ctx, conv, user, refused)
        if site.op.input is not site.flowing:  # (a centre's checks usually say so first, in their own words)
            return miss(user, ReasonKind.UNSUPPORTED_OPERAND, f"`{user.name}` does not read the chain's value")
        if not values.closed(pre, user):
            held = {anchor, *pre.step_nodes, user}
            read_outside = next(n for n in [anchor, *pre.step_nodes] if any(u not in held for u in n.users))
            return miss(read_outside, ReasonKind.SHARED_INTERMEDIATE, values.outside_users(read_outside))
        value_nodes = centre.value_nodes(site)
        if isinstance(value_nodes, Refusal):
            return self._refused(ctx, conv, user, value_nodes)
        value = value_nodes[-1]
        out = fake_of(value)
        if not isinstance(out, torch.Tensor):
            return miss(value, ReasonKind.MISSING_METADATA, f"no metadata for `{value.name}`")
        if out.dtype not in FUSED_DTYPES:
            return miss(value, ReasonKind.UNSUPPORTED_DTYPE, f"`{value.name}` yields {out.dtype}")
        region = ConvRegion(conv, pre, ChainPart(pre.operands), site.op, centre.facts(site), prologue=upsample)

        # 3. the chain after it, then an optional pool
        notes = self._chain_after(ctx, conv, centre, site.op, value, region.post, out)
        refused = centre.region_refusal(region)
        if refused is not None:
            return self._refused(ctx, conv, user, refused)
        if centre.trailing_pool:
            last = region.post.step_nodes[-1] if region.post.step_nodes else value
            region.pool, pool_notes = pool_after(ctx, self.name, anchor, last, conv.spec.spatial_dims)
            notes += pool_notes
        nodes = ([upsample.node] if upsample else []) + [anchor, *pre.step_nodes, *value_nodes, *region.post.step_nodes] + (
            [region.pool.node] if region.pool else [])
        return Candidate(self.name, anchor, nodes, region, self._summary(region), notes)

    def _chain_after(self, ctx: MatchContext, conv: Conv, centre: Centre, op: Any, value: fx.Node, post: ChainPart,
                     out: torch.Tensor) -> list[NearMiss]:  # fmt: skip
        """Grow ``post`` from the centre's ``value`` (fake ``out``); the near misses of where it
        stopped (the region is fine without them)."""
        values = ChainValues(value)
        end = grow_chain(ctx, self.name, conv.node, value, post, values, out, FUSED_DTYPES, (Pointwise,),
                         f"the chain after {centre.what}", scalar_operands=not centre.keeps_channels(op))  # fmt: skip
        notes = []
        if end.miss is not None:
            notes.append(end.miss)
        elif end.user is not None:
            why = centre.refuse_after(end.user, ctx.op(end.user), end.last)
            if why is not None:
                notes.append(ctx.near_miss(self.name, conv.node, end.user, ReasonKind.UNSUPPORTED_OP, why))
        _, read_outside = values.longest_closed_prefix(post)
        if read_outside is not None:
            notes = [ctx.near_miss(self.name, conv.node, read_outside, ReasonKind.SHARED_INTERMEDIATE,
                                   values.outside_users(read_outside))]
        return notes

    def _refused(self, ctx: MatchContext, conv: Conv, at: fx.Node, refused: Refusal) -> Optional[NearMiss]:
        if refused.reason is None:
            return None
        return ctx.near_miss(self.name, conv.node, refused.at or at, refused.reason, refused.message)

    # -- a walk with no centre: the chain alone ----------------------------------------------------

    def _walk_chain(self, ctx: MatchContext, conv: Conv, upsample: Optional[InputUpsample]) -> Union[Candidate, NearMiss]:
        anchor = conv.node
        y = fake_of(anchor)
        miss = self._miss(ctx, conv)
        if not isinstance(y, torch.Tensor):
            return miss(anchor, ReasonKind.MISSING_METADATA, f"no shape/dtype metadata for `{anchor.name}`")
        if y.dtype not in FUSED_DTYPES:
            return miss(anchor, ReasonKind.UNSUPPORTED_DTYPE, f"conv output dtype {y.dtype} is not a floating type the fused op supports")
        if y.dim() != conv.spec.spatial_dims + 2:
            return miss(anchor, ReasonKind.DIMENSION_MISMATCH, f"unbatched conv input (output rank {y.dim()})")

        part = ChainPart([])
        prologue = upsample or self.input_prologue(ctx, conv)
        if upsample is not None:
            conv = upsample.folded  # the region's conv is the transposed conv it folds into
        region = ConvRegion(conv, ChainPart(part.operands), part, prologue=prologue)
        values = ChainValues(anchor)
        fusible = (Pointwise, Pool, *self.folds)
        stop: Optional[NearMiss] = None
        current = anchor
        while True:
            end = grow_chain(ctx, self.name, anchor, current, part, values, y, FUSED_DTYPES, fusible, "the fused chain",
                             residual=self.residual)
            current = end.last
            if end.miss is not None:
                stop = end.miss
                break
            if end.user is None:
                stop = miss(current, ReasonKind.SHARED_INTERMEDIATE, end.why)
                break
            user, op = end.user, ctx.op(end.user)
            if isinstance(op, self.folds):
                folded = self.fold(ctx, op, current, part, y)
                if isinstance(folded, Refusal):
                    stop = miss(folded.at or user, folded.reason, folded.message)
                    break
                part.steps += folded.steps
                part.operands += folded.operands
                part.step_nodes.append(user)
                part.labels.append(folded.label)
                current = values.computed(user, len(part.steps))
                continue
            if isinstance(op, Pool) and self.trailing_pool:
                refused = pool_refusal(op, conv.spec.spatial_dims)
                if refused is None and full_size_operand(ctx, part.operands, y) is not None:
                    refused = (ReasonKind.UNSUPPORTED_OP, "a pool after a residual add is not fused (the region "
                               "ends before the pool)")
                if refused is not None:
                    stop = miss(user, *refused)
                else:
                    region.pool = op
                break
            description = op.description if isinstance(op, Opaque) else describe_target(user)
            why = claimed_elsewhere(user, op, y.dim(), self.name) or "is not a fusible pointwise op or pool"
            stop = miss(user, ReasonKind.UNSUPPORTED_OP, f"`{user.name}` ({description}) {why}")
            break
        limit = self.chain_limit(ctx, conv, part, y)
        if region.pool is None or limit is not None or not values.closed(part, region.pool.node):
            region.pool, held = None, len(part.steps)
            current, read_outside = values.longest_closed_prefix(part, None if limit is None else limit[0])
            if limit is not None and len(part.steps) < held:
                stop = miss(limit[1].at, limit[1].reason, limit[1].message)
            elif read_outside is not None:
                stop = miss(read_outside, ReasonKind.SHARED_INTERMEDIATE, values.outside_users(read_outside))

        if not part.steps and region.pool is None and region.prologue is None:
            if stop is None or [u.op for u in anchor.users] == ["output"]:
                return miss(anchor, ReasonKind.NO_EPILOGUE, "the conv output goes straight to the graph output")
            return stop
        nodes = (list(region.prologue.nodes) if region.prologue else []) + [anchor, *part.step_nodes] + (
            [region.pool.node] if region.pool else [])
        # A chain that simply ends at the graph output or at the next conv is no near miss; any other
        # stop is reported.
        natural_end = [u.op for u in current.users] == ["output"] or (
            len(current.users) == 1 and isinstance(ctx.op(next(iter(current.users))), Conv))
        notes = [stop] if stop is not None and region.pool is None and not natural_end else []
        return Candidate(self.name, anchor, nodes, region, self._summary(region), notes)

    def _summary(self, region: ConvRegion) -> str:
        """``conv2d -> relu -> group_norm(4) -> silu -> max_pool2d``: the conv, the chain before the
        centre, the centre's label, the chain after it, the pool."""
        conv = region.prologue.conv if isinstance(region.prologue, InputUpsample) else region.conv
        parts = (region.prologue.labels if region.prologue else []) + [conv_label(conv), *region.pre.labels]
        if self.centre is not None:
            parts.append(self.centre.label(region))
        parts += region.post.labels
        if region.pool is not None:
            parts.append(f"{region.pool.spec.kind}_pool{region.conv.spec.spatial_dims}d")
        return " -> ".join(parts)


def centre_in_sight(ctx: MatchContext, anchor: fx.Node, centre: Centre, rank: int) -> Optional[Any]:
    """The first op (breadth first, DAG chains included) of the centre's type that the centre
    accepts (``Centre.in_sight``) and that reads ``anchor`` or a pointwise op computed from it within
    ``centre.lookahead`` steps, or None."""
    for op in _ops_within(ctx, anchor, centre.lookahead):
        if isinstance(op, centre.op_types) and centre.in_sight(op, rank):
            return op
    return None


def _ops_within(ctx: MatchContext, anchor: fx.Node, steps: int) -> Iterator[Any]:
    """The canonical ops whose ``input`` is ``anchor`` or a pointwise op computed from it (through
    any of its arguments), breadth first, at most ``steps`` ops away."""
    frontier, seen = [anchor], {anchor}
    for _ in range(steps):
        following = []
        for current in frontier:
            for user in current.users:
                op = ctx.op(user)
                if getattr(op, "input", None) is current:
                    yield op
                if isinstance(op, Pointwise) and user not in seen:
                    seen.add(user)
                    following.append(user)
        frontier = following


def is_sync_batch_norm(node: fx.Node) -> bool:
    """Whether Dynamo recorded ``node`` inside an ``nn.SyncBatchNorm``'s forward."""
    stack = node.meta.get("nn_module_stack") or {}
    return any(isinstance(t, type) and issubclass(t, torch.nn.SyncBatchNorm) for _, t in stack.values())


def batch_norm_problem(norm: BatchNorm, channels: int) -> Optional[tuple[ReasonKind, str]]:
    """``(reason, message)`` where a batch norm with batch statistics over ``channels`` channels cannot
    be fused, by the checks every family taking one makes, else None: a batch norm module call (it
    would hide ``num_batches_tracked``'s increment), a momentum that is not a number, a weight, bias or
    running statistic that is not one value per channel."""
    node = norm.node
    if node.op == "call_module":
        return ReasonKind.UNSUPPORTED_OP, (f"`{node.name}` calls a batch norm module, which also counts "
                                           "num_batches_tracked; only its inlined F.batch_norm (what Dynamo "
                                           "records) fuses")  # fmt: skip
    momentum = norm.momentum
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)):
        described = f"`{momentum.name}` (a traced value)" if isinstance(momentum, fx.Node) else repr(momentum)
        return ReasonKind.UNSUPPORTED_ARGUMENT, f"the batch norm's momentum {described} is not a number"
    for name in ("weight", "bias", "running_mean", "running_var"):
        why = per_channel_problem(getattr(norm, name), channels)
        if why is not None:
            return ReasonKind.UNSUPPORTED_OPERAND, f"the batch norm's {name} {why}"
    return None


def prologue_activation(op: Any) -> Optional[ChainStep]:
    """The chain step of ``op`` where it is an activation the conv family's prologue applies (relu,
    leaky_relu of a constant slope, gelu, silu) to its first argument, else None."""
    if not isinstance(op, Pointwise) or not op.args or not isinstance(op.args[0], fx.Node):
        return None
    seen = op.with_flowing(op.args[0])
    if isinstance(seen, str):
        return None
    kind, operands = seen
    if not all(isinstance(o, (int, float)) and not isinstance(o, bool) for o in operands):
        return None
    step = ChainStep(kind, tuple(Const(float(o)) for o in operands))
    return step if family_activation(step) is not None else None
