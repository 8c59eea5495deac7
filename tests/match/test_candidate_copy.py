"""A candidate moves to a copy of its graph: every node it names is replaced, what was shared stays shared."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from fusion_backend.match.engine import find_regions


def _graph() -> fx.GraphModule:
    """conv2d -> leaky_relu -> * m -> max_pool2d, functional, with fake values as Dynamo records them."""
    from fusion_backend.backend import _ensure_fake_values

    gm = fx.symbolic_trace(lambda x, w, m: F.max_pool2d(F.leaky_relu(F.conv2d(x, w), 0.1) * m, 2))
    _ensure_fake_values(gm, [torch.randn(2, 3, 12, 12), torch.randn(8, 3, 3, 3), torch.randn(1, 8, 1, 1)])
    return gm


def _nodes_in(value, seen=None):
    """Every fx.Node reachable from ``value`` through dataclasses, lists, tuples and dicts."""
    import dataclasses

    seen = set() if seen is None else seen
    if isinstance(value, fx.Node):
        yield value
    elif id(value) in seen:
        return
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        seen.add(id(value))
        for f in dataclasses.fields(value):
            if f.name != "family":
                yield from _nodes_in(getattr(value, f.name), seen)
    elif isinstance(value, (list, tuple)):
        seen.add(id(value))
        for v in value:
            yield from _nodes_in(v, seen)
    elif isinstance(value, dict):
        seen.add(id(value))
        for k, v in value.items():
            yield from _nodes_in(k, seen)
            yield from _nodes_in(v, seen)


def test_a_moved_candidate_names_only_the_copys_nodes_and_rewrites_the_copy_alone():
    gm = _graph()
    regions = find_regions(gm, ["conv_epilogue"])
    ((_, candidate),) = regions.accepted
    other = fx.GraphModule(gm, fx.Graph())
    into = {}
    other.graph.output(other.graph.graph_copy(gm.graph, into, return_output_node=False))
    moved = candidate.moved(into)
    named = list(_nodes_in(moved))
    assert named and all(n.graph is other.graph for n in named)
    assert all(n.graph is gm.graph for n in _nodes_in(candidate))  # the original is untouched
    payload = moved.payload
    assert payload.pre.operands is payload.post.operands  # the chains' shared operand list stays shared
    match = candidate.rewrite_copy(other, into)
    assert match.pattern == "conv_epilogue"
    assert any("conv_epilogue" in str(n.target) for n in other.graph.nodes)
    assert not any("conv_epilogue" in str(n.target) for n in gm.graph.nodes)
