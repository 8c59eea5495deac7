"""Graph surgery shared by the patterns: materialise operands, cast inputs, splice in a fused call.

Contract of ``splice_fused_call``: the region's nodes are in graph order and only the last one is
used outside the region; the new call is inserted right before that last node (every input of the
region is defined before it), takes over all its uses and its metadata, and the region is erased.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

from ..frontend.canonical import Conv, ParamRef
from ..frontend.normalize import target_name
from ..report import Match, source_lines_of
from .engine import Candidate, MatchContext, fake_of


@dataclass(frozen=True)
class Deferred:
    """An operand of a fused op that does not exist in the graph yet: ``make(graph, inputs)`` inserts
    the nodes computing it when the region is rewritten (matching never changes the graph), e.g.
    batch norm's per-channel scale from its statistics.

    ``inputs``: the graph values it reads (nodes, ``ParamRef``s, None), resolved through earlier
    rewrites and handed to ``make``.  They are fields, never captured by ``make``: a candidate moved
    onto a copy of its graph (``Candidate.rewrite_copy``, e.g. the region extracted for timing) has
    its fields' nodes replaced by their copies, and a closure's would still name the original graph's."""

    make: Callable[[fx.Graph, tuple[Any, ...]], fx.Node]
    inputs: tuple[Any, ...] = ()


def materialize(graph: fx.Graph, value: Any) -> Any:
    """A graph value for a ``ValueRef``: ``ParamRef`` becomes a ``get_attr`` node, the rest passes."""
    if isinstance(value, ParamRef):
        return graph.get_attr(value.qualified_name)
    return value


def cast_if_needed(graph: fx.Graph, value: Any, dtype: torch.dtype) -> Any:
    """``value.to(dtype)`` when its recorded dtype differs (autocast runs the conv in bf16/fp16 on
    fp32 inputs, and the fused op, which autocast does not see, must receive what the conv saw)."""
    if value is None:
        return None
    fake = fake_of(value) if isinstance(value, fx.Node) else None
    current = fake.dtype if isinstance(fake, torch.Tensor) else None  # unknown: cast (free when equal)
    if current == dtype:
        return value
    return graph.call_method("to", (value, dtype))


def in_conv_layout(graph: fx.Graph, x: Any, fake: Any, conv_output: torch.Tensor) -> Any:
    """``x`` (a graph value whose layout is ``fake``'s: the conv's input as traced) relaid into
    channels-last in the graph where eager's conv took an input that is not and wrote a channels-last
    output (a channels-last weight: aten's conv then copies its input into channels-last itself); else
    ``x``.

    WHY: in the graph the relayout is Inductor's to place, and it writes x's producer's result
    channels-last in the producer's own kernel (no pass of its own), where the fused op, which Inductor
    hands x with the strides it was traced with, would pay the copy.  NOTE: the SD VAE decoder's
    GroupNorm outputs are contiguous (torch's CUDA GroupNorm does not keep channels-last), so every conv
    after one copied its input: ``aten::contiguous`` of 1x512x64x64 to 1x128x512x512 bf16 inputs inside
    the fused GroupNorm regions, 1.45 ms of a 9.5 ms step with every region fused (H200, bf16
    inference; a torch.profiler run of ``demos/realnets/sd_vae_decoder.py``)."""
    if not isinstance(fake, torch.Tensor) or fake.dim() not in (4, 5) or conv_output.dim() != fake.dim():
        return x
    fmt = torch.channels_last if fake.dim() == 4 else torch.channels_last_3d
    if conv_output.is_contiguous() or not conv_output.is_contiguous(memory_format=fmt):
        return x  # eager's conv wrote its own (contiguous) layout: nothing was copied
    if fake.is_contiguous(memory_format=fmt):
        return x
    return graph.call_method("contiguous", (x,), {"memory_format": fmt})


def bias_added_in_graph(graph: fx.Graph, out: fx.Node, bias: Any, dims: int) -> fx.Node:
    """``out + bias`` over dim 1 of ``out`` (a ``dims``-dim conv output; ``bias``: a graph value of its
    ``C`` elements, in its dtype): a conv's bias added after the fused op, where Inductor adds it.

    WHY: Inductor lowers a conv with a bias to the library conv without it and adds the bias in the
    kernel of the conv output's next op, a pass it runs anyway (a GroupNorm's statistics and normalise
    pass, a cast, a concatenation).  A fused op that adds the bias itself after a library conv reads and
    writes the conv output once more.  NOTE: the SD VAE decoder's GroupNorm -> SiLU -> conv regions at
    batch 1 (bf16, channels-last, H200, under CUDA graphs; a scratch probe of the region followed by a
    concatenation): the op's bias pass took 16-32 us of 246-390 us, the difference between a tie and a
    win on the 256-channel 256 x 256 one (Inductor 235.1 against 245.9 us with the pass)."""
    view = graph.call_method("view", (bias, -1, *([1] * (dims - 2))))
    return graph.call_function(operator.add, (out, view))


def splice_fused_call(
    ctx: MatchContext,
    region: Sequence[fx.Node],
    build: Callable[[fx.Graph], fx.Node],
    extra_dead: Sequence[fx.Node] = (),
) -> fx.Node:
    """Insert the nodes made by ``build(graph)`` before the region's last node and erase the region.

    ``build`` must take its inputs through ``ctx.resolve`` (a region may read the result of one
    rewritten before it); the replacement is recorded in ``ctx.replaced`` for the regions after.
    ``extra_dead``: nodes outside the region that may become unused (e.g. ``x.item()`` calls whose
    tensor the fused op now takes directly); each is erased only if nothing uses it any more.
    """
    graph = ctx.gm.graph
    last = region[-1]
    existing = set(graph.nodes)
    with graph.inserting_before(last):
        fused = build(graph)
    mark_cacheable([node for node in graph.nodes if node not in existing])
    fused.meta.update({k: v for k, v in last.meta.items() if k in ("example_value", "val", "stack_trace", "tensor_meta")})
    last.replace_all_uses_with(fused)
    ctx.replaced[last] = fused
    for node in reversed(region):
        graph.erase_node(node)
    for node in extra_dead:
        if not node.users and node.graph is graph:
            graph.erase_node(node)
    return fused


def mark_cacheable(nodes: Sequence[fx.Node]) -> None:
    """Let AOTAutograd's cache keep graphs that call fused ops: each fused-op call among ``nodes`` is
    marked as a wrapped function with a cache hash, the digest of the fused ops' sources
    (``ops.autograd_free.ops_source_digest``), which joins the cache key.

    WHY: a fused op is called through a Python function (``ops.conv_epilogue.conv_epilogue``...)
    that picks at trace time whether the forward saves state for a backward, from grad mode and the
    inputs' ``requires_grad`` (both in AOTAutograd's cache key).  AOTAutograd refuses to cache a
    graph that calls a Python function it cannot vouch for ("Unsupported call_function target"),
    unless the node carries ``is_wrapped`` and a ``user_cache_hash``; a torch without that escape
    ignores the marks.  NOTE: without them a second process traced every rewritten graph compiled
    through Inductor again (``counters["aot_autograd"]["autograd_cache_bypass"]``; Inductor's own
    graph cache still hit); with them it is an ``autograd_cache_hit``
    (``tests/e2e/test_backend.py::test_a_rewritten_graph_is_kept_by_aotautograds_cache``)."""
    from ..ops.autograd_free import ops_source_digest
    from ..ops.direct_impls import direct_impl

    for node in nodes:
        if node.op == "call_function" and direct_impl(node.target) is not None:
            node.meta["is_wrapped"] = True
            node.meta["user_cache_hash"] = ops_source_digest().hex()


def item_nodes_feeding(region: Sequence[fx.Node]) -> list[fx.Node]:
    """``x.item()`` nodes used by the region (candidates for ``extra_dead``)."""
    out: list[fx.Node] = []
    for node in region:
        for inp in node.all_input_nodes:
            if inp.op == "call_method" and inp.target == "item" and inp not in out:
                out.append(inp)
    return out


def dtype_name(dtype: Optional[torch.dtype]) -> Optional[str]:
    """``torch.float32`` → ``"float32"`` (the fused ops' configs carry dtype names)."""
    return None if dtype is None else str(dtype).replace("torch.", "")


def region_result(ctx: MatchContext, node: fx.Node) -> Any:
    """The fake value a region whose result is ``node`` produces: ``node``'s own, or the same value in
    the narrower dtype every reader takes it in (``narrow_read_dtype``)."""
    dtype = narrow_read_dtype(node, ctx.op)
    fake = fake_of(node)
    return fake if dtype is None else torch.empty_like(fake, dtype=dtype)


#: The tensor methods that cast their tensor (to a dtype their result's fake names).
_CAST_METHODS = ("to", "type", "bfloat16", "half")


def narrow_read_dtype(node: fx.Node, op_of: Callable[[fx.Node], Any]) -> Optional[torch.dtype]:
    """The bf16 or fp16 dtype every user of ``node`` (a floating result of a wider dtype) reads it in,
    or None: each user a conv taking ``node`` as its input and computing in that dtype (autocast
    casts the input as the conv takes it) or a cast of ``node`` to it.  ``op_of``: a node's canonical
    op (``MatchContext.op``, ``frontend.normalize.normalize_node``).

    WHY: under autocast a GroupNorm or LayerNorm runs in fp32 and the conv after it casts its input
    to bf16/fp16 as it takes it.  Inductor fuses that cast into the norm's kernel, which writes the
    narrow tensor alone; a fused op that wrote the fp32 result would write twice the bytes and leave
    the cast as a pass of its own (eager's rounding either way: the conv rounds what it reads once,
    the fused op's store rounds the same value once).  The region's timing casts its result so too
    (``runtime.region_timing.extract_region``), so both candidates write what the graph reads.
    NOTE: in the SD VAE decoder every ``conv -> group_norm -> silu`` region feeds one autocast conv:
    with every region fused, the bf16 casts of their fp32 results were 42 copy kernels, 0.34 ms of a
    6.9 ms step (H200, bf16 inference; ``python tools/profile_step.py demos/realnets/sd_vae_decoder.py
    --backends fusion-fused --mode infer --dtype bf16``)."""
    fake = fake_of(node)
    if not isinstance(fake, torch.Tensor) or not fake.is_floating_point() or not node.users:
        return None
    read = set()
    for user in node.users:
        used = fake_of(user)
        if not isinstance(used, torch.Tensor):
            return None
        op = op_of(user)
        conv_input = isinstance(op, Conv) and op.input is node and node not in (op.weight, op.bias)
        cast = user.op == "call_method" and user.target in _CAST_METHODS and user.args[0] is node
        if not (conv_input or cast):
            return None
        read.add(used.dtype)
    if len(read) != 1:
        return None
    (dtype,) = read
    if dtype not in (torch.bfloat16, torch.float16) or dtype.itemsize >= fake.dtype.itemsize:
        return None
    return dtype


#: Ops Inductor hands to a library kernel (cuDNN, cuBLAS, its attention kernels), by target name: their
#: results are written by that kernel, so a cast of one is a pass of its own.
LIBRARY_OPS = ("conv", "linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "scaled_dot_product")
#: Views: no kernel writes their result; what wrote their input counts.
_VIEWS = ("view", "reshape", "permute", "transpose", "unsqueeze", "squeeze", "flatten", "expand", "t")


#: A region copy's placeholder's meta key: whether Inductor's code writes the value it stands for in
#: the graph the region was copied from (``runtime.region_timing.extract_region``).
WRITTEN_BY_INDUCTOR = "fusion_written_by_inductor"


def written_by_inductor(ctx: MatchContext, value: Any) -> bool:
    """Whether Inductor's own code writes ``value`` (resolved through earlier rewrites): a pointwise
    op or a reduction it generates a kernel for, whose store then also casts it at no cost of its own.
    Not a graph input, a parameter, a fused op's result or a library op's (a conv, a matmul, attention);
    a view counts as what wrote its input; a region copy's input as what it stands for."""
    node = ctx.resolve(value)
    return isinstance(node, fx.Node) and node not in ctx.replaced.values() and inductor_writes(node, ctx.op)


def inductor_writes(node: fx.Node, op_of: Callable[[fx.Node], Any]) -> bool:
    """``written_by_inductor`` for a node of an unrewritten graph (``op_of``: its canonical ops)."""
    while node.op in ("call_function", "call_method") and target_name(node).lower() in _VIEWS:
        if not node.args or not isinstance(node.args[0], fx.Node):
            return False
        node = node.args[0]
    if node.op == "placeholder":
        return bool(node.meta.get(WRITTEN_BY_INDUCTOR, False))
    if node.op not in ("call_function", "call_method") or isinstance(op_of(node), Conv):
        return False
    return not any(op in target_name(node).lower() for op in LIBRARY_OPS)


def dtype_if_changed(value: torch.Tensor, conv_output: torch.Tensor) -> Optional[str]:
    """The dtype name of a region's ``value`` (a fake tensor) where it differs from the conv output's
    (autocast runs a norm in fp32 after a bf16 conv), else None: what a config's ``*_dtype`` holds."""
    return dtype_name(value.dtype) if value.dtype != conv_output.dtype else None


def rewrite_conv_region(
    ctx: MatchContext,
    candidate: Candidate,
    conv: Conv,
    operands: Sequence[fx.Node | ParamRef | Deferred],
    fused: Callable[..., Any],
    config: str,
    op_name: str,
    kernel: tuple[str, Optional[str]],
    finish: Optional[Callable[[fx.Graph, fx.Node], fx.Node]] = None,
    cast_inputs: bool = True,
    x: Optional[fx.Node] = None,
    bias_in_graph: bool = False,
) -> Match:
    """Replace a conv-anchored region by ``fused(x, weight, bias, operands, config)`` and describe it.

    With ``cast_inputs`` the conv's input, weight and bias are cast to the dtype the conv computed in
    (see ``cast_if_needed``); without, they are passed as they are and the fused op casts them itself
    (its config names the compute dtype).  Every input is resolved through earlier rewrites; a
    ``Deferred`` operand is made here, and a module parameter (``ParamRef``, e.g. a norm module's
    weight) becomes a ``get_attr`` node.
    ``finish(graph, node)`` may append nodes after the fused call (e.g. unsqueezes) and returns the
    region's new result.  ``kernel`` is the fused op's ``kernel_path`` answer, for the report.  ``x``:
    the fused op's input where it is not the conv's (a region that takes in the op computing it).
    The conv's weight may be ``Deferred`` too (a folded upsample's transposed-conv weight).
    The conv's own input is passed in the layout eager's conv ran it in (``in_conv_layout``).
    ``bias_in_graph`` (a region whose result is its conv's output): the fused op gets no bias and the
    conv's bias, in the conv's dtype, is added to its result in the graph (``bias_added_in_graph``).
    """
    conv_output = fake_of(conv.node)
    dtype = conv_output.dtype
    result = region_result(ctx, candidate.nodes[-1])  # (before the splice: it reads the result's users)

    def cast(graph: fx.Graph, value: Any) -> Any:
        return cast_if_needed(graph, value, dtype) if cast_inputs else value

    def build(graph: fx.Graph) -> fx.Node:
        source = ctx.resolve(conv.input if x is None else x)
        x_in = cast(graph, source)
        if x is None and isinstance(source, fx.Node):
            x_in = in_conv_layout(graph, x_in, fake_of(source), conv_output)
        def made(v: Any) -> Any:
            if isinstance(v, Deferred):
                return v.make(graph, tuple(ctx.resolve(i) for i in v.inputs))
            return materialize(graph, ctx.resolve(v))

        w = cast(graph, made(conv.weight))
        b = None if bias_in_graph else cast(graph, made(conv.bias))
        out = graph.call_function(fused, (x_in, w, b, [made(v) for v in operands], config))
        if bias_in_graph and conv.bias is not None:
            out = bias_added_in_graph(graph, out, cast_if_needed(graph, made(conv.bias), dtype), conv_output.dim())
        return finish(graph, out) if finish is not None else out

    fused_result = splice_fused_call(ctx, candidate.nodes, build, extra_dead=item_nodes_feeding(candidate.nodes))
    if result is not fake_of(fused_result):  # narrowed for the convs after it: its fake says so
        for key in ("example_value", "val"):
            if key in fused_result.meta:
                fused_result.meta[key] = result
        fused_result.meta.pop("tensor_meta", None)
    path, why = kernel
    return Match(
        pattern=candidate.pattern,
        nodes=tuple(n.name for n in candidate.nodes),
        source_lines=source_lines_of(candidate.nodes),
        fused_op=op_name,
        config=config,
        kernel=path if why is None else f"{path}: {why}",
        summary=candidate.summary,
    )
