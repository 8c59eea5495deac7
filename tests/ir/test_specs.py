"""Conv and pool specs (``fusion_backend/ir/specs.py``): the one description of conv and pool
hyper-parameters that patterns, op configs and kernels share."""

import json

import pytest

from fusion_backend.ir.specs import ConvSpec, PoolSpec


def test_a_pool_without_stride_strides_by_its_kernel_as_pytorch_does():
    assert PoolSpec("max", (2, 3)).stride == (2, 3)
    assert PoolSpec("max", [2, 3], [], []).padding == (0, 0)
    assert PoolSpec("avg", (3,), (1,), (1,)) == PoolSpec("avg", [3], [1], [1])
    assert PoolSpec("max", (2, 2), (), (0, 0)) == PoolSpec("max", (2, 2), (2, 2), (0, 0))
    assert PoolSpec("max", (2, 2, 2)).window_volume == 8


def test_an_unknown_pool_kind_is_a_one_line_error():
    with pytest.raises(ValueError, match="pool kind must be 'max' or 'avg', got 'lp'"):
        PoolSpec("lp", (2, 2))


def test_a_conv_spec_round_trips_through_json():
    spec = ConvSpec(True, (2, 2, 2), (1, 1, 1), (1, 1, 1), (1, 1, 1), 4)
    assert ConvSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert spec.spatial_dims == 3


@pytest.mark.parametrize("spec", [PoolSpec("max", (2, 3), (1, 2), (1, 0), ceil_mode=True),
                                  PoolSpec("avg", (3, 3, 3), count_include_pad=False, divisor_override=5)])
def test_a_pool_spec_round_trips_through_json(spec):
    assert PoolSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
