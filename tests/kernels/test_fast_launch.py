"""``FastLaunch``: the direct-launcher path must launch exactly what Triton's generic path would.

The CPU tests drive ``FastLaunch`` with a stand-in kernel that records which path each call took and
what the launcher received; the CUDA test launches a real kernel through both paths with arguments
that change Triton's specialization (aligned / misaligned pointers, integers equal to 1, divisible
by 16, beyond int32) and checks every result.
"""

from __future__ import annotations

import types

import pytest
import torch
import triton
import triton.language as tl

from fusion_backend.kernels import compile_pool, launch
from fusion_backend.kernels.launch import MAX_REMEMBERED, FastLaunch, call_key


class _Param:
    def __init__(self, name: str, constexpr: bool = False, default=None) -> None:
        self.name, self.is_constexpr, self.default = name, constexpr, default


class _Compiled:
    """Stands in for a ``CompiledKernel``: ``run`` records the direct launches."""

    def __init__(self, log: list) -> None:
        self.function = 1234
        self.packed_metadata = ("meta",)
        self._log = log

    def run(self, *launch_args) -> None:
        self._log.append(("direct", launch_args))


class _Kernel:
    """Stands in for a ``JITFunction``: ``kernel[grid](*args, **kw)`` records a generic launch."""

    def __init__(self, params: list[_Param]) -> None:
        self.params = params
        self.log: list = []
        self.compiled = _Compiled(self.log)

    def __getitem__(self, grid):
        def launch_generic(*args, **kwargs):
            self.log.append(("generic", grid, args, kwargs))
            return self.compiled

        return launch_generic


@pytest.fixture
def fake_driver(monkeypatch):
    monkeypatch.setattr(launch, "_driver_functions", lambda: (lambda: 0, lambda device: 77))
    monkeypatch.setattr(
        launch, "_RUNTIME_KNOBS", types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    )


def _paths(kernel: _Kernel) -> list[str]:
    return [entry[0] for entry in kernel.log]


def test_second_call_with_the_same_specialization_launches_directly(fake_driver):
    kernel = _Kernel([_Param("x"), _Param("n"), _Param("BLOCK", True), _Param("MODE", True, default=3)])
    fl = FastLaunch(kernel, (5,), {"BLOCK": 64, "num_warps": 4})
    x = torch.randn(32)
    fl(x, 40)
    fl(x, 48)  # another integer value: generic (the key is finer than Triton's)
    fl(x, 48)
    fl(torch.randn(32), 40)  # another tensor, same dtype and alignment: direct
    assert _paths(kernel) == ["generic", "generic", "direct", "direct"]
    assert kernel.log[0][1:] == ((5,), (x, 40), {"BLOCK": 64, "num_warps": 4})
    gx, gy, gz, stream, function, meta, launch_meta, enter, exit_, *args = kernel.log[2][1]
    assert (gx, gy, gz, stream, function, meta) == (5, 1, 1, 77, 1234, ("meta",))
    assert (launch_meta, enter, exit_) == (None, None, None)
    assert args[0] is x and args[1:] == [48, 64, 3]  # runtime args, then constexprs (default filled in)


def test_fixed_trailing_arguments_are_passed_on_every_path(fake_driver):
    """``fixed``: the plan's integers, given once; calls pass only the tensors.  Both paths receive
    them after the call's arguments, and where a constexpr sits between runtime parameters too."""
    kernel = _Kernel([_Param("x"), _Param("y"), _Param("n"), _Param("BLOCK", True), _Param("m")])
    fl = FastLaunch(kernel, (2,), {"BLOCK": 16}, fixed=(40, 7))
    x, y = torch.randn(32), torch.randn(32)
    fl(x, y)
    fl(x, y)
    assert _paths(kernel) == ["generic", "direct"]
    assert kernel.log[0][2] == (x, y, 40, 7) and kernel.log[0][3] == {"BLOCK": 16}
    *_, a0, a1, a2, a3, a4 = kernel.log[1][1]
    assert a0 is x and a1 is y and (a2, a3, a4) == (40, 16, 7)


@pytest.mark.parametrize(
    "first, second",
    [
        ("aligned", "misaligned"),
        (2, 1),  # 1 becomes a constant in Triton
        (3, 32),  # divisible by 16
        (3, 2**31),  # needs int64
        (2**40, 2**63 + 5),  # needs uint64
        (torch.float32, torch.float16),  # pointer type
        (2, 2.0),  # equal values, other type
        (1, True),
    ],
)
def test_a_different_specialization_takes_the_generic_path(fake_driver, first, second):
    kernel = _Kernel([_Param("x"), _Param("n")])
    fl = FastLaunch(kernel, (1, 2), {})
    base = torch.randn(64)

    def args(v):
        if v == "aligned":
            return base, 7
        if v == "misaligned":
            return base[1:], 7
        if isinstance(v, torch.dtype):
            return base.to(v), 7
        return base, v

    fl(*args(first))
    fl(*args(second))
    fl(*args(second))
    fl(*args(first))
    assert _paths(kernel) == ["generic", "generic", "direct", "direct"]
    assert call_key(args(first)) != call_key(args(second))


def test_constexpr_between_runtime_parameters_is_placed_in_signature_order(fake_driver):
    kernel = _Kernel([_Param("x"), _Param("A", True), _Param("n"), _Param("B", True)])
    fl = FastLaunch(kernel, (3, 1, 2), {"A": "a", "B": (1, 2)})
    x = torch.randn(4)
    fl(x, 5)
    fl(x, 5)
    assert _paths(kernel) == ["generic", "direct"]
    args = kernel.log[1][1][9:]
    assert args[0] is x and args[1:] == ("a", 5, (1, 2))


def test_tuple_arguments_are_keyed_element_wise(fake_driver):
    kernel = _Kernel([_Param("ops"), _Param("strides")])
    fl = FastLaunch(kernel, (1,), {})
    a, b = torch.randn(8), torch.randn(8)
    fl((a, b), (1, 16))
    fl((b, a), (1, 16))
    fl((a, b[1:]), (1, 16))
    fl((a, b), (2, 16))
    fl((a, b), (1, 16.0))
    assert _paths(kernel) == ["generic", "direct", "generic", "generic", "generic"]


def test_unhashable_arguments_and_launch_hooks_keep_the_generic_path(fake_driver, monkeypatch):
    kernel = _Kernel([_Param("x"), _Param("what")])
    fl = FastLaunch(kernel, (1,), {})
    x = torch.randn(4)
    for _ in range(3):
        fl(x, [1, 2])
    assert _paths(kernel) == ["generic"] * 3

    kernel = _Kernel([_Param("x"), _Param("n")])
    fl = FastLaunch(kernel, (1,), {})
    fl(x, 3)
    monkeypatch.setattr(
        launch, "_RUNTIME_KNOBS",
        types.SimpleNamespace(launch_enter_hook=types.SimpleNamespace(calls=[print]), launch_exit_hook=None),
    )  # fmt: skip
    fl(x, 3)
    assert _paths(kernel) == ["generic", "generic"]


def test_remembered_specializations_are_bounded(fake_driver):
    kernel = _Kernel([_Param("n")])
    fl = FastLaunch(kernel, (1,), {})
    for n in range(MAX_REMEMBERED + 10):
        fl(n)
    assert len(fl._compiled) == MAX_REMEMBERED
    fl(3)
    fl(MAX_REMEMBERED + 5)
    assert _paths(kernel)[-2:] == ["direct", "generic"]


def test_without_a_gpu_driver_every_call_is_generic(monkeypatch):
    monkeypatch.setattr(launch, "_driver_functions", lambda: None)
    kernel = _Kernel([_Param("x")])
    fl = FastLaunch(kernel, (1,), {})
    x = torch.randn(4)
    fl(x)
    fl(x)
    assert _paths(kernel) == ["generic", "generic"]


@triton.jit
def _axpb_kernel(x_ptr, out_ptr, n, a, b, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, x * a + b, mask=ok)


def test_real_kernel_gives_the_generic_result_for_every_specialization(kernel_device):
    """On CUDA the direct path runs from the second call of each key on; under the interpreter every
    call is generic.  Either way each launch must compute ``x * a + b`` on exactly ``n`` elements."""
    block = 64
    fl = FastLaunch(_axpb_kernel, (2,), {"BLOCK": block})
    base = torch.randn(200, device=kernel_device)
    cases = []
    for x in (base[:100], base[1:101], base[3:103]):  # 16-byte aligned, then two misaligned
        for n in (1, 16, 37, 100):
            for a, b in ((1, 0), (3, 16), (2**33, -5)):  # a, b: 1 (constant), /16, int64
                cases.append((x, n, a, b))
    for _ in range(2):  # the second round hits remembered kernels
        for x, n, a, b in cases:
            out = torch.full((128,), -7.0, device=kernel_device)
            fl(x, out, n, a, b)
            expected = torch.full((128,), -7.0, device=kernel_device)
            expected[:n] = x[:n].double().mul(a).add(b).float()
            torch.testing.assert_close(out, expected, rtol=1e-6, atol=0, msg=f"n={n} a={a} b={b}")
    if kernel_device == "cuda":
        assert fl._compiled, "the direct path was never set up on CUDA"


# --------------------------------------------------------------------------------------------------
# compile_ahead: every launch inside it is only compiled
# --------------------------------------------------------------------------------------------------


class _WarmableKernel(_Kernel):
    """``_Kernel`` that also records ``warmup`` (a compile without a launch), as ``JITFunction`` and
    triton's ``Autotuner`` have it."""

    def warmup(self, *args, grid, **kwargs):
        self.log.append(("warmup", grid, args, kwargs))


@pytest.fixture
def compiled_kernels(monkeypatch):
    """``compile_ahead`` as on a GPU machine (it does nothing under the interpreter)."""
    pytest.importorskip("triton.runtime._async_compile", reason="this Triton has no AsyncCompileMode")
    monkeypatch.setattr(launch, "INTERPRETER", False)
    monkeypatch.setattr(compile_pool, "ready_pool", lambda: None)  # the thread pool's path


def test_compile_ahead_compiles_every_launch_and_launches_none(fake_driver, compiled_kernels):
    plain, tuned = _WarmableKernel([_Param("x"), _Param("n")]), _WarmableKernel([_Param("x")])
    fl = FastLaunch(plain, (3,), {}, fixed=(5,))
    x = torch.randn(4)
    fl(x)
    fl(x)  # now remembered: the direct path
    results = []

    def candidate():
        fl(x)
        results.append(launch.launch(tuned, (2, 1), x, BLOCK=16))
        results.append(launch.compiling_ahead())

    assert launch.compile_ahead([candidate])
    assert _paths(plain) == ["generic", "direct", "warmup"]
    assert plain.log[-1] == ("warmup", (3,), (x, 5), {})
    assert tuned.log == [("warmup", (2, 1), (x,), {"BLOCK": 16})]
    assert results == [False, True]
    assert not launch.compiling_ahead()
    assert launch.launch(tuned, (2, 1), x, BLOCK=16) is True  # outside: a real launch
    assert _paths(tuned) == ["warmup", "generic"]


def test_compile_ahead_skips_a_call_that_raises_and_runs_the_others(fake_driver, compiled_kernels):
    kernel = _WarmableKernel([_Param("x")])
    ran = []

    def broken():
        ran.append("broken")
        raise ValueError("unsupported case")

    def fine():
        ran.append("fine")
        launch.launch(kernel, (1,), torch.zeros(1))

    assert launch.compile_ahead([broken, fine])
    assert ran == ["broken", "fine"] and _paths(kernel) == ["warmup"]


def test_compile_ahead_does_nothing_under_the_interpreter(monkeypatch):
    monkeypatch.setattr(launch, "INTERPRETER", True)
    ran = []
    assert not launch.compile_ahead([lambda: ran.append(1)])
    assert ran == []


@triton.autotune(configs=[triton.Config({"BLOCK": 32}), triton.Config({"BLOCK": 64})], key=["n"])
@triton.jit
def _axpb_tuned(x_ptr, out_ptr, n, a, b, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, x * a + b, mask=ok)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles for and launches on a CUDA GPU")
@pytest.mark.parametrize("where", ["threads", "workers"])
def test_after_compile_ahead_the_real_calls_compile_nothing(where, monkeypatch, tmp_path):
    """Kernels compiled ahead (a plain launch through ``FastLaunch``, and every tile of an autotuned
    kernel), on threads or in Inductor's worker processes, are found compiled by the calls that
    follow, which compute the right values.  A compile in this process is counted where Triton turns
    a kernel's source into IR (``ASTSource.make_ir``, which a cache hit skips); the cache folder is
    fresh, so nothing is found there that this test did not compile."""
    pytest.importorskip("triton.runtime._async_compile", reason="this Triton has no AsyncCompileMode")
    from triton import knobs
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if where == "workers":
        from torch._inductor.async_compile import AsyncCompile

        if not AsyncCompile.use_process_pool():
            AsyncCompile.wait_pool_ready()
        assert compile_pool.ready_pool() is not None
    else:
        monkeypatch.setattr(compile_pool, "ready_pool", lambda: None)
    asked, compiled_here = [], []
    do_compile, make_ir = JITFunction._do_compile, ASTSource.make_ir

    def counting_do_compile(self, *args, **kwargs):
        asked.append(self.fn.__name__)
        return do_compile(self, *args, **kwargs)

    def counting_make_ir(self, *args, **kwargs):
        compiled_here.append(self.fn.fn.__name__)
        return make_ir(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "_do_compile", counting_do_compile)
    monkeypatch.setattr(ASTSource, "make_ir", counting_make_ir)
    n = 37 + torch.randint(0, 1000, ()).item() * 16
    # a dtype per case that no other test launches these kernels with: nothing is in Triton's memory yet
    x = torch.randn(n + 64, device="cuda", dtype=torch.float16 if where == "workers" else torch.float64)
    out1, out2 = torch.zeros_like(x), torch.zeros_like(x)
    fl = FastLaunch(_axpb_kernel, (triton.cdiv(n, 64),), {"BLOCK": 64})

    def call():
        fl(x, out1, n, 3, 16)
        launch.launch(_axpb_tuned, lambda meta: (triton.cdiv(n, meta["BLOCK"]),), x, out2, n, 3, 16)

    with knobs.cache.scope():
        knobs.cache.dir = str(tmp_path)
        assert launch.compile_ahead([call])
        assert sorted(asked) == ["_axpb_kernel", "_axpb_tuned", "_axpb_tuned"]
        assert len(compiled_here) == (0 if where == "workers" else 3)
        assert not out1.any() and not out2.any()  # nothing ran
        compiled_here.clear()
        call()
        assert compiled_here == []
    expected = torch.zeros_like(x)
    # x * 3 + 16 in float64, rounded once to x's dtype: the kernel computes in x's dtype (float64 in the
    # threads case, where a float32 reference misses by up to 1e-7 relative, beyond float64's tolerance)
    expected[:n] = (x[:n].double() * 3 + 16).to(x.dtype)
    torch.testing.assert_close(out1, expected)
    torch.testing.assert_close(out2, expected)


def test_tensor_descriptors_are_keyed_by_all_but_their_data(fake_driver):
    from triton.tools.tensor_descriptor import TensorDescriptor

    kernel = _Kernel([_Param("desc")])
    fl = FastLaunch(kernel, (1,), {})
    x = torch.randn(4, 8, 16)

    def desc(t=x, block=(1, 4, 16)):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block))

    fl(desc())
    fl(desc(x.clone()))  # other data, the same description: the remembered kernel, given the descriptor
    fl(desc(block=(1, 8, 16)))  # another block: Triton's key differs
    fl(desc(x.half()))  # another dtype
    fl(desc(x[:2]))  # another shape
    assert _paths(kernel) == ["generic", "direct", "generic", "generic", "generic"]
    direct_args = kernel.log[1][1]
    assert isinstance(direct_args[-1], TensorDescriptor)


requires_cuda_box = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (tensor-descriptor launches)")


@requires_cuda_box
@pytest.mark.parametrize("pass_name", ["dgrad", "wgrad"])  # (the forward loads by gather only)
def test_a_box_plans_direct_launch_gives_its_generic_launchs_result(pass_name):
    """The first call of a plan whose tiles load boxes takes Triton's generic path, the next ones the
    remembered kernel with the descriptors passed directly: the same results, bit for bit."""
    from fusion_backend.kernels.conv import TileConfig, conv_dgrad, conv_wgrad

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 64, 14, 14, device="cuda", generator=g).to(torch.bfloat16, memory_format=torch.channels_last)
    w = (torch.randn(64, 64, 3, 3, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
    dy = torch.randn(2, 64, 14, 14, device="cuda", generator=g).to(torch.bfloat16, memory_format=torch.channels_last)
    tile = TileConfig(128, 64, 64, box_w=16)
    run = {"dgrad": lambda: conv_dgrad(dy, w, x.shape, padding=1, tile=tile)[0],
           "wgrad": lambda: conv_wgrad(dy, x, w, padding=1, tile=tile)[0]}[pass_name]
    first, second, third = run(), run(), run()
    assert torch.equal(first, second) and torch.equal(first, third)
