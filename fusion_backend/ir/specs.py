"""Conv and pool hyper-parameters: the one description every layer uses (patterns, configs, kernels).

Tuples have one entry per spatial dim (1 to 3).  Both are frozen and hashable: they key per-shape
caches and travel inside the fused ops' JSON configs (``to_dict`` / ``from_dict``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class ConvSpec:
    """Hyper-parameters of ``aten.convolution``."""

    transposed: bool
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    output_padding: tuple[int, ...]
    groups: int

    @property
    def spatial_dims(self) -> int:
        return len(self.stride)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (every fused op's config carries one)."""
        return {
            "transposed": self.transposed,
            "stride": list(self.stride),
            "padding": list(self.padding),
            "dilation": list(self.dilation),
            "output_padding": list(self.output_padding),
            "groups": self.groups,
        }

    @staticmethod
    def from_dict(c: dict[str, Any]) -> ConvSpec:
        """Inverse of ``to_dict``."""
        return ConvSpec(
            transposed=bool(c["transposed"]),
            stride=tuple(int(v) for v in c["stride"]),
            padding=tuple(int(v) for v in c["padding"]),
            dilation=tuple(int(v) for v in c["dilation"]),
            output_padding=tuple(int(v) for v in c["output_padding"]),
            groups=int(c["groups"]),
        )


@dataclass(frozen=True)
class PoolSpec:
    """A max or avg pool (dilation 1: the patterns reject dilated pools).

    ``kind`` is ``"max"`` or ``"avg"``.  ``stride`` empty means the kernel size, as PyTorch's pools
    read ``stride=None``; it is stored resolved.  ``count_include_pad`` and ``divisor_override``
    apply to ``"avg"`` only, with PyTorch's divisor rule: the window clipped to
    ``[-padding, size + padding)`` counts when ``count_include_pad``, else the window clipped to the
    input.  ``ceil_mode`` only changes the output size: the kernels read that off the output tensor
    and clip partial windows the same way in both modes.
    """

    kind: str
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...] = ()
    padding: tuple[int, ...] = ()
    ceil_mode: bool = False
    count_include_pad: bool = True
    divisor_override: Optional[int] = None

    def __post_init__(self) -> None:
        if self.kind not in ("max", "avg"):
            raise ValueError(f"pool kind must be 'max' or 'avg', got {self.kind!r}")
        object.__setattr__(self, "kernel_size", tuple(self.kernel_size))
        object.__setattr__(self, "stride", tuple(self.stride) or self.kernel_size)
        object.__setattr__(self, "padding", tuple(self.padding) or (0,) * len(self.kernel_size))

    @property
    def window_volume(self) -> int:
        return math.prod(self.kernel_size)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the config of a fused op that pools carries one)."""
        return {"kind": self.kind, "kernel_size": list(self.kernel_size), "stride": list(self.stride),
                "padding": list(self.padding), "ceil_mode": self.ceil_mode,
                "count_include_pad": self.count_include_pad, "divisor_override": self.divisor_override}

    @staticmethod
    def from_dict(p: dict[str, Any]) -> PoolSpec:
        """Inverse of ``to_dict``."""
        divisor = p["divisor_override"]
        return PoolSpec(kind=str(p["kind"]), kernel_size=tuple(int(v) for v in p["kernel_size"]),
                        stride=tuple(int(v) for v in p["stride"]), padding=tuple(int(v) for v in p["padding"]),
                        ceil_mode=bool(p["ceil_mode"]), count_include_pad=bool(p["count_include_pad"]),
                        divisor_override=None if divisor is None else int(divisor))
