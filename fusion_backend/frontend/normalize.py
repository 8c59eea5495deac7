"""Normalisation: every FX node of a Dynamo (or symbolically traced) graph → one canonical op.

Why a table of spellings rather than ``torch.fx.subgraph_rewriter``: Dynamo records the op the user
called (``torch.conv_transpose3d`` with every argument positional, ``F.leaky_relu(x, 0.2, False)``,
``call_method "mul_"``, ``operator.mul`` with the tensor on either side...), so one semantic op
arrives in many shapes.  Each spelling is bound here against the Python signature of the op it
stands for, which handles positional and keyword arguments alike; patterns then see one form.

``functionalize_inplace`` rewires later uses of a tensor mutated in place by a pointwise op to the
op's result (they alias), so chains spelled with ``relu_``/``mul_``/``inplace=True`` look the same as
out-of-place ones.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ..ir.specs import ConvSpec, PoolSpec
from ..ops.chain import PointwiseKind as K
from .canonical import (
    BatchNorm,
    CanonicalOp,
    Conv,
    GlobalReduce,
    GroupNorm,
    LayerNorm,
    Opaque,
    ParamRef,
    Pointwise,
    Pool,
    Reduce,
    Upsample,
)

# --------------------------------------------------------------------------------------------
# Signatures the spellings are bound against (argument names as in torch's own docs).


def _sig_conv(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1): ...
def _sig_conv_t(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1): ...
def _sig_convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups): ...
def _sig_unary(input, inplace=False): ...
def _sig_leaky(input, negative_slope=0.01, inplace=False): ...
def _sig_gelu(input, approximate="none"): ...
def _sig_hardtanh(input, min_val=-1.0, max_val=1.0, inplace=False): ...
def _sig_clamp(input, min=None, max=None): ...
def _sig_clamp_min(input, min): ...
def _sig_clamp_max(input, max): ...
def _sig_binary(input, other, *, alpha=1, out=None): ...
def _sig_div(input, other, *, rounding_mode=None, out=None): ...
def _sig_neg(input): ...
def _sig_min_max(input, other, *, out=None): ...
def _sig_max_pool(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False): ...
def _sig_avg_pool(input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None): ...
def _sig_reduce(input, dim=None, keepdim=False, *, dtype=None): ...
def _sig_adaptive(input, output_size): ...
def _sig_min_max_dim(input, dim, keepdim=False): ...
def _sig_amin_amax(input, dim=(), keepdim=False): ...
def _sig_logsumexp(input, dim, keepdim=False): ...
def _sig_softmax(input, dim=None, _stacklevel=3, dtype=None): ...
def _sig_batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1,
                    eps=1e-05): ...
def _sig_group_norm(input, num_groups, weight=None, bias=None, eps=1e-05, cudnn_enabled=True): ...
def _sig_layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-05, cudnn_enable=True): ...
def _sig_instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None, use_input_stats=True,
                       momentum=0.1, eps=1e-05, cudnn_enabled=True): ...
def _sig_torch_instance_norm(input, weight, bias, running_mean, running_var, use_input_stats, momentum, eps,
                             cudnn_enabled): ...


def _sig_interpolate(input, size=None, scale_factor=None, mode="nearest", align_corners=None,
                     recompute_scale_factor=None, antialias=False): ...
def _sig_upsample_nearest(input, size=None, scale_factor=None): ...


def _bind(sig_fn: Callable[..., Any], args: tuple, kwargs: dict) -> Optional[dict[str, Any]]:
    try:
        bound = inspect.signature(sig_fn).bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def _tuple(value: Any, n: int) -> tuple:
    if isinstance(value, (list, tuple)):
        if len(value) == 1:
            return tuple(value) * n
        return tuple(value)
    return (value,) * n


# --------------------------------------------------------------------------------------------
# Spelling tables.  Keys are call_function targets (compared by identity) or call_method names.

_CONV_FUNCS: dict[Any, tuple[int, bool]] = {
    torch.conv1d: (1, False),
    torch.conv2d: (2, False),
    torch.conv3d: (3, False),
    torch.conv_transpose1d: (1, True),
    torch.conv_transpose2d: (2, True),
    torch.conv_transpose3d: (3, True),
}


def _by_function(*spellings: tuple[K, Any, Any]) -> dict[Any, tuple[K, bool]]:
    """``{function: (kind, in_place)}`` from ``(kind, out-of-place function, in-place function or None)``."""
    table: dict[Any, tuple[K, bool]] = {}
    for kind, function, inplace_function in spellings:
        table[function] = (kind, False)
        if inplace_function is not None:
            table[inplace_function] = (kind, True)
    return table


_UNARY_FUNCS = _by_function(
    (K.RELU, torch.relu, torch.relu_), (K.SIGMOID, torch.sigmoid, torch.sigmoid_), (K.SIGMOID, F.sigmoid, None),
    (K.TANH, torch.tanh, torch.tanh_), (K.TANH, F.tanh, None),
)

# Functions with an ``inplace`` flag: F.relu(x, inplace=True) etc.
_INPLACE_FLAG_FUNCS: dict[Any, K] = {
    F.relu: K.RELU,
    F.silu: K.SILU,
    F.hardswish: K.HARDSWISH,
    F.mish: K.MISH,
}
_C_NN = torch._C._nn
_ALWAYS_INPLACE_FUNCS: dict[Any, K] = {}
for _name, _kind in (("silu_", K.SILU), ("hardswish_", K.HARDSWISH), ("mish_", K.MISH)):
    if hasattr(_C_NN, _name):
        _ALWAYS_INPLACE_FUNCS[getattr(_C_NN, _name)] = _kind
for _name, _kind in (("silu", K.SILU), ("hardswish", K.HARDSWISH), ("mish", K.MISH)):
    if hasattr(_C_NN, _name):
        _UNARY_FUNCS[getattr(_C_NN, _name)] = (_kind, False)

_LEAKY_FUNCS: dict[Any, bool] = {F.leaky_relu: False, _C_NN.leaky_relu: False, _C_NN.leaky_relu_: True}
_GELU_FUNCS = {_C_NN.gelu, F.gelu}
_HARDTANH_FUNCS: dict[Any, bool] = {F.hardtanh: False, _C_NN.hardtanh: False, _C_NN.hardtanh_: True}
_RELU6_FUNCS = {F.relu6} | ({_C_NN.relu6} if hasattr(_C_NN, "relu6") else set())
_CLAMP_FUNCS: dict[Any, bool] = {torch.clamp: False, torch.clip: False, torch.clamp_: True, torch.clip_: True}
_CLAMP_MIN_FUNCS: dict[Any, bool] = {torch.clamp_min: False, torch.clamp_min_: True}
_CLAMP_MAX_FUNCS: dict[Any, bool] = {torch.clamp_max: False, torch.clamp_max_: True}

_BINARY_FUNCS = _by_function(
    (K.MUL, operator.mul, operator.imul), (K.MUL, torch.mul, None), (K.MUL, torch.multiply, None),
    (K.ADD, operator.add, operator.iadd), (K.ADD, torch.add, None),
    (K.SUB, operator.sub, operator.isub), (K.SUB, torch.sub, None), (K.SUB, torch.subtract, None),
    (K.DIV, operator.truediv, operator.itruediv), (K.DIV, torch.div, None), (K.DIV, torch.divide, None),
    (K.DIV, torch.true_divide, None),
)
_NEG_FUNCS = {operator.neg, torch.neg, torch.negative}
#: Elementwise minimum / maximum of two tensors; ``torch.min`` / ``torch.max`` are that only when
#: their second argument is a tensor (an int there is a reduction's dim).
_MIN_MAX_FUNCS: dict[Any, K] = {torch.minimum: K.MINIMUM, torch.maximum: K.MAXIMUM}
_MIN_MAX_OVERLOADED: dict[Any, K] = {torch.min: K.MINIMUM, torch.max: K.MAXIMUM}

_METHOD_UNARY: dict[str, K] = {"relu": K.RELU, "sigmoid": K.SIGMOID, "tanh": K.TANH}
_METHOD_BINARY: dict[str, K] = {
    "mul": K.MUL, "multiply": K.MUL, "add": K.ADD, "sub": K.SUB, "subtract": K.SUB,
    "div": K.DIV, "divide": K.DIV, "true_divide": K.DIV,
    "__mul__": K.MUL, "__rmul__": K.MUL, "__add__": K.ADD, "__radd__": K.ADD,
    "__sub__": K.SUB, "__truediv__": K.DIV,
}

_MAX_POOL_FUNCS = {F.max_pool1d: 1, F.max_pool2d: 2, F.max_pool3d: 3, torch.max_pool1d: 1, torch.max_pool2d: 2, torch.max_pool3d: 3}
_AVG_POOL_FUNCS = {F.avg_pool1d: 1, F.avg_pool2d: 2, F.avg_pool3d: 3}
_ADAPTIVE_AVG_FUNCS = {F.adaptive_avg_pool1d: 1, F.adaptive_avg_pool2d: 2, F.adaptive_avg_pool3d: 3}
_REDUCE_FUNCS = {torch.mean: "mean", torch.sum: "sum"}
#: Reductions that are not a plain mean or sum (``Reduce``), by function; min / max are
#: ``_MIN_MAX_OVERLOADED`` (a reduction only with an int ``dim``).
_AMIN_AMAX_FUNCS = {torch.amin: "amin", torch.amax: "amax"}
_LOGSUMEXP_FUNCS = {torch.logsumexp, torch.special.logsumexp}
_SOFTMAX_FUNCS = {torch.softmax: "softmax", F.softmax: "softmax", torch.log_softmax: "log_softmax",
                  F.log_softmax: "log_softmax", torch.special.softmax: "softmax",
                  torch.special.log_softmax: "log_softmax"}

#: Nearest-neighbour upsamples: ``F.interpolate`` and ``F.upsample`` with ``mode="nearest"`` (or
#: "nearest-exact": the same indices at an integer scale), ``F.upsample_nearest``.
_INTERPOLATE_FUNCS = {F.interpolate, F.upsample}
_NEAREST_MODES = ("nearest", "nearest-exact")

_POINTWISE_MODULES: dict[type, K] = {
    nn.ReLU: K.RELU, nn.SiLU: K.SILU, nn.Sigmoid: K.SIGMOID, nn.Tanh: K.TANH,
    nn.Hardswish: K.HARDSWISH, nn.Mish: K.MISH,
}


# --------------------------------------------------------------------------------------------


#: What Dynamo records an autocast block in the graph as: ``_enter_autocast(...)`` and ``_exit_autocast(enter)``
#: calls (None on a torch without them).  No kernels, no tensor values: the casts are nodes of their own.
AUTOCAST_ENTER = getattr(torch.amp.autocast_mode, "_enter_autocast", None)
AUTOCAST_EXIT = getattr(torch.amp.autocast_mode, "_exit_autocast", None)
AUTOCAST_MARKERS = frozenset(t for t in (AUTOCAST_ENTER, AUTOCAST_EXIT) if t is not None)


def target_name(node: fx.Node) -> str:
    """The bare name of what a node calls: a method's name, a function's ``__name__`` (``softmax``,
    ``group_norm``), ``""`` for anything else."""
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")


def describe_target(node: fx.Node) -> str:
    """A readable name of what a node calls (``torch.nn.functional.softmax``, ``.view``, ...)."""
    if node.op == "call_method":
        return f".{node.target}()"
    if node.op == "call_module":
        return f"module {node.target}"
    target = node.target
    if node.op == "call_function":
        module = getattr(target, "__module__", None) or ""
        name = getattr(target, "__name__", str(target))
        module = module.replace("_operator", "operator").replace("torch._C._nn", "torch._C._nn")
        return f"{module}.{name}" if module else name
    return node.op


def normalize_node(node: fx.Node, root: Optional[torch.nn.Module] = None) -> CanonicalOp:
    """Return the canonical op of ``node``.  Never raises for an unknown op: that is ``Opaque``."""
    try:
        if node.op == "call_function":
            result = _normalize_function(node, node.target, node.args, dict(node.kwargs))
        elif node.op == "call_method":
            result = _normalize_method(node)
        elif node.op == "call_module" and root is not None:
            result = _normalize_module(node, root)
        else:
            result = None
    except _Unsupported as exc:
        return Opaque(node, f"{describe_target(node)} ({exc})")
    return result if result is not None else Opaque(node, describe_target(node))


def normalize_graph(gm: fx.GraphModule) -> dict[fx.Node, CanonicalOp]:
    """Canonical op of every node, in graph order."""
    return {node: normalize_node(node, gm) for node in gm.graph.nodes}


class _Unsupported(Exception):
    """A known op with arguments that have no canonical form (e.g. ``padding="same"`` with an even
    kernel, ``rounding_mode="floor"``); becomes an ``Opaque`` whose description says why."""


def _conv(node: fx.Node, dims: int, transposed: bool, b: dict[str, Any]) -> Conv:
    padding = b["padding"]
    if isinstance(padding, str):
        if padding == "valid":
            padding = 0
        else:
            raise _Unsupported(f"padding={padding!r} is only supported as 'valid'")
    spec = ConvSpec(
        transposed=transposed,
        stride=_tuple(b["stride"], dims),
        padding=_tuple(padding, dims),
        dilation=_tuple(b["dilation"], dims),
        output_padding=_tuple(b.get("output_padding", 0), dims),
        groups=int(b["groups"]),
    )
    for name, values in (("stride", spec.stride), ("padding", spec.padding), ("dilation", spec.dilation), ("output_padding", spec.output_padding)):
        if not all(isinstance(v, int) for v in values):
            raise _Unsupported(f"{name}={values} is not a tuple of Python ints")
    return Conv(node, b["input"], b["weight"], b["bias"], spec)


def _pool(node: fx.Node, kind: str, dims: int, b: dict[str, Any]) -> Pool:
    kernel = _tuple(b["kernel_size"], dims)
    stride = b["stride"]
    stride = kernel if stride is None or (isinstance(stride, (list, tuple)) and len(stride) == 0) else _tuple(stride, dims)
    unsupported = None
    if kind == "max":
        if b["return_indices"]:
            unsupported = "return_indices=True"
        elif any(d != 1 for d in _tuple(b["dilation"], dims)):
            unsupported = f"dilation={b['dilation']}"
    spec = PoolSpec(
        kind=kind,
        kernel_size=kernel,
        stride=stride,
        padding=_tuple(b["padding"], dims),
        ceil_mode=bool(b["ceil_mode"]),
        count_include_pad=bool(b.get("count_include_pad", True)),
        divisor_override=b.get("divisor_override"),
    )
    return Pool(node, b["input"], dims, spec, unsupported)


def _upsample(node: fx.Node, b: dict[str, Any]) -> Optional[Upsample]:
    """A nearest-neighbour upsample, or None for another mode (an ``Opaque``: no pattern reads it)."""
    if b.get("mode", "nearest") not in _NEAREST_MODES or b.get("antialias"):
        return None
    scale = b["scale_factor"]
    if scale is not None and not (isinstance(scale, (int, float)) or (
            isinstance(scale, (list, tuple)) and all(isinstance(s, (int, float)) for s in scale))):
        raise _Unsupported(f"scale_factor={scale!r} is not a number or a tuple of numbers")
    return Upsample(node, b["input"], None if scale is None else tuple(scale) if isinstance(scale, (list, tuple))
                    else float(scale))


def _reduce(node: fx.Node, kind: str, b: Optional[dict[str, Any]]) -> Optional[GlobalReduce | Reduce]:
    """A mean or sum: ``GlobalReduce``, or with a ``dtype=`` argument a ``Reduce`` that says so."""
    if b is None:
        return None
    if b.get("dtype") is not None:
        return _dims_reduce(node, kind, b)
    dim = b["dim"]
    dims = None if dim is None else tuple(dim) if isinstance(dim, (list, tuple)) else (dim,)
    if dims is not None and not all(isinstance(d, int) for d in dims):
        return None
    return GlobalReduce(node, b["input"], kind, dims, bool(b["keepdim"]))


def _reduce_dims(dim: Any) -> Optional[tuple[int, ...]] | str:
    """``dim`` as a tuple of ints, None for every dim (``None`` or ``()``), or "bad" for anything
    else (a traced value)."""
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return None
    dims = tuple(dim) if isinstance(dim, (list, tuple)) else (dim,)
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        return "bad"
    return dims


def _dims_reduce(node: fx.Node, kind: str, b: Optional[dict[str, Any]]) -> Optional[Reduce]:
    """``amin`` / ``amax`` / ``logsumexp`` (and sum / mean with a dtype) bound to their signature."""
    if b is None:
        return None
    dims = _reduce_dims(b["dim"])
    if dims == "bad" or not isinstance(b["keepdim"], bool):
        return None
    return Reduce(node, b["input"], kind, dims, b["keepdim"], b.get("dtype"))


def _min_max_reduction(node: fx.Node, kind: K, args: tuple, kwargs: dict) -> Optional[Reduce]:
    """``torch.min(x, dim[, keepdim])`` / ``max``: a (values, indices) reduction, when ``dim`` is an int."""
    b = _bind(_sig_min_max_dim, args, kwargs)
    if not b or not isinstance(b["dim"], int) or isinstance(b["dim"], bool) or not isinstance(b["keepdim"], bool):
        return None
    return Reduce(node, b["input"], "min" if kind is K.MINIMUM else "max", (b["dim"],), b["keepdim"])


def _softmax(node: fx.Node, kind: str, b: Optional[dict[str, Any]]) -> Optional[Reduce]:
    """softmax / log_softmax over one int dim (the implicit dim of ``dim=None`` is left opaque)."""
    if b is None or not isinstance(b["dim"], int) or isinstance(b["dim"], bool):
        return None
    return Reduce(node, b["input"], kind, (b["dim"],), True, b.get("dtype"))


def _normalize_function(node: fx.Node, target: Any, args: tuple, kwargs: dict) -> Optional[CanonicalOp]:
    if target in _CONV_FUNCS:
        dims, transposed = _CONV_FUNCS[target]
        b = _bind(_sig_conv_t if transposed else _sig_conv, args, kwargs)
        return _conv(node, dims, transposed, b) if b else None
    if target is torch.convolution:
        b = _bind(_sig_convolution, args, kwargs)
        if not b:
            return None
        dims = len(_tuple(b["stride"], 1)) if isinstance(b["stride"], (list, tuple)) else None
        if dims is None:
            raise _Unsupported("cannot tell the number of spatial dims")
        return _conv(node, dims, bool(b["transposed"]), b)
    if target in _INTERPOLATE_FUNCS or target is F.upsample_nearest:
        b = _bind(_sig_interpolate if target in _INTERPOLATE_FUNCS else _sig_upsample_nearest, args, kwargs)
        return _upsample(node, b) if b else None
    if target in _UNARY_FUNCS:
        kind, inplace = _UNARY_FUNCS[target]
        b = _bind(_sig_neg, args, kwargs)
        return Pointwise(node, kind, (b["input"],), inplace) if b else None
    if target in _ALWAYS_INPLACE_FUNCS:
        b = _bind(_sig_neg, args, kwargs)
        return Pointwise(node, _ALWAYS_INPLACE_FUNCS[target], (b["input"],), True) if b else None
    if target in _INPLACE_FLAG_FUNCS:
        b = _bind(_sig_unary, args, kwargs)
        return Pointwise(node, _INPLACE_FLAG_FUNCS[target], (b["input"],), bool(b["inplace"])) if b else None
    if target in _LEAKY_FUNCS:
        b = _bind(_sig_leaky, args, kwargs)
        if not b:
            return None
        return Pointwise(node, K.LEAKY_RELU, (b["input"], b["negative_slope"]), _LEAKY_FUNCS[target] or bool(b["inplace"]))
    if target in _GELU_FUNCS:
        b = _bind(_sig_gelu, args, kwargs)
        if not b:
            return None
        if b["approximate"] not in ("none", "tanh"):
            raise _Unsupported(f"approximate={b['approximate']!r}")
        return Pointwise(node, K.GELU if b["approximate"] == "none" else K.GELU_TANH, (b["input"],))
    if target in _HARDTANH_FUNCS:
        b = _bind(_sig_hardtanh, args, kwargs)
        if not b:
            return None
        inplace = _HARDTANH_FUNCS[target] or bool(b["inplace"])
        return Pointwise(node, K.HARDTANH, (b["input"], b["min_val"], b["max_val"]), inplace)
    if target in _RELU6_FUNCS:
        b = _bind(_sig_unary, args, kwargs)
        return Pointwise(node, K.HARDTANH, (b["input"], 0.0, 6.0), bool(b["inplace"])) if b else None
    if target in _CLAMP_FUNCS:
        return _clamp(node, _bind(_sig_clamp, args, kwargs), _CLAMP_FUNCS[target])
    if target in _CLAMP_MIN_FUNCS:
        b = _bind(_sig_clamp_min, args, kwargs)
        return Pointwise(node, K.CLAMP_MIN, (b["input"], b["min"]), _CLAMP_MIN_FUNCS[target]) if b else None
    if target in _CLAMP_MAX_FUNCS:
        b = _bind(_sig_clamp_max, args, kwargs)
        return Pointwise(node, K.CLAMP_MAX, (b["input"], b["max"]), _CLAMP_MAX_FUNCS[target]) if b else None
    if target in _BINARY_FUNCS:
        kind, inplace = _BINARY_FUNCS[target]
        return _binary(node, kind, inplace, args, kwargs)
    if target in _NEG_FUNCS:
        b = _bind(_sig_neg, args, kwargs)
        return Pointwise(node, K.MUL, (b["input"], -1.0)) if b else None
    if target in _MIN_MAX_OVERLOADED:
        reduction = _min_max_reduction(node, _MIN_MAX_OVERLOADED[target], args, kwargs)
        if reduction is not None:
            return reduction
    if target in _MIN_MAX_FUNCS or target in _MIN_MAX_OVERLOADED:
        return _min_max(node, _MIN_MAX_FUNCS.get(target) or _MIN_MAX_OVERLOADED[target], False, args, kwargs)
    if target in _AMIN_AMAX_FUNCS:
        return _dims_reduce(node, _AMIN_AMAX_FUNCS[target], _bind(_sig_amin_amax, args, kwargs))
    if target in _LOGSUMEXP_FUNCS:
        return _dims_reduce(node, "logsumexp", _bind(_sig_logsumexp, args, kwargs))
    if target in _SOFTMAX_FUNCS:
        return _softmax(node, _SOFTMAX_FUNCS[target], _bind(_sig_softmax, args, kwargs))
    if target in _MAX_POOL_FUNCS:
        b = _bind(_sig_max_pool, args, kwargs)
        return _pool(node, "max", _MAX_POOL_FUNCS[target], b) if b else None
    if target in _AVG_POOL_FUNCS or target in (_C_NN.avg_pool2d, _C_NN.avg_pool3d, torch.avg_pool1d):
        dims = _AVG_POOL_FUNCS.get(target) or {_C_NN.avg_pool2d: 2, _C_NN.avg_pool3d: 3, torch.avg_pool1d: 1}[target]
        b = _bind(_sig_avg_pool, args, kwargs)
        return _pool(node, "avg", dims, b) if b else None
    if target in _ADAPTIVE_AVG_FUNCS:
        dims = _ADAPTIVE_AVG_FUNCS[target]
        b = _bind(_sig_adaptive, args, kwargs)
        if not b or any(s != 1 for s in _tuple(b["output_size"], dims)):
            return None
        return GlobalReduce(node, b["input"], "mean", tuple(range(-dims, 0)), True)
    if target in _REDUCE_FUNCS:
        return _reduce(node, _REDUCE_FUNCS[target], _bind(_sig_reduce, args, kwargs))
    if target is F.batch_norm:
        b = _bind(_sig_batch_norm, args, kwargs)
        if not b or not isinstance(b["training"], bool) or not isinstance(b["eps"], (int, float)):
            return None  # a traced training flag or eps: nothing to fold at compile time
        return BatchNorm(node, b["input"], b["running_mean"], b["running_var"], b["weight"], b["bias"],
                         b["training"] or b["running_mean"] is None or b["running_var"] is None, float(b["eps"]),
                         b["momentum"])
    if target in (F.group_norm, torch.group_norm):
        return _group_norm(node, _bind(_sig_group_norm, args, kwargs))
    if target in (F.layer_norm, torch.layer_norm):
        return _layer_norm(node, _bind(_sig_layer_norm, args, kwargs))
    if target is F.instance_norm:
        return _instance_norm(node, _bind(_sig_instance_norm, args, kwargs))
    if target is torch.instance_norm:
        return _instance_norm(node, _bind(_sig_torch_instance_norm, args, kwargs))
    return None


def _group_norm(node: fx.Node, b: Optional[dict[str, Any]]) -> Optional[GroupNorm]:
    if not b or not isinstance(b["num_groups"], int) or isinstance(b["num_groups"], bool):
        return None
    if not isinstance(b["eps"], (int, float)) or isinstance(b["eps"], bool):
        return None  # a traced eps: nothing to fuse at compile time
    return GroupNorm(node, b["input"], b["num_groups"], b["weight"], b["bias"], float(b["eps"]))


def _layer_norm(node: fx.Node, b: Optional[dict[str, Any]]) -> Optional[LayerNorm]:
    if not b:
        return None
    eps = b["eps"]
    eps = float(eps) if isinstance(eps, (int, float)) and not isinstance(eps, bool) else None  # None: traced
    return LayerNorm(node, b["input"], _static_shape(b["normalized_shape"]), b["weight"], b["bias"], eps)


def _static_shape(shape: Any) -> Optional[tuple[int, ...]]:
    """``shape`` (a tuple, list or ``torch.Size`` of ints) as a tuple of ints; ``None`` when any size
    is traced (a graph value or a symbolic int)."""
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        return None
    return tuple(int(d) for d in shape)


def _instance_norm(node: fx.Node, b: Optional[dict[str, Any]]) -> Optional[GroupNorm]:
    if not b or not isinstance(b["use_input_stats"], bool) or not isinstance(b["eps"], (int, float)):
        return None
    running = b["running_mean"] is not None or b["running_var"] is not None or not b["use_input_stats"]
    return GroupNorm(node, b["input"], None, b["weight"], b["bias"], float(b["eps"]), running)


def _clamp(node: fx.Node, b: Optional[dict[str, Any]], inplace: bool) -> Optional[Pointwise]:
    if not b:
        return None
    lo, hi = b["min"], b["max"]
    if lo is None and hi is None:
        raise _Unsupported("clamp without bounds")
    if hi is None:
        return Pointwise(node, K.CLAMP_MIN, (b["input"], lo), inplace)
    if lo is None:
        return Pointwise(node, K.CLAMP_MAX, (b["input"], hi), inplace)
    return Pointwise(node, K.CLAMP, (b["input"], lo, hi), inplace)


def _min_max(node: fx.Node, kind: K, inplace: bool, args: tuple, kwargs: dict) -> Optional[Pointwise]:
    """``torch.minimum(a, b)`` / ``maximum`` (and ``min`` / ``max`` of two tensors): both sides are
    graph values (a number there is not a tensor; ``min(x, 1)`` reduces over dim 1)."""
    b = _bind(_sig_min_max, args, kwargs)
    if not b or b.get("out") is not None or not isinstance(b["other"], fx.Node):
        return None
    return Pointwise(node, kind, (b["input"], b["other"]), inplace)


def _binary(node: fx.Node, kind: K, inplace: bool, args: tuple, kwargs: dict) -> Optional[Pointwise]:
    if kind is K.DIV:
        b = _bind(_sig_div, args, kwargs)
        if b and b["rounding_mode"] is not None:
            raise _Unsupported(f"rounding_mode={b['rounding_mode']!r}")
    else:
        b = _bind(_sig_binary, args, kwargs)
        if b and b["alpha"] != 1:
            if not isinstance(b["other"], (int, float)) or not isinstance(b["alpha"], (int, float)):
                raise _Unsupported(f"alpha={b['alpha']} with a tensor operand")
            b["other"] = b["other"] * b["alpha"]
    if not b or b.get("out") is not None:
        return None
    return Pointwise(node, kind, (b["input"], b["other"]), inplace)


def _normalize_method(node: fx.Node) -> Optional[CanonicalOp]:
    name = str(node.target)
    inplace = name.endswith("_") and not name.endswith("__")
    base = name[:-1] if inplace else name
    args, kwargs = node.args, dict(node.kwargs)
    if base in _METHOD_UNARY:
        b = _bind(_sig_neg, args, kwargs)
        return Pointwise(node, _METHOD_UNARY[base], (b["input"],), inplace) if b else None
    if base in _METHOD_BINARY:
        # __rmul__/__radd__ swap the operands, which commutative ops do not mind.
        return _binary(node, _METHOD_BINARY[base], inplace, args, kwargs)
    if base in ("minimum", "maximum", "min", "max"):
        kind = K.MINIMUM if base in ("minimum", "min") else K.MAXIMUM
        if name in ("min", "max"):
            reduction = _min_max_reduction(node, kind, args, kwargs)
            if reduction is not None:
                return reduction
        return _min_max(node, kind, inplace, args, kwargs)
    if name in ("amin", "amax"):
        return _dims_reduce(node, name, _bind(_sig_amin_amax, args, kwargs))
    if name == "logsumexp":
        return _dims_reduce(node, name, _bind(_sig_logsumexp, args, kwargs))
    if name in ("softmax", "log_softmax"):
        return _softmax(node, name, _bind(_sig_softmax, args, kwargs))
    if base in ("neg", "negative"):
        b = _bind(_sig_neg, args, kwargs)
        return Pointwise(node, K.MUL, (b["input"], -1.0), inplace) if b else None
    if base in ("clamp", "clip"):
        return _clamp(node, _bind(_sig_clamp, args, kwargs), inplace)
    if base == "clamp_min":
        b = _bind(_sig_clamp_min, args, kwargs)
        return Pointwise(node, K.CLAMP_MIN, (b["input"], b["min"]), inplace) if b else None
    if base == "clamp_max":
        b = _bind(_sig_clamp_max, args, kwargs)
        return Pointwise(node, K.CLAMP_MAX, (b["input"], b["max"]), inplace) if b else None
    if name in ("mean", "sum"):
        return _reduce(node, name, _bind(_sig_reduce, args, kwargs))
    return None


def _normalize_module(node: fx.Node, root: torch.nn.Module) -> Optional[CanonicalOp]:
    """``call_module`` nodes (graphs traced without inlining nn.Modules)."""
    mod = root.get_submodule(str(node.target))
    (x,) = node.args if len(node.args) == 1 else (None,)
    if x is None:
        return None
    qual = str(node.target)
    if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
        if mod.padding_mode != "zeros":
            raise _Unsupported(f"padding_mode={mod.padding_mode!r}")
        transposed = isinstance(mod, nn.modules.conv._ConvTransposeNd)
        dims = len(mod.kernel_size)
        b = {
            "input": x,
            "weight": ParamRef(f"{qual}.weight"),
            "bias": ParamRef(f"{qual}.bias") if mod.bias is not None else None,
            "stride": mod.stride,
            "padding": mod.padding,
            "dilation": mod.dilation,
            "output_padding": mod.output_padding if transposed else 0,
            "groups": mod.groups,
        }
        return _conv(node, dims, transposed, b)
    if isinstance(mod, nn.Upsample):
        return _upsample(node, {"input": x, "scale_factor": mod.scale_factor, "mode": mod.mode})
    if type(mod) in _POINTWISE_MODULES:
        return Pointwise(node, _POINTWISE_MODULES[type(mod)], (x,), bool(getattr(mod, "inplace", False)))
    if isinstance(mod, nn.LeakyReLU):
        return Pointwise(node, K.LEAKY_RELU, (x, float(mod.negative_slope)), mod.inplace)
    if isinstance(mod, nn.GELU):
        if mod.approximate not in ("none", "tanh"):
            raise _Unsupported(f"approximate={mod.approximate!r}")
        return Pointwise(node, K.GELU if mod.approximate == "none" else K.GELU_TANH, (x,))
    if isinstance(mod, nn.Hardtanh):  # includes ReLU6
        return Pointwise(node, K.HARDTANH, (x, float(mod.min_val), float(mod.max_val)), mod.inplace)
    if isinstance(mod, (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)):
        dims = {nn.MaxPool1d: 1, nn.MaxPool2d: 2, nn.MaxPool3d: 3}[type(mod)]
        b = {"input": x, "kernel_size": mod.kernel_size, "stride": mod.stride, "padding": mod.padding,
             "dilation": mod.dilation, "ceil_mode": mod.ceil_mode, "return_indices": mod.return_indices}
        return _pool(node, "max", dims, b)
    if isinstance(mod, (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)):
        dims = {nn.AvgPool1d: 1, nn.AvgPool2d: 2, nn.AvgPool3d: 3}[type(mod)]
        b = {"input": x, "kernel_size": mod.kernel_size, "stride": mod.stride, "padding": mod.padding,
             "ceil_mode": mod.ceil_mode, "count_include_pad": mod.count_include_pad,
             "divisor_override": getattr(mod, "divisor_override", None)}
        return _pool(node, "avg", dims, b)
    if isinstance(mod, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
        def ref(name: str) -> Optional[ParamRef]:
            return ParamRef(f"{qual}.{name}") if getattr(mod, name) is not None else None

        batch_statistics = mod.training or mod.running_mean is None or mod.running_var is None
        return BatchNorm(node, x, ref("running_mean"), ref("running_var"), ref("weight"), ref("bias"),
                         batch_statistics, float(mod.eps), mod.momentum)
    if isinstance(mod, nn.GroupNorm):
        return GroupNorm(node, x, int(mod.num_groups), ParamRef(f"{qual}.weight") if mod.affine else None,
                         ParamRef(f"{qual}.bias") if mod.affine else None, float(mod.eps))
    if isinstance(mod, nn.LayerNorm):
        return LayerNorm(node, x, tuple(mod.normalized_shape), ParamRef(f"{qual}.weight") if mod.weight is not None else None,
                         ParamRef(f"{qual}.bias") if mod.bias is not None else None, float(mod.eps))
    if isinstance(mod, (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)):
        running = mod.track_running_stats
        return GroupNorm(node, x, None, ParamRef(f"{qual}.weight") if mod.affine else None,
                         ParamRef(f"{qual}.bias") if mod.affine else None, float(mod.eps), running)
    if isinstance(mod, (nn.Softmax, nn.LogSoftmax)):
        kind = "softmax" if isinstance(mod, nn.Softmax) else "log_softmax"
        return _softmax(node, kind, {"input": x, "dim": mod.dim, "dtype": None})
    if isinstance(mod, (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)):
        dims = {nn.AdaptiveAvgPool1d: 1, nn.AdaptiveAvgPool2d: 2, nn.AdaptiveAvgPool3d: 3}[type(mod)]
        if any(s != 1 for s in _tuple(mod.output_size, dims)):
            return None
        return GlobalReduce(node, x, "mean", tuple(range(-dims, 0)), True)
    return None


def functionalize_inplace(gm: fx.GraphModule, canonical: dict[fx.Node, CanonicalOp]) -> int:
    """Point later uses of a tensor mutated by an in-place pointwise op at the op's result.

    ``y = conv(x); y.relu_(); return y`` arrives from Dynamo as ``relu_ = relu_(conv)`` with the
    output reading ``conv``; after this pass the output reads ``relu_``, which is the same tensor,
    so the conv's only user is the ReLU and the chain can be matched.  Only mutations of values
    produced by a conv or a pointwise op are rewired: those are fresh tensors, never views of
    graph inputs.  Returns how many uses were rewired.
    """
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    rewired = 0
    for node, op in canonical.items():
        if not (isinstance(op, Pointwise) and op.inplace and op.args and isinstance(op.args[0], fx.Node)):
            continue
        target = op.args[0]
        if not isinstance(canonical.get(target), (Conv, Pointwise)):
            continue
        for user in list(target.users):
            if user is not node and order[user] > order[node]:
                user.replace_input_with(target, node)
                rewired += 1
    return rewired
