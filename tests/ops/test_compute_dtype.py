"""Autocast's casts absorbed into ``fusion::conv_epilogue`` (``config.compute_dtype``).

Under autocast the rewrite hands the op the fp32 input, weight and bias and names the conv's dtype in
the config; the Triton kernels cast each tile as they load it, and the gradients come back in fp32.
What must hold:

* the forward is *bitwise* the forward of the same op given explicitly cast tensors (the values the
  kernels cast are the values ``.to(dtype)`` gives), on every path: the fused conv (PHASE_ALIGNED, dense
  and general), the library conv, the reference;
* every gradient has its input's dtype (fp32) and is at least as close to float64 as the
  explicit-cast path's (which rounds the gradients to the low dtype before casting them back);
* the compiled graph has no cast nodes before the op, and the results match eager under autocast.

On CPU the kernels run under the interpreter in fp16 (it has no bf16); on CUDA also in bf16.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from fusion_backend.ir.specs import ConvSpec, PoolSpec
from fusion_backend.ops import conv_epilogue as ce
from fusion_backend.ops.chain import ChainStep, Const, PointwiseKind, TensorRef
from fusion_backend.ops.config import ConvEpilogueConfig
from fusion_backend.testing import Autocast, assert_fused, compare

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
PK = PointwiseKind
LOW_DTYPES = [torch.float16, torch.bfloat16] if CUDA else [torch.float16]


@pytest.fixture(params=["triton", "library"])
def impl(request, monkeypatch, exact_fp32, fresh_plans):
    """The conv path of the op's Triton implementation (fresh plan caches)."""
    if DEVICE == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton path on CPU tensors needs TRITON_INTERPRET=1")
        if request.param == "library":
            pytest.skip("aten's CPU conv in fp16 is the reference's business (covered on the GPU)")
    monkeypatch.setenv("FUSION_CPU_KERNELS", "triton")
    monkeypatch.setenv(ce.CONV_IMPL_ENV, request.param)
    return request.param


def _convt3d_maxpool():
    """ConvTranspose3d stride 2 -> leaky -> x per-channel -> leaky -> MaxPool3d(2): the PHASE_ALIGNED
    forward and the phase-aligned backward."""
    spec = ConvSpec(True, (2, 2, 2), (1, 1, 1), (1, 1, 1), (1, 1, 1), 1)
    leaky = ChainStep(PK.LEAKY_RELU, (Const(0.2),))
    chain = (leaky, ChainStep(PK.MUL, (TensorRef(0),)), leaky)
    pool = PoolSpec("max", (2, 2, 2), (2, 2, 2), (0, 0, 0))
    shapes = dict(x=(2, 4, 3, 4, 5), w=(4, 6, 3, 3, 3), b=6, m=(6, 1, 1, 1))
    return spec, chain, pool, shapes


def _plain_2d(stride: int = 1):
    """Conv2d (padding 1, odd sizes) -> x per-channel -> gelu, no pool: the dense forward
    (``conv_dense``; stride 2: the general ``conv_fused``) and the general Triton backward (which
    the op feeds cast tensors)."""
    spec = ConvSpec(False, (stride, stride), (1, 1), (1, 1), (0, 0), 1)
    chain = (ChainStep(PK.MUL, (TensorRef(0),)), ChainStep(PK.GELU, ()))
    shapes = dict(x=(2, 5, 7, 9), w=(6, 5, 3, 3), b=6, m=(6, 1, 1))
    return spec, chain, None, shapes


CASES = {"convT3d-s2-maxpool": _convt3d_maxpool, "conv2d": _plain_2d, "conv2d-s2": lambda: _plain_2d(2)}


def _leaves(shapes: dict, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shapes["x"], generator=g)
    w = torch.randn(shapes["w"], generator=g) * 0.3
    b = torch.randn(shapes["b"], generator=g)
    m = torch.randn(shapes["m"], generator=g)  # mixed signs: negative multipliers flip the max
    return [t.to(DEVICE) for t in (x, w, b, m)]


def _config(spec, chain, pool, compute_dtype: torch.dtype | None) -> str:
    # out_dtype float32: the fp32 multiplier promotes the low-precision conv output, as under autocast
    return ConvEpilogueConfig(
        conv=spec, chain=chain, pool=pool, out_dtype="float32", strict=True,
        compute_dtype=None if compute_dtype is None else str(compute_dtype).replace("torch.", ""),
    ).to_json()  # fmt: skip


def _run(leaves: list[torch.Tensor], config: str, grad_seed: int = 1) -> list[torch.Tensor]:
    """[out, grad x, grad w, grad b, grad multiplier] of the op on these leaves."""
    leaves = [t.detach().requires_grad_(True) for t in leaves]
    x, w, b, m = leaves
    out = ce.conv_epilogue(x, w, b, [m], config)
    g = torch.Generator().manual_seed(grad_seed)
    grad = torch.randn(out.shape, generator=g).to(out.device, out.dtype)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad)]


def _float64_reference(leaves: list[torch.Tensor], spec, chain, pool, dtype: torch.dtype) -> list[torch.Tensor]:
    """The eager composite in float64 on x, weight and bias rounded to ``dtype`` (what the conv sees)."""
    x, w, b, m = leaves
    rounded = [t.to(dtype).double().requires_grad_(True) for t in (x, w, b)] + [m.double().requires_grad_(True)]
    config = _config(spec, chain, pool, None).replace('"out_dtype":"float32"', '"out_dtype":null')
    out = ce.conv_epilogue_eager(*rounded[:3], [rounded[3]], config)
    g = torch.Generator().manual_seed(1)
    grad = torch.randn(out.shape, generator=g).to(out.device, torch.float32).double()
    return [out.detach(), *torch.autograd.grad(out, rounded, grad)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
def test_absorbed_casts_match_the_explicit_casts(case, dtype, impl):
    spec, chain, pool, shapes = CASES[case]()
    leaves = _leaves(shapes)
    absorbed = _run(leaves, _config(spec, chain, pool, dtype))
    explicit = _run([t.to(dtype) for t in leaves[:3]] + [leaves[3]], _config(spec, chain, pool, None))
    want = _float64_reference(leaves, spec, chain, pool, dtype)
    assert absorbed[0].dtype == torch.float32
    # The forward casts exactly what .to() casts: bitwise the same result.
    assert torch.equal(absorbed[0], explicit[0])
    names = ["grad x", "grad weight", "grad bias", "grad multiplier"]
    for name, leaf, got, other, ref in zip(names, leaves, absorbed[1:], explicit[1:], want[1:], strict=True):
        assert got.dtype == leaf.dtype == torch.float32 and got.shape == leaf.shape, name
        err, err_explicit = _rel(got, ref), _rel(other, ref)
        # fp32 gradients from the fp32 sums: never worse than rounding them to the low dtype first
        assert err <= 1.05 * err_explicit + 1e-6, f"{name}: {err:.2e} vs explicit casts {err_explicit:.2e}"
        assert err < (2e-2 if dtype == torch.bfloat16 else 5e-3), f"{name}: {err:.2e} from float64"


def test_compute_dtype_is_checked(impl):
    spec, chain, pool, shapes = _convt3d_maxpool()
    x, w, b, m = _leaves(shapes)
    config = _config(spec, chain, pool, None).replace('"compute_dtype":null', '"compute_dtype":"int8"')
    with pytest.raises(Exception, match="compute_dtype 'int8' is not a torch floating dtype"):
        ce.conv_epilogue(x, w, b, [m], config)


class _ConvPool(torch.nn.Module):
    """Conv2d -> x multiplier -> leaky -> optional MaxPool2d(2)."""

    def __init__(self, pool: bool) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.multiplier = torch.nn.Parameter(torch.randn(8, 1, 1))
        self.pool = torch.nn.MaxPool2d(2) if pool else torch.nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(torch.nn.functional.leaky_relu(self.conv(x) * self.multiplier))


@pytest.mark.parametrize("pool", [True, False], ids=["max-pool", "no-pool"])
def test_rewrite_absorbs_the_casts_only_before_a_max_pool(pool, tmp_path):
    """Under autocast, before a max pool the fused call takes the fp32 input, weight and bias (no
    cast nodes before it; its config names the conv's dtype).  Without one the graph keeps the casts
    (the library backward needs x in the conv's dtype, cast once and saved).  Either way the
    results match eager's under autocast (CPU: bf16 through the reference)."""
    torch.manual_seed(0)
    model = Autocast(_ConvPool(pool).to(DEVICE), DEVICE)
    x = torch.rand(2, 3, 10, 12, device=DEVICE)
    assert_fused(model, [x], expect={"conv_epilogue": 1}, tol=2e-2)
    torch._dynamo.reset()
    torch.compile(model, backend="fusion", options={"dump_dir": str(tmp_path)})(x)
    (after,) = tmp_path.glob("**/after.py")
    code = after.read_text()
    config = json.loads(json.loads(next(tmp_path.glob("**/report.json")).read_text())["matches"][0]["config"])
    assert "conv_epilogue" in code
    if pool:
        assert config["compute_dtype"] == "bfloat16" and ".to(" not in code, code
    else:
        assert config["compute_dtype"] is None and code.count(".to(") == 3, code


def test_rewrite_absorbs_the_casts_where_no_gradient_flows(tmp_path):
    """Traced under ``no_grad`` nothing is saved for a backward, so the casts are absorbed even
    without a max pool (the graph's cast pass would be pure cost); the result is eager's under
    autocast and no_grad, and a later call with grad enabled recompiles (Dynamo guards on grad
    mode) into the graph that keeps the casts."""
    torch.manual_seed(0)
    model = Autocast(_ConvPool(False).to(DEVICE), DEVICE)
    x = torch.rand(2, 3, 10, 12, device=DEVICE)
    dumps = tmp_path / "no-grad"
    compiled = torch.compile(model, backend="fusion", options={"dump_dir": str(dumps), "strict": True})
    with torch.no_grad():
        got = compiled(x)
        want = model(x)
    assert got.dtype == want.dtype
    compare("output", got, want, tol=2e-2)
    (after,) = dumps.glob("**/after.py")
    code = after.read_text()
    config = json.loads(json.loads(next(dumps.glob("**/report.json")).read_text())["matches"][0]["config"])
    assert config["compute_dtype"] == "bfloat16" and ".to(" not in code, code
    torch._dynamo.reset()
    with_grad = tmp_path / "grad"
    torch.compile(model, backend="fusion", options={"dump_dir": str(with_grad)})(x)
    (after,) = with_grad.glob("**/after.py")
    assert after.read_text().count(".to(") == 3
