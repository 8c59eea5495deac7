"""Time one matched region two ways: as the fused op, and as Inductor's own code for the same nodes.

WHY: a fused op that loses to Inductor's code for its region makes the model slower than
``backend="inductor"``.  Which one wins depends on the shapes, the layouts, the dtype and whether a
backward runs (a conv whose Inductor code is a cuDNN call plus one pointwise kernel is hard to beat
on a small input; a transposed 3-d conv followed by a max pool is 2-3x faster fused), so the
backend measures instead of guessing (``decision.py`` decides from these times).

Contract of :func:`extract_region`: ``nodes`` are a region as a pattern claimed it (graph order, only
the last one used outside the region).  The result is a self-contained ``GraphModule`` whose
placeholders are the region's inputs (every outside node a region node reads, in order of first
use; an ``x.item()`` feeding the region is pulled in and ``x`` becomes the input), whose output is
the one-tuple of the region's result (cast to the narrower dtype every reader in the graph takes it
in: ``match.rewrite.narrow_read_dtype``), and whose nodes carry the original fake values (each
placeholder also whether Inductor's code writes what it stands for, which decides where a fused op's
input cast goes: ``match.rewrite.written_by_inductor``).  Where the
region sits inside an autocast block recorded in the graph (``_enter_autocast``), the copy enters
and leaves the same block.  A region whose inputs are not all tensors (symbolic scalars) raises
:class:`NotMeasurable`.

Contract of :func:`time_steps`: two times per call of each zero-argument step, after two warm-up
calls (which compile, autotune and fill caches), one pair per round (:class:`RoundTimes`): the steps
take turns, round after round, so the i-th numbers of two steps were measured side by side.

- *per call*: wall-clock milliseconds of back-to-back calls ended by a device synchronisation.  A
  small region is host-bound, and the host time per call is part of what the user waits for when
  the model around it is small too.
- *GPU*: milliseconds of device work per call, measured with the host ahead of the device: the
  stream first runs a sleep kernel long enough for the host to queue all of the round's calls, so
  the device runs them back to back and the events around them see no host gaps.  In a network
  that keeps the GPU busy, this is what the region costs.
- *host*: milliseconds of host time per call, from the same round: how long the host took to queue
  the calls while the device was busy with the sleep (at most the time per call).  What the region
  adds to a step whose host is the bottleneck.

WHY per call and on the GPU: a host-bound region can win per call and lose on the GPU (measured:
``time_steps``).  For a region on the CPU the three are the same number.
"""

from __future__ import annotations

import copy
import functools
import math
import operator
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import is_fake

from .. import gpu_timing
from ..frame_room import call_with_frame_room
from ..frontend.normalize import AUTOCAST_ENTER, AUTOCAST_EXIT, AUTOCAST_MARKERS, normalize_node, target_name
from ..ir.fakes import fake_of, size_hint
from ..match.rewrite import LIBRARY_OPS, WRITTEN_BY_INDUCTOR, inductor_writes, narrow_read_dtype

#: Timing: rounds per candidate (interleaved), the length one round aims at, the most calls in one.
ROUNDS = 5
ROUND_MS = 15.0
MAX_CALLS = 200


class NotMeasurable(Exception):
    """The region cannot be timed on its own; the message says why (it ends up in the report)."""


@dataclass
class ExtractedRegion:
    """A region copied into its own graph (see the module docstring)."""

    graph: fx.Graph
    root: fx.GraphModule
    """The module the region was extracted from: what the graph's ``get_attr`` nodes read."""
    inputs: list[fx.Node]
    """The original graph's nodes that feed the region, in placeholder order."""
    result: fx.Node
    """The original graph's node whose value is the region's result."""
    copies: dict[fx.Node, fx.Node] = field(default_factory=dict)
    """Each node of the original graph the region holds or reads -> its copy in ``graph`` (a
    placeholder or ``get_attr`` for what it reads)."""

    @functools.cached_property
    def gm(self) -> fx.GraphModule:
        """The region as a module, built at its first use.  WHY: building a module generates and
        compiles its Python code, most of an extraction's time, and a decision found in the cache
        needs only the graph (its key)."""
        return fx.GraphModule(self.root, self.graph, class_name="Region")

    def copy(self) -> fx.GraphModule:
        """A module of its own over a copy of the graph, for what mutates what it is given
        (Inductor's ``compile_fx``, a rewrite)."""
        return fx.GraphModule(self.root, copy.deepcopy(self.graph), class_name="Region")

    def copy_mapped(self) -> tuple[fx.GraphModule, dict[fx.Node, fx.Node]]:
        """``copy()``, and each node of the original graph in ``copies`` -> its node in that copy (what
        a candidate found in the original graph is rewritten through: ``Candidate.rewrite_copy``)."""
        graph = fx.Graph()
        into: dict[fx.Node, fx.Node] = {}
        out = graph.graph_copy(self.graph, into)
        graph.output(out)
        gm = fx.GraphModule(self.root, graph, class_name="Region")
        return gm, {original: into[mine] for original, mine in self.copies.items()}


def extract_region(gm: fx.GraphModule, nodes: Sequence[fx.Node]) -> ExtractedRegion:
    """Copy ``nodes`` of ``gm`` into a graph of their own (see the module docstring)."""
    members = list(nodes)
    inside = set(members)
    inputs: list[fx.Node] = []

    def note_input(node: fx.Node) -> None:
        if node not in inside and node not in inputs:
            inputs.append(node)

    for node in list(members):
        for source in node.all_input_nodes:
            if source in inside:
                continue
            if source.op == "call_method" and source.target == "item" and isinstance(source.args[0], fx.Node):
                inside.add(source)
                members.insert(0, source)
    for node in members:
        for source in node.all_input_nodes:
            note_input(source)
    for source in inputs:
        if source.op == "get_attr":
            continue
        if not isinstance(fake_of(source), torch.Tensor):
            raise NotMeasurable(f"the region reads `{source.name}`, which is not a tensor "
                                f"({type(fake_of(source)).__name__})")

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    op_of = functools.partial(normalize_node, root=gm)
    for i, source in enumerate(inputs):
        if source.op == "get_attr":
            env[source] = graph.get_attr(source.target)
            continue
        placeholder = graph.placeholder(f"input_{i}")
        placeholder.meta["example_value"] = fake_of(source)
        # (where the cast of an input goes depends on what writes it in the graph: ``written_by_inductor``)
        placeholder.meta[WRITTEN_BY_INDUCTOR] = inductor_writes(source, op_of)
        env[source] = placeholder
    blocks = [graph.call_function(AUTOCAST_ENTER, enter.args, enter.kwargs) for enter in _open_autocast_blocks(gm, nodes[0])]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in sorted(members, key=order.__getitem__):
        env[node] = graph.node_copy(node, lambda n: env[n])
    for block in reversed(blocks):
        graph.call_function(AUTOCAST_EXIT, (block,))
    result = env[nodes[-1]]
    narrow = narrow_read_dtype(nodes[-1], op_of)
    if narrow is not None:  # what the graph reads of it: the narrow copy alone (``narrow_read_dtype``)
        result = graph.call_method("to", (result, narrow))
        result.meta["example_value"] = torch.empty_like(fake_of(nodes[-1]), dtype=narrow)
    graph.output((result,))
    inputs = [n for n in inputs if n.op != "get_attr"]
    return ExtractedRegion(graph, gm, inputs, nodes[-1], dict(env))


#: In-place operators: a region's consumers may not write to a tensor (timing runs the copy many times and
#: must not touch the user's tensors), nor be library ops (``match.rewrite.LIBRARY_OPS``: the compute a
#: later region would claim).
_IN_PLACE_OPERATORS = {getattr(operator, n) for n in dir(operator)
                       if n.startswith("i") and (n[1:] in dir(operator) or f"{n[1:]}_" in dir(operator))}

#: Most consumer nodes one region grows by for timing.
MAX_CONSUMERS = 16


def with_consumers(gm: fx.GraphModule, nodes: Sequence[fx.Node]) -> list[fx.Node]:
    """``nodes`` followed by the chain of their result's consumers that Inductor would fuse into the
    code of the region's last op: while the last node has exactly one user, and that user is a cheap
    op (no conv / matmul, not in-place), no larger than the region's result, and in the same autocast
    state, it joins (at most :data:`MAX_CONSUMERS`).

    WHY: timed alone, Inductor's code for a region pays for a kernel that in the whole graph it fuses
    with what follows (a global mean fused with the bias, logsumexp and sum after it), while the
    fused op's output still goes through that following code: the region alone made the fused op
    look 1.12x faster where the model was 0.76x as fast (``conv2d`` transposed, global mean, then
    logsumexp, batch 128 of 3x32x32, H100).  Timed with its consumers, both candidates run the same
    following ops, each the way the compiled graph will."""
    grown = list(nodes)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    limit = _numel_hint(fake_of(nodes[-1]))
    if limit is None:
        return grown
    markers = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in AUTOCAST_MARKERS]
    while len(grown) < len(nodes) + MAX_CONSUMERS:
        users = list(grown[-1].users)
        if len(users) != 1:
            break
        user = users[0]
        if not _cheap_consumer(user, limit):
            break
        if any(order[grown[0]] < order[m] < order[user] for m in markers):
            break  # it runs in another autocast state than the region
        grown.append(user)
    return grown


def _cheap_consumer(node: fx.Node, max_numel: int) -> bool:
    if node.op not in ("call_function", "call_method"):
        return False
    name = target_name(node).lower()
    if not name or name in ("setitem", "item") or any(op in name for op in LIBRARY_OPS):
        return False
    in_place = (name.endswith("_") and not name.endswith("__") or name.startswith("__i")
                or node.target in _IN_PLACE_OPERATORS or node.kwargs.get("inplace") is True)
    if in_place:
        return False
    numel = _numel_hint(fake_of(node))
    return numel is not None and numel <= max_numel


def numel_hint(node: fx.Node) -> int | None:
    """Elements of ``node``'s value at its sizes' example values, or None where it is no tensor."""
    return _numel_hint(fake_of(node))


def _numel_hint(value: Any) -> int | None:
    """Elements of a fake tensor at its sizes' example values (no guard on symbolic sizes), or None."""
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return math.prod(_hint(s) for s in value.shape)
    except NotMeasurable:
        return None


def _open_autocast_blocks(gm: fx.GraphModule, first: fx.Node) -> list[fx.Node]:
    """The ``_enter_autocast`` nodes of ``gm`` still open where ``first`` runs, outermost first."""
    if AUTOCAST_ENTER is None:
        return []
    open_blocks: list[fx.Node] = []
    for node in gm.graph.nodes:
        if node is first:
            break
        if node.op != "call_function":
            continue
        if node.target is AUTOCAST_ENTER:
            open_blocks.append(node)
        elif node.target is AUTOCAST_EXIT and node.args and node.args[0] in open_blocks:
            open_blocks.remove(node.args[0])
    return open_blocks


def region_inputs(region: ExtractedRegion, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> list[torch.Tensor]:
    """Real tensors for the region's placeholders: the graph's own example inputs where the region
    reads a graph input that is a real tensor (detached, so that timing a backward never touches the
    user's ``.grad``), else fresh random tensors with the recorded shape, strides, dtype, device and
    ``requires_grad`` (symbolic sizes take their hints).  Example inputs may be fake: DDPOptimizer
    compiles each bucket's piece of the graph with fake activations and real parameters.  The
    running statistics a training-mode batch norm of the region updates are copies: timing the
    region many times must not move the model's own."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    given = dict(zip(placeholders, example_inputs, strict=False))
    updated = _updated_inputs(region)
    out = []
    for node in region.inputs:
        fake = fake_of(node)
        value = given.get(node)
        if isinstance(value, torch.Tensor) and not is_fake(value):
            out.append(value.detach().clone() if node in updated else value.detach().requires_grad_(value.requires_grad))
            continue
        out.append(random_like(fake))
    return out


def _updated_inputs(region: ExtractedRegion) -> set[fx.Node]:
    """The region's inputs that it updates in place: running statistics of a training-mode batch norm."""
    from ..frontend.canonical import BatchNorm
    from ..frontend.normalize import normalize_graph

    placeholders = [n for n in region.gm.graph.nodes if n.op == "placeholder"]
    original = dict(zip(placeholders, region.inputs, strict=False))
    updated = set()
    for op in normalize_graph(region.gm).values():
        if isinstance(op, BatchNorm) and op.training:
            updated |= {original[v] for v in (op.running_mean, op.running_var) if v in original}
    return updated


def random_like(fake: torch.Tensor) -> torch.Tensor:
    """A real tensor shaped, strided and typed like ``fake`` (values: standard normal, or 0/1 for
    integer and boolean tensors), a leaf that requires grad when ``fake`` does."""
    shape = [_hint(s) for s in fake.shape]
    stride = [_hint(s) for s in fake.stride()]
    t = torch.empty_strided(shape, stride, dtype=fake.dtype, device=fake.device)
    if t.is_floating_point() or t.is_complex():
        t.normal_()
    else:
        t.random_(0, 2)
    return t.requires_grad_(bool(fake.requires_grad) and t.is_floating_point())


def _hint(size: Any) -> int:
    hint = size_hint(size)
    if hint is None:
        raise NotMeasurable(f"size {size} has no example value (an unbacked symbol)")
    return hint


def make_step(fn: Callable[..., Any], inputs: Sequence[torch.Tensor], train: bool) -> Callable[[], None]:
    """A zero-argument call of ``fn(*inputs)`` (its first output), and with ``train`` also a backward
    with a fixed random gradient into every input that requires grad."""
    leaves = [t for t in inputs if t.requires_grad]
    grad: list[torch.Tensor] = []

    def forward() -> torch.Tensor:
        out = fn(*inputs)
        return out[0] if isinstance(out, (tuple, list)) else out

    if not train:
        def infer() -> None:
            forward()
        return infer

    def step() -> None:
        for leaf in leaves:
            leaf.grad = None
        out = forward()
        if not grad:
            grad.append(torch.randn_like(out))
        out.backward(grad[0])

    return step


def compile_with_inductor(region: ExtractedRegion, inputs: Sequence[torch.Tensor],
                          config_patches: Mapping[str, Any]) -> Callable[..., Any]:
    """Inductor's code for the region (on a copy: ``compile_fx`` may mutate what it compiles)."""
    return compile_apart(region.copy(), inputs, config_patches)


def compile_apart(gm: fx.GraphModule, inputs: Sequence[torch.Tensor],
                  config_patches: Mapping[str, Any]) -> Callable[..., Any]:
    """``compile_fx`` for a timing candidate, apart from the outer Dynamo compile that is running.

    - The backward is compiled right away (``force_non_lazy_backward_lowering``): a lazy backward
      compile would run at the first timed backward, inside the outer compile, whose metrics
      context refuses a second ``is_forward``.
    - ``tracing(None)`` keeps this compile out of the outer graph's tracing context (its fake mode,
      shape guards and output strides).
    - Dynamo's ``aot_autograd`` counters are left as they were.  DDPOptimizer decides whether the
      backend ran AOTAutograd on its piece of the graph by comparing ``counters["aot_autograd"]
      ["total"]`` before and after the backend call; a timing compile counted there makes it look
      for the piece's forward metadata when the backend returns the direct runner, and it fails
      (``fw_metadata must not be None``).
      NOTE: ``pytest tests/e2e/test_decision.py -k ddp_pieces`` fails that way without the restore."""
    from torch._dynamo.utils import counters
    from torch._inductor.compile_fx import compile_fx

    saved = counters["aot_autograd"].copy()
    try:
        with torch._functorch.config.patch(force_non_lazy_backward_lowering=True), torch._guards.tracing(None):
            return compile_fx(gm, list(inputs), config_patches=dict(config_patches) or None)
    finally:
        counters["aot_autograd"] = saved


@dataclass(frozen=True)
class RoundTimes:
    """One step's milliseconds per call, one entry per round (see the module docstring).  Without
    ``host_ms`` (an empty list) the host time is taken to be the time per call (an upper bound)."""

    per_call_ms: list[float]
    gpu_ms: list[float]
    host_ms: list[float] = field(default_factory=list)


# NOTE: the fused global-mean op on Conv2d 512->512 3x3 at 32x512x7x7
# (``demos/convnets/conv2d_512_k3_global_mean.py``), training, fp32, measured 0.93 ms per call against
# Inductor's 1.13 ms while its kernels ran 744 us per step against Inductor's 178 us (``torch.profiler``
# on the H100); kept on the per-call time alone, the benchmark's step measured 0.90-0.96x Inductor's
# (``python -m fusion_backend bench --suite demos/convnets/conv2d_512_k3_global_mean.py --mode train
# --backends eager,inductor,fusion,inductor:default``): hence the GPU time beside the time per call.
def time_steps(steps: Mapping[str, Callable[[], None]], *, on_cuda: bool) -> dict[str, RoundTimes]:
    """Milliseconds per call of each step, per round, per call and on the GPU (see the module
    docstring); ``on_cuda``: the steps run on a CUDA device (else the GPU time is the time per call,
    even where a GPU is present)."""
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    calls = calls_per_round(steps, sync, ROUND_MS)
    rounds = {name: RoundTimes([], [], []) for name in steps}
    for _ in range(ROUNDS):
        for name, step in steps.items():
            per_call_ms = time_per_call(step, calls[name], sync)
            gpu_ms, host_ms = _gpu_and_host_ms(step, calls[name], per_call_ms) if on_cuda else (per_call_ms,) * 2
            rounds[name].per_call_ms.append(per_call_ms)
            rounds[name].gpu_ms.append(gpu_ms)
            rounds[name].host_ms.append(host_ms)
    return rounds


def calls_per_round(steps: Mapping[str, Callable[[], None]], sync: Callable[[], None], round_ms: float,
                    min_calls: int = 1, max_calls: int = MAX_CALLS) -> dict[str, int]:
    """Per step, after two warm-up calls (compiles, autotuning, caches), the number of calls (from
    ``min_calls`` to ``max_calls``) that makes a round of about ``round_ms``, from one timed call."""
    calls: dict[str, int] = {}
    for name, step in steps.items():
        step()
        step()
        sync()
        once_ms = time_per_call(step, 1, sync)
        calls[name] = max(min_calls, min(max_calls, math.ceil(round_ms / max(once_ms, 1e-3))))
    return calls


def time_per_call(step: Callable[[], None], calls: int, sync: Callable[[], None]) -> float:
    """Milliseconds per call of ``calls`` back-to-back calls of ``step``, ended by ``sync()`` (called with
    room on the frame stack: ``frame_room.py``)."""

    def timed() -> float:
        sync()
        began = time.perf_counter()
        for _ in range(calls):
            step()
        sync()
        return (time.perf_counter() - began) * 1e3 / calls

    return call_with_frame_room(timed)


def _gpu_and_host_ms(step: Callable[[], None], calls: int, per_call_ms: float) -> tuple[float, float]:
    """Device and host milliseconds per call of ``calls`` calls of ``step`` (the device idle: called
    right after a synchronisation), queued behind a spin covering the host's time for those calls
    (``per_call_ms`` each, measured just before) with room to spare; if the host still outlasted
    the spin, once more behind a spin twice its enqueueing time, and then that number (an upper
    bound: the device may have waited on the host).  The host time is the enqueueing time per call,
    at most ``per_call_ms`` (a launch queue that filled up makes the host wait on the device)."""
    cover_ms = 1.25 * per_call_ms * calls + 0.5
    gpu_ms, enqueue_ms = gpu_timing.queued_ms(step, calls, cover_ms)
    if enqueue_ms >= cover_ms:
        gpu_ms, enqueue_ms = gpu_timing.queued_ms(step, calls, 2 * enqueue_ms + 0.5)
    return gpu_ms, min(enqueue_ms / calls, per_call_ms)


def canonical_text(region: ExtractedRegion) -> str:
    """The region's computation as text that does not depend on node names (a cache key part):
    one line per node with its op, target and arguments, nodes named by position."""
    index: dict[fx.Node, str] = {}
    lines = []
    for i, node in enumerate(region.graph.nodes):
        index[node] = f"%{i}"
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: index[n])
        lines.append(f"{node.op} {target_text(node.target)} {args!r}")
    return "\n".join(lines)


def target_text(target: Any) -> str:
    """A node's target as text that names the same function in every process (no address)."""
    if isinstance(target, str):
        return target
    if target in (operator.getitem,):
        return "getitem"
    module = getattr(target, "__module__", "") or ""
    return f"{module}.{getattr(target, '__name__', None) or getattr(target, '__qualname__', repr(target))}"
