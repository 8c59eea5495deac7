"""autograd-free ops of the fused custom ops: the same kernels without ``custom_op``'s Python layers.

WHY: a ``torch.library.custom_op`` call goes C++ dispatcher -> Python autograd kernel -> redispatch ->
Python backend wrapper (alias check, Dynamo-disable wrapper) -> our function: host time a
host-bound step pays on every call (NOTE at ``register_autograd_free``).  Only *tracing* needs the autograd
layer: it is how AOTAutograd records our backward formula.  Once AOTAutograd has split the joint graph,
the forward and backward graphs that Inductor compiles never differentiate through our ops again (they
run with grad mode off).

So every fused op registers an *autograd-free op*: ``fusion::<name>_noautograd``, the same schema and fake, its CPU and CUDA
kernels registered straight with ``torch.library.Library`` (one Python crossing) and no autograd kernel
(PyTorch's C++ autograd fallback passes it through).  :class:`SwapInAutogradFreeOps`, an Inductor
post-grad pass the backend installs (:func:`with_autograd_free_pass`) where a graph it compiles holds
fused ops, retargets the graph nodes from op to autograd-free op.  Eager calls, graph
breaks and the explain report keep using the custom op itself.

NOTE: going further, a settled call plan traced into the graph Inductor compiles in the op's place
(``torch.library.wrap_triton``: Inductor compiles the conv family's kernel from its source and launches
it from its generated code) was measured slower than this op's call: ResNet-50 bf16 inference with
every region fused, 19 of its 53 calls traced, on the H200: 6.51 against 6.38 ms per step at batch
64, and 8.77 against 6.51 at batch 2 (an NCHW copy of the input), where the GPU work is nothing
(``python tools/fused_call_host.py demos/realnets/resnet50.py --dtype bf16`` for the op's side; the
traced side was a second compile of the same model with the plans traced; ``docs/perf/RESULTS.md``,
"A fused call's host time in the default mode").

Contract of :func:`register_autograd_free`: ``impl`` is the custom op's undecorated function (same arguments,
same results, no autograd), ``fake`` its fake; the autograd-free op is never differentiable (calling it on tensors
that require grad, with grad mode on, warns or raises through the autograd fallback, like any op
without an autograd formula).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from .. import sources

_LIB = torch.library.Library("fusion", "FRAGMENT")

#: fused op overload -> its autograd-free overload
_AUTOGRAD_FREE: dict[Any, Any] = {}


# NOTE: measured on the H100 host: the custom op's layers cost ~70 us per forward call and ~100 us per
# backward call (``python tools/host_overhead.py``: op forward 218 us, undecorated 149 us), and the
# training step of the ``seeds`` suite's global-mean pipeline is host-bound.
def register_autograd_free(op: Any, impl: Callable[..., Any], fake: Callable[..., Any]) -> Any:
    """Define ``<op>_noautograd`` with ``op``'s schema, CPU/CUDA kernel ``impl`` and fake ``fake``; return its
    default overload.  ``op`` is a ``torch.library.custom_op`` result."""
    overload = op._opoverload
    schema = str(overload._schema)  # "fusion::name(args) -> results"
    qualified = schema[: schema.index("(")]
    namespace, name = qualified.split("::")
    if namespace != _LIB.ns:
        raise ValueError(f"register_autograd_free: {qualified} is not in the {_LIB.ns!r} namespace the autograd-free ops are defined in")
    free_name = f"{name}_noautograd"
    _LIB.define(free_name + schema[schema.index("(") :])
    for key in ("CPU", "CUDA"):
        _LIB.impl(free_name, impl, key)
    torch.library.register_fake(f"{namespace}::{free_name}", fake, lib=_LIB)
    free_op = getattr(getattr(torch.ops, namespace), free_name).default
    _AUTOGRAD_FREE[overload] = free_op
    return free_op


def autograd_free_of(overload: Any) -> Any | None:
    """The autograd-free op registered for ``overload`` (an ``OpOverload``), or ``None``."""
    return _AUTOGRAD_FREE.get(overload)


class SwapInAutogradFreeOps(CustomGraphPass):
    """Inductor post-grad pass: call every fused op through its autograd-free op.

    Runs on forward, backward and inference graphs after AOTAutograd, where nothing differentiates
    through the fused ops any more (the training graphs run with grad mode off; an inference graph runs
    only when no input requires grad), so the autograd layer the autograd-free ops lack is never needed.  ``previous`` is a pass that was configured before
    (the user's): it runs afterwards, so nothing the user set is dropped.
    """

    def __init__(self, previous: Any = None) -> None:
        self.previous = previous

    def __call__(self, graph: fx.Graph) -> None:
        for node in graph.nodes:
            if node.op == "call_function":
                free_op = _AUTOGRAD_FREE.get(node.target)
                if free_op is not None:
                    node.target = free_op
        if self.previous is not None:
            self.previous(graph)

    def uuid(self) -> bytes | None:
        """Inductor's cache key of this pass: a digest of the fused ops' source (``ops_source_digest``)
        and the previous pass's key.

        WHY the source: Inductor's graph cache keys a custom op by its name, not by what its fake
        says, and the compiled code asserts the strides the fake gave at compile time.  An upgrade
        that changes a fake's output layout would otherwise reload code compiled for the old one and
        fail on its stride assertions (seen when the batch-norm and channel-reduction ops' saved conv
        output became channels-last).  The digest is the same in every process of one installed
        version, so a second process still hits the caches.

        NOT the registered autograd-free ops: ops register theirs when their module is first imported, so a key
        built from the registry differed between a process that had run a fused op and one that had
        not, and a second process missed Inductor's caches for every graph (``fxgraph_cache_miss``
        and ``autograd_cache_miss`` where a hit was due: a warm first call of 4.0 s against
        Inductor's 1.2 s for Conv2d 64->64 + ReLU training on the H100).  What the pass does to a graph
        is fixed by the graph: each fused op in it (registered, since it is in the graph) becomes
        its ``_noautograd`` op."""
        previous = b""
        if self.previous is not None:
            uuid = getattr(self.previous, "uuid", None)
            previous = uuid() if callable(uuid) else None
            if previous is None:  # an uncacheable user pass keeps the graph uncacheable
                return None
            previous = previous if isinstance(previous, bytes) else str(previous).encode()
        return hashlib.sha256(b"fusion-autograd-free-ops-v1:" + ops_source_digest() + previous).digest()


_PASS_KEY = "post_grad_custom_post_pass"


def with_autograd_free_pass(patches: Mapping[str, Any]) -> dict[str, Any]:
    """``patches`` (Inductor config patches) plus :class:`SwapInAutogradFreeOps` as the post-grad pass,
    chained before the pass that ``patches`` or Inductor's config already name, so nothing the user
    set is dropped.  For graphs that hold fused ops only: one without them compiles under exactly the
    caller's patches, so its code and Inductor's cache keys are those of ``backend="inductor"``."""
    previous = patches.get(_PASS_KEY, getattr(torch._inductor.config, _PASS_KEY))
    return {**patches, _PASS_KEY: SwapInAutogradFreeOps(previous)}


def ops_source_digest() -> bytes:
    """The fingerprint of ``fusion_backend/ops`` (``sources.fingerprint``): the fused ops, their fakes
    and the graph pass that calls them."""
    return bytes.fromhex(sources.fingerprint(Path(__file__).resolve().parent))
