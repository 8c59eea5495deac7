"""The match engine: runs the registered patterns over a normalised graph and rewrites their regions.

Patterns are data-like objects (``Pattern`` subclasses in the top-level ``patterns/`` folder,
installed as ``fusion_backend.patterns``), registered with ``register_pattern``; this module knows none of them by name.  The engine

1. normalises every node (``frontend/normalize.py``) after rewiring in-place aliases and folding
   multi-node spellings of one op (``frontend/idioms.py``: ``y * sigmoid(y)`` is a SiLU);
2. asks each enabled pattern, in ``precedence_order``, for candidates and near misses; a candidate
   overlapping nodes already claimed becomes a ``CLAIMED`` near miss, so regions stay disjoint, and
   an alternate the decision may take where it keeps none of the regions holding those nodes
   (``Regions.alternates``);
3. rewrites every accepted candidate through its pattern, then lints and recompiles the graph.

It raises on any internal failure; the backend turns that into a whole-graph fallback.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Optional, Union

import torch
import torch.fx as fx

from ..frontend.canonical import CanonicalOp, Conv, Opaque, ParamRef
from ..frontend.idioms import fold_idioms
from ..frontend.normalize import functionalize_inplace, normalize_graph
from ..ir.fakes import fake_of
from ..ops.chain import Const, Operand, TensorRef
from ..report import Match, NearMiss, ReasonKind, source_line_of
from .batch_glue import batch_casts, batch_scale_and_shift


@dataclass
class Candidate:
    """A region a pattern wants to rewrite.  ``nodes`` in graph order; the last one's value is the
    region's result.  ``payload`` is the pattern's own description of the region."""

    pattern: str
    anchor: fx.Node
    nodes: list[fx.Node]
    payload: Any
    summary: str
    notes: list[NearMiss] = field(default_factory=list)
    """Near misses to report even though the candidate matched (e.g. "chain stopped at X")."""
    family: Optional[Pattern] = field(default=None, repr=False, compare=False)
    """The pattern that found it (set by ``find_regions``): what rewrites it."""

    def moved(self, node_map: Mapping[fx.Node, fx.Node]) -> Candidate:
        """This candidate with every node it names (in ``nodes``, ``anchor`` and its ``payload``)
        replaced by its image in ``node_map``, e.g. the same region in a copy of the graph."""
        return _remap(self, node_map)

    def rewrite_copy(self, gm: fx.GraphModule, node_map: Mapping[fx.Node, fx.Node], strict: bool = False) -> Match:
        """Rewrite this candidate's region in ``gm``, another graph that holds a copy of each of the
        region's nodes (``node_map``: a node of the graph the candidate was found in -> its copy in
        ``gm``; e.g. the region extracted for timing), exactly as the family rewrites it in the whole
        graph: no pattern runs again.  Lints and recompiles ``gm``; returns the ``Match``.

        ``gm`` must hold the region as it was found, normalised (its nodes copied from the graph
        ``find_regions`` normalised); every node the candidate names must be in ``node_map``."""
        if self.family is None:
            raise ValueError(f"the {self.pattern} candidate at `{self.anchor.name}` was not found by find_regions")
        missing = [n.name for n in self.nodes if n not in node_map]
        if missing:
            raise ValueError(f"the copy lacks the region's nodes {missing}")
        ctx = MatchContext(gm, strict=strict)
        match = self.family.rewrite(ctx, self.moved(node_map))
        gm.graph.lint()
        gm.recompile()
        return match


def _remap(value: Any, node_map: Mapping[fx.Node, fx.Node], memo: Optional[dict[int, Any]] = None) -> Any:
    """``value`` with every ``fx.Node`` inside it (through dataclasses, lists, tuples, dicts) replaced
    by its image in ``node_map`` (nodes outside it kept).  Objects without nodes are shared, not
    copied; an object reached twice (two chains sharing one operand list) is remapped once, so what
    was shared stays shared."""
    memo = {} if memo is None else memo
    if isinstance(value, fx.Node):
        return node_map.get(value, value)
    if isinstance(value, (str, int, float, bool, type(None), torch.dtype, Pattern)) or isinstance(value, type):
        return value
    if id(value) in memo:
        return memo[id(value)]
    if dataclasses.is_dataclass(value):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        clone = copy.copy(value)
        memo[id(value)] = clone
        moved = {name: _remap(v, node_map, memo) for name, v in fields.items()}
        if all(moved[name] is fields[name] for name in fields):
            memo[id(value)] = value
            return value
        for name, v in moved.items():
            object.__setattr__(clone, name, v)  # frozen dataclasses too: the copy is ours
        return clone
    if isinstance(value, list):
        moved_list: list[Any] = []
        memo[id(value)] = moved_list
        moved_list.extend(_remap(v, node_map, memo) for v in value)
        return moved_list
    if isinstance(value, tuple):
        items = [_remap(v, node_map, memo) for v in value]
        moved_tuple = type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        memo[id(value)] = moved_tuple
        return moved_tuple
    if isinstance(value, dict):
        moved_dict: dict[Any, Any] = {}
        memo[id(value)] = moved_dict
        moved_dict.update({_remap(k, node_map, memo): _remap(v, node_map, memo) for k, v in value.items()})
        return moved_dict
    return value


class Precedence(IntEnum):
    """Which family takes a conv that several could take: the higher tier first.  Within a tier,
    families are tried in the order they were registered (the built-in ones in the order
    ``patterns/__init__.py`` imports them); families of one tier claim different ops, so their
    regions never share a conv and that order only fixes the order of the regions (the order they
    are decided and rewritten in) and which of two near misses of one conv is reported."""

    CHAIN_ONLY = 0
    """The conv, the pointwise chain after it and an optional pool, and nothing else: what is left
    once no family claimed an op after the conv."""
    CLAIMS_AN_OP = 1
    """A family that claims an op after the conv (a norm, a reduction, a global mean): it takes the
    conv before the plain chain could, which would leave that op, and the conv output it reads, to
    Inductor."""
    TAKES_ITS_INPUT = 2
    """A family that takes the ops computing the conv's input (a training norm and its activation, which
    the conv applies as it loads it): that norm is also where the previous conv's norm family would end,
    and only this family's region removes the norm's output from memory in both directions; the other
    stays an alternate the decision weighs where this one loses (``Regions.alternates``)."""


class Pattern:
    """Base class of a pattern family.  Subclasses set the class attributes and implement two methods.

    ``find`` yields ``Candidate``s and ``NearMiss``es, reading only ``ctx.canonical`` and fake values;
    ``rewrite`` replaces one candidate's region with a fused op call and returns the ``Match`` record.
    ``claim`` is how another family's near miss names this one (``match/conv_walk.py``).
    """

    name: str = ""
    precedence: Precedence = Precedence.CLAIMS_AN_OP
    description: str = ""
    opt_in: bool = False
    """A family that runs only where it is named (the ``patterns`` option, ``"all"``, or
    ``FUSION_PATTERNS``): one whose fused op has not yet measured faster than Inductor on the
    networks it was built for, so that its regions cost no one a decision's measurement by default."""

    def find(self, ctx: MatchContext) -> Iterable[Union[Candidate, NearMiss]]:
        raise NotImplementedError

    def rewrite(self, ctx: MatchContext, candidate: Candidate) -> Match:
        raise NotImplementedError

    def claim(self, node: fx.Node, op: CanonicalOp, rank: int) -> Optional[str]:
        """What this family would say of ``node`` (canonical ``op``) reading a conv output of ``rank``
        dims when it is an op this family claims, e.g. "normalizes by statistics of the conv output
        (LayerNorm)"; None for any other op (the default).  A conv chain that stops at the op says
        whose it is (``conv_walk.claimed_elsewhere``) instead of only that it is not pointwise."""
        return None


class ConvAnchoredPattern(Pattern):
    """A family whose regions start at a conv: ``find`` offers each conv of the graph, in graph
    order, to ``match_conv``, which returns a ``Candidate``, a ``NearMiss`` (a conv of this family's
    kind that it cannot take, with the reason) or ``None`` (a conv that is not this family's)."""

    def find(self, ctx: MatchContext) -> Iterator[Union[Candidate, NearMiss]]:
        for conv in ctx.convs():
            found = self.match_conv(ctx, conv)
            if found is not None:
                yield found

    def match_conv(self, ctx: MatchContext, conv: Conv) -> Optional[Union[Candidate, NearMiss]]:
        raise NotImplementedError


_REGISTRY: dict[str, Pattern] = {}


def register_pattern(cls: type[Pattern]) -> type[Pattern]:
    """Class decorator: instantiate and register a pattern under ``cls.name`` (unique)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY and type(_REGISTRY[cls.name]) is not cls:
        raise ValueError(f"a pattern named {cls.name!r} is already registered ({type(_REGISTRY[cls.name]).__name__})")
    _REGISTRY[cls.name] = cls()
    return cls


def registered_patterns() -> dict[str, Pattern]:
    """Name → pattern, for every registered pattern, in registration order (the built-in ones are
    loaded on first use)."""
    from .. import patterns  # noqa: F401  (registers the built-in families)

    return dict(_REGISTRY)


def default_patterns() -> tuple[str, ...]:
    """The families that run unless told otherwise: every registered one but the opt-in ones."""
    return tuple(name for name, pattern in registered_patterns().items() if not pattern.opt_in)


def precedence_order() -> list[str]:
    """Every registered family's name, the one that takes a conv first first: by ``Precedence``
    tier, then in registration order."""
    registry = registered_patterns()
    rank = {name: i for i, name in enumerate(registry)}
    return sorted(registry, key=lambda name: (-registry[name].precedence, rank[name]))


class MatchContext:
    """What patterns see: the graph, the canonical op of every node, and shared checks."""

    def __init__(self, gm: fx.GraphModule, strict: bool = False) -> None:
        self.gm = gm
        self.strict = strict
        self.canonical: dict[fx.Node, CanonicalOp] = normalize_graph(gm)
        if functionalize_inplace(gm, self.canonical):
            self.canonical = normalize_graph(gm)
        while fold_idioms(gm, self.canonical):  # y * sigmoid(y) -> silu(y), ...; until none is left
            self.canonical = normalize_graph(gm)  # (a folded node may start the next idiom)
        self.claimed: set[fx.Node] = set()
        self.replaced: dict[fx.Node, fx.Node] = {}
        """Result node of each rewritten region → the fused node that took its place."""

    def resolve(self, value: Any) -> Any:
        """The live graph value for ``value``: a region's result that an earlier rewrite replaced
        (one fused region feeding another) maps to the fused node; anything else is returned as is."""
        while isinstance(value, fx.Node) and value in self.replaced:
            value = self.replaced[value]
        return value

    # -- graph queries -------------------------------------------------------------------------

    def op(self, node: fx.Node) -> CanonicalOp:
        return self.canonical.get(node) or Opaque(node, node.op)

    def convs(self) -> Iterator[Conv]:
        for op in self.canonical.values():
            if isinstance(op, Conv):
                yield op

    def sole_user(self, node: fx.Node) -> tuple[Optional[fx.Node], str]:
        """The only user of ``node``, or ``(None, why)`` naming the other users and their lines."""
        users = list(node.users)
        if len(users) == 1 and users[0].op != "output":
            return users[0], ""
        if not users:
            return None, f"`{node.name}` has no users"
        described = []
        for u in users:
            where = source_line_of(u)
            label = "the graph output" if u.op == "output" else f"`{u.name}`"
            described.append(label + (f" at {where.location}" if where else ""))
        return None, f"`{node.name}` is used by " + " and ".join(described)

    def near_miss(self, pattern: str, anchor: fx.Node, at: fx.Node, reason: ReasonKind, message: str) -> NearMiss:
        return NearMiss(pattern, anchor.name, at.name, reason, message, source_line_of(at))

    # -- operand classification ----------------------------------------------------------------

    def classify_operand(
        self, value: Any, flowing_fake: Any, operands: list[fx.Node]
    ) -> Union[Operand, str]:
        """Turn a pointwise op's second operand into a ``Const`` or a ``TensorRef`` into ``operands``.

        Accepted: Python numbers; tensors with one element and at most the flowing tensor's rank;
        per-channel tensors of shape (C,1,...,1) (rank one less) or (1,C,1,...,1) (same rank), where
        C is dim 1 of the flowing tensor.  ``x.item()`` of such a tensor (Dynamo lifts float module
        attributes to 0-d inputs under ``dynamic=True``) is used as the tensor itself.
        Returns a sentence saying why when the operand is not accepted.
        """
        if isinstance(value, bool) or isinstance(value, (int, float)):
            return Const(float(value))
        if isinstance(value, ParamRef):
            return "operands that are module attributes are not supported"
        if not isinstance(value, fx.Node):
            return f"operand {value!r} of type {type(value).__name__} is not a number or a tensor"
        if value.op == "call_method" and value.target == "item" and isinstance(value.args[0], fx.Node):
            source_fake = fake_of(value.args[0])
            if isinstance(source_fake, torch.Tensor) and source_fake.numel() == 1:
                value = value.args[0]
        fake = fake_of(value)
        if fake is None:
            return f"no shape metadata for operand `{value.name}`"
        if not isinstance(fake, torch.Tensor):
            return f"operand `{value.name}` is a symbolic {type(fake).__name__}, not a number or tensor"
        if fake.is_complex():
            return f"operand `{value.name}` is complex ({fake.dtype})"
        rank = flowing_fake.dim()
        shape = tuple(fake.shape)
        if _statically_one(fake.numel()) and fake.dim() <= rank:
            return self._ref(value, operands)
        channels = flowing_fake.shape[1]
        if fake.dim() == rank - 1 and _same(shape[0], channels) and all(_statically_one(s) for s in shape[1:]):
            return self._ref(value, operands)
        if fake.dim() == rank and _statically_one(shape[0]) and _same(shape[1], channels) and all(_statically_one(s) for s in shape[2:]):
            return self._ref(value, operands)
        return (f"operand `{value.name}` has shape {list(shape)}; only numbers, one-element tensors and "
                f"per-channel tensors of shape [C, 1, ...] or [1, C, 1, ...] (C = {channels}) fuse")

    @staticmethod
    def _ref(value: fx.Node, operands: list[fx.Node]) -> TensorRef:
        if value not in operands:
            operands.append(value)
        return TensorRef(operands.index(value))


def _statically(x: Any, value: int) -> bool:
    """Whether the size ``x`` (an int or a SymInt) is ``value`` for every input the graph accepts."""
    try:
        return int(x) == value if not isinstance(x, torch.SymInt) else x.node.expr == value
    except Exception:
        return False


def _statically_one(x: Any) -> bool:
    return _statically(x, 1)


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return False


@dataclass
class EngineResult:
    matches: list[Match]
    near_misses: list[NearMiss]


@dataclass
class Regions:
    """Outcome of the find phase: accepted candidates (disjoint) with their patterns, near misses,
    and the alternates: candidates refused only because accepted ones held some of their nodes (a
    ``CLAIMED`` near miss), in find order.  The decision may take an alternate where it keeps none of
    the candidates holding its nodes (``backend._decide_candidates``): e.g. a conv that applies the previous group
    norm as it loads its input, where ``conv_group_norm``'s region of that conv and the next norm
    loses.  An alternate's anchor (its first node, which keys its decision) is no accepted
    candidate's nor an earlier alternate's."""

    ctx: MatchContext
    accepted: list[tuple[Pattern, Candidate]]
    near_misses: list[NearMiss]
    alternates: list[Candidate] = field(default_factory=list)


def find_regions(gm: fx.GraphModule, enabled: Iterable[str], strict: bool = False,
                 on_stage: Optional[Callable[[str, Optional[str]], None]] = None) -> Regions:
    """Normalise ``gm`` and run the ``enabled`` patterns' ``find``, in ``precedence_order``.

    Changes the graph only by rewiring in-place aliases (``functionalize_inplace``) and folding
    multi-node spellings of one op into that op (``frontend/idioms.py``), both exact.
    """
    stage = on_stage or (lambda s, p: None)
    stage("normalize", None)
    ctx = MatchContext(gm, strict=strict)
    registry = registered_patterns()
    order = {name: i for i, name in enumerate(precedence_order())}
    patterns = sorted((registry[name] for name in enabled), key=lambda p: order[p.name])

    accepted: list[tuple[Pattern, Candidate]] = []
    near_misses: list[NearMiss] = []
    alternates: list[Candidate] = []
    alternate_firsts: set[fx.Node] = set()
    for pattern in patterns:
        stage("match", pattern.name)
        for item in pattern.find(ctx):
            if isinstance(item, NearMiss):
                near_misses.append(item)
                continue
            empty = _empty_value(item)
            if empty is not None:
                near_misses.append(ctx.near_miss(pattern.name, item.anchor, empty, ReasonKind.EMPTY_TENSOR,
                                                 f"`{empty.name}` has no elements ({list(fake_of(empty).shape)}): "
                                                 "nothing to fuse; Inductor's code runs the region as eager does"))
                continue
            taken = [n for n in item.nodes if n in ctx.claimed]
            if taken:
                near_misses.append(ctx.near_miss(pattern.name, item.anchor, taken[0], ReasonKind.CLAIMED,
                                                 f"`{taken[0].name}` is already part of another fused region"))
                if item.nodes[0] not in alternate_firsts:
                    alternate_firsts.add(item.nodes[0])
                    item.family = pattern
                    alternates.append(item)
                continue
            ctx.claimed.update(item.nodes)
            item.family = pattern
            accepted.append((pattern, item))

    # A conv fused by a family that precedes (or is) another is no near miss of that other family (the
    # conv of ConvTranspose2d -> global mean is no conv_epilogue near miss); a near miss of a
    # preceding family stays, since it says why the better rewrite did not happen.  The accepted
    # candidates' own notes (e.g. "the chain stopped at X") are kept.
    fused_by = {n.name: order[p.name] for p, c in accepted for n in c.nodes}
    near_misses = [m for m in near_misses if m.anchor not in fused_by or fused_by[m.anchor] > order[m.pattern]]
    near_misses += [note for _, c in accepted for note in c.notes]
    firsts = {c.nodes[0] for _, c in accepted}  # one decision per anchor: an accepted one found later keeps it
    return Regions(ctx, accepted, near_misses, [a for a in alternates if a.nodes[0] not in firsts])


def _empty_value(candidate: Candidate) -> Optional[fx.Node]:
    """The first node of the candidate (or one it reads) whose tensor has no elements, statically (a
    size-0 dim is always static: Dynamo specialises sizes 0 and 1), or None.

    WHY: a region over an empty tensor (a batch of 0) has nothing to compute, and the fused ops'
    kernels and references are written for at least one element; Inductor's code gives eager's
    result (an empty output, zero gradients, running statistics left as they were)."""
    for node in [*candidate.nodes, *(n for member in candidate.nodes for n in member.all_input_nodes)]:
        fake = fake_of(node)
        if isinstance(fake, torch.Tensor) and any(_statically(s, 0) for s in fake.shape):
            return node
    return None


def rewrite_regions(regions: Regions, chosen: Iterable[Candidate],
                    on_stage: Optional[Callable[[str, Optional[str]], None]] = None) -> list[Match]:
    """Rewrite the ``chosen`` candidates of ``regions`` (some or all of ``regions.accepted``, as the
    caller decided) in the graph they were found in, then batch their eval batch norms' scale and
    shift and their weights' casts (``batch_glue.py``); lints and recompiles it once.  Raises on failure."""
    stage = on_stage or (lambda s, p: None)
    matches = []
    for candidate in chosen:
        stage("rewrite", candidate.pattern)
        assert candidate.family is not None  # find_regions sets it
        matches.append(candidate.family.rewrite(regions.ctx, candidate))
    if matches:
        batch_scale_and_shift(regions.ctx.gm)
        batch_casts(regions.ctx.gm)
        regions.ctx.gm.graph.lint()
        regions.ctx.gm.recompile()
    return matches


def run_patterns(
    gm: fx.GraphModule,
    enabled: Iterable[str],
    strict: bool = False,
    on_stage: Optional[Callable[[str, Optional[str]], None]] = None,
) -> EngineResult:
    """Find and rewrite every region of ``gm`` in place with the ``enabled`` patterns (names); raises
    on failure.  ``on_stage(stage, pattern)`` is called before each stage so the caller can name the
    failing stage and pattern in its fallback report.  (The backend finds, decides and then rewrites
    only what it keeps: ``find_regions``, ``rewrite_regions``.)"""
    regions = find_regions(gm, enabled, strict, on_stage)
    matches = rewrite_regions(regions, [c for _, c in regions.accepted], on_stage)
    return EngineResult(matches, regions.near_misses)
