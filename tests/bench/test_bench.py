"""Tests of the benchmark harness (``python -m fusion_backend bench``) that run on CPU in seconds.

The GPU path (CUDA events, allocator statistics, measured rates) is replaced by fakes injected through
:class:`fusion_backend.bench.Instruments` and :class:`fusion_backend.bench.DeviceRates`, so what is
tested here is the harness's logic: suite loading, the correctness gate (a wrong backend must be a
FAIL, never a speedup), the roofline arithmetic, report writing and the command line.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import math
import re
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from fusion_backend.bench import cli, suite
from fusion_backend.bench.backends import (
    BenchBackend,
    pick_contenders,
    resolve_backend,
    resolve_backends,
    torch_compile_backend,
    with_compile_mode,
)
from fusion_backend.bench.config import BenchConfig, MeasureConfig
from fusion_backend.bench.correctness import compare_tensor
from fusion_backend.bench.errors import BackendSpecError, ConfigError, SuiteError
from fusion_backend.bench.measure import Instruments, MemoryStats, TimedStep, TimingStats
from fusion_backend.bench.output import (
    details_table,
    format_markdown,
    format_report,
    read_json,
    summary_table,
    write_reports,
)
from fusion_backend.bench.results import BenchReport, CaseResult, ItemResult, Status
from fusion_backend.bench.roofline import (
    DeviceRates,
    FlopCount,
    Traffic,
    compute_unit,
    count_traffic,
    roofline,
)
from fusion_backend.bench.runner import ProgressEvent, Runner, _decided, _from_caches
from fusion_backend.bench.suite import SUITES, Workload, filter_workloads, load_workload, resolve_suite
from fusion_backend.bench.verdict import verdict_of

TINY_CONV = """
import torch
import torch.nn as nn

N, CIN, COUT, H, W, K = 2, 3, 4, 8, 8, 3


class Model(nn.Module):
    def __init__(self, cin, cout, k):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k)
        self.scale = nn.Parameter(torch.randn(cout, 1, 1))

    def forward(self, x):
        return torch.nn.functional.gelu(self.conv(x) * self.scale)


def get_inputs():
    return [torch.rand(N, CIN, H, W)]


def get_init_inputs():
    return [CIN, COUT, K]
"""

TINY_CONVT = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv_transpose = nn.ConvTranspose2d(2, 3, 3, stride=2)

    def forward(self, x):
        return self.conv_transpose(x).mean(dim=(2, 3))


def get_inputs():
    return [torch.rand(2, 2, 4, 4)]


def get_init_inputs():
    return []
"""

#: TINY_CONV with a channels-last input; ``SEEN`` records, per forward, whether x arrived channels-last.
TINY_CHANNELS_LAST = TINY_CONV.replace("return [torch.rand(N, CIN, H, W)]",
                                       "return [torch.rand(N, CIN, H, W).to(memory_format=torch.channels_last)]"
                                       ).replace("    def forward(self, x):\n", """    def forward(self, x):
        SEEN.append(x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous())
""") + "\nSEEN = []\n"

CPU = torch.device("cpu")
FAKE_RATES = DeviceRates(copy_bytes_per_s=1e12, matmul_flops={"bf16": 4e14, "tf32": 2e14, "fp32": 5e13})
FAKE_MS = {"eager": 2.0, "inductor": 1.0, "fusion": 0.5}


def write_model(folder: Path, name: str, source: str = TINY_CONV) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    return path


@pytest.fixture
def tiny(tmp_path: Path) -> Workload:
    return load_workload(write_model(tmp_path / "models", "tiny"))


# -- fakes ---------------------------------------------------------------------------------------------------


class FakeTimer:
    """Returns fixed times per backend (cold = 1.25 x warm) after running the step once for real."""

    def __init__(self, ms: dict[str, float]) -> None:
        self.ms = ms
        self.backend = ""
        self.timed: list[tuple[str, bool]] = []

    def time(self, steps: Sequence[TimedStep], *, cold: bool = False) -> list[TimingStats | Exception]:
        results: list[TimingStats | Exception] = []
        for step in steps:
            self.backend = step.name
            try:
                results.append(self.time_one(step, cold))
            except Exception as exc:
                results.append(exc)
        return results

    def time_one(self, step: TimedStep, cold: bool) -> TimingStats:
        if step.reset is not None:
            step.reset()
        step.run()
        self.timed.append((self.backend, cold))
        base = self.ms.get(self.backend, 1.0) * (1.25 if cold else 1.0)
        return TimingStats.from_samples([base * 0.9, base, base * 1.1])


class FakeMemory:
    """Baseline 1000 bytes, peak 5000, forward leaves 3000; ``allocated()`` before compiling is ``start``."""

    def __init__(self, start: int = 1000) -> None:
        self.start = start

    def allocated(self, *, drop_workspaces: bool = False) -> int:
        return self.start

    def measure(self, forward: Callable[[], Any], backward: Callable[[Any], None] | None = None, *,
                before: Callable[[], None] | None = None) -> MemoryStats:
        if before is not None:
            before()
        out = forward()
        if backward is not None:
            backward(out)
        return MemoryStats(baseline_bytes=1000, peak_bytes=5000, held_bytes=3000)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 0.5
        return self.t


def _keep_everything() -> None:
    """Stands in for ``release`` (gc.collect + emptying the CUDA cache): a full collection costs about
    0.15 s with torch imported, several times per run, and frees nothing a fake measurement reads."""


def fake_instruments(timer: FakeTimer, memory: FakeMemory | None = None) -> Instruments:
    return Instruments(timer=timer, memory=memory or FakeMemory(), clock=Clock(), release=_keep_everything)


def adds_offset(offset: float) -> BenchBackend:
    """A deliberately wrong backend: correct gradients, output shifted by ``offset``."""
    return BenchBackend(f"plus{offset:g}", lambda m: (lambda *a: m(*a) + offset), "adds an offset",
                        uses_dynamo=False)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 1.1


WRONG_GRAD = BenchBackend("wrong-grad", lambda m: (lambda *a: _ScaleGrad.apply(m(*a))),
                          "right output, gradients 10% too large", uses_dynamo=False)


def _raise(module: torch.nn.Module) -> Callable[..., Any]:
    raise RuntimeError("this backend cannot compile anything")


def _in_float64(module: torch.nn.Module) -> Callable[..., Any]:
    def call(*args: torch.Tensor) -> torch.Tensor:
        params = {name: p.double() for name, p in module.named_parameters()}
        return torch.func.functional_call(module, params, tuple(a.double() for a in args)).float()

    return call


#: Computes in float64 and rounds to fp32 at the end: differs from eager, but is closer to exact.
MORE_ACCURATE = BenchBackend("float64-inside", _in_float64, "computes in float64", uses_dynamo=False)

BROKEN = BenchBackend("broken", _raise, "raises at compile", uses_dynamo=False)
FAKE_FUSION = BenchBackend("fusion", lambda m: m, "eager standing in for fusion", uses_dynamo=False)
FAKE_INDUCTOR = BenchBackend("inductor", lambda m: m, "eager standing in for inductor", uses_dynamo=False)


def run(workloads: list[Workload], backends: list[BenchBackend], *, dtypes: tuple[str, ...] = ("fp32",),
        modes: tuple[str, ...] = ("infer", "train"), timer: FakeTimer | None = None,
        rates: DeviceRates | None = FAKE_RATES, check_only: bool = False,
        events: list[ProgressEvent] | None = None, tolerances: dict[str, float] | None = None,
        fp64_check: bool = True, memory: FakeMemory | None = None,
        measure: MeasureConfig | None = None, stop_requested: Callable[[], bool] = lambda: False) -> BenchReport:
    timer = timer or FakeTimer(FAKE_MS)
    config = BenchConfig(dtypes=dtypes, modes=modes, backends=tuple(b.name for b in backends),
                         check_only=check_only, tolerances=tolerances or {}, fp64_check=fp64_check,
                         measure=measure or MeasureConfig())

    def progress(ev: ProgressEvent) -> None:
        if events is not None:
            events.append(ev)

    instruments = None if check_only else fake_instruments(timer, memory)
    runner = Runner(config, backends, device=CPU, instruments=instruments,
                    rates=rates, progress=progress, stop_requested=stop_requested)
    return runner.run(workloads, environment={"device": "cpu", "torch": torch.__version__,
                                              "command": "test"})


# -- suite loading -------------------------------------------------------------------------------------------


def test_seeds_suite_is_the_three_full_size_pipelines_then_the_two_small_ones() -> None:
    names = [w.name for w in resolve_suite("seeds")]
    assert names == ["convt3d_leaky_mul_leaky_maxpool", "conv2d_mul_leaky_gelu",
                     "convt2d_global_mean_bias_logsumexp", "conv2d_mul_leaky_gelu_small",
                     "convt2d_global_mean_bias_logsumexp_small"]


def test_suite_accepts_a_file_a_folder_and_a_comma_separated_mix(tmp_path: Path) -> None:
    folder = tmp_path / "models"
    write_model(folder, "b_model")
    write_model(folder, "a_model")
    write_model(folder, "_helper", "X = 1\n")  # underscore files are not models
    single = write_model(tmp_path / "other", "single")
    assert [w.name for w in resolve_suite(str(folder))] == ["a_model", "b_model"]
    assert [w.name for w in resolve_suite(str(single))] == ["single"]
    mixed = resolve_suite(f"{single},{folder},seeds-small")
    assert [w.name for w in mixed] == ["single", "a_model", "b_model", "conv2d_mul_leaky_gelu_small",
                                       "convt2d_global_mean_bias_logsumexp_small"]


def test_model_file_without_the_layout_is_rejected_naming_what_is_missing(tmp_path: Path) -> None:
    bad = write_model(tmp_path, "bad", "import torch\nclass Model(torch.nn.Module):\n    pass\n")
    with pytest.raises(SuiteError) as info:
        load_workload(bad)
    message = str(info.value)
    assert "bad.py" in message and "get_inputs, get_init_inputs" in message
    assert "Model," not in message.split("does not define")[1].split("(")[0]


def test_unimportable_missing_and_unknown_suite_entries_error_clearly(tmp_path: Path) -> None:
    broken = write_model(tmp_path, "broken", "raise ValueError('boom')\n")
    with pytest.raises(SuiteError, match="importing .*broken.py failed: ValueError: boom"):
        load_workload(broken)
    with pytest.raises(SuiteError, match="does not exist"):
        resolve_suite(str(tmp_path / "nope.py"))
    with pytest.raises(SuiteError, match="neither a suite name"):
        resolve_suite("no-such-suite")
    with pytest.raises(SuiteError, match="no model files"):
        (tmp_path / "empty").mkdir()
        resolve_suite(str(tmp_path / "empty"))


def test_two_files_with_the_same_name_are_an_error(tmp_path: Path) -> None:
    a = write_model(tmp_path / "a", "same")
    b = write_model(tmp_path / "b", "same")
    with pytest.raises(SuiteError, match="two model files are named 'same'"):
        resolve_suite([str(a), str(b)])
    assert len(resolve_suite([str(a), str(a)])) == 1


def test_missing_suite_folder_says_where_it_looked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(suite, "demos_dir_candidates", lambda: [tmp_path / "x" / "demos"])
    with pytest.raises(SuiteError, match=r"demos/seeds.*looked in: .*x/demos/seeds.*FUSION_DEMOS_DIR.*--suite"):
        resolve_suite("seeds")
    with pytest.raises(SuiteError, match=r"demos/convnets/ .*looked in: .*x/demos/convnets\b"):
        resolve_suite("convnets")


def test_demos_folder_from_the_environment_comes_first_and_each_suite_finds_its_folder(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    demos = tmp_path / "my_demos"
    names = ("conv2d_mul_leaky_gelu_small", "convt2d_global_mean_bias_logsumexp_small")
    write_model(demos / "seeds", names[0])
    write_model(demos / "seeds", names[1], TINY_CONVT)
    monkeypatch.setenv("FUSION_DEMOS_DIR", str(demos))
    assert suite.demos_dir_candidates()[0] == demos
    small = resolve_suite("seeds-small")
    assert [w.path for w in small] == [demos / "seeds" / f"{name}.py" for name in names]
    # my_demos/ has no convnets/: that suite falls through to the repository's demos/.
    assert suite.suite_dir("convnets") == Path(suite.__file__).resolve().parents[2] / "demos" / "convnets"


def test_filter_keeps_substring_and_glob_matches() -> None:
    workloads = resolve_suite("seeds")
    assert [w.name for w in filter_workloads(workloads, "small")] == [
        "conv2d_mul_leaky_gelu_small", "convt2d_global_mean_bias_logsumexp_small"]
    assert [w.name for w in filter_workloads(workloads, "conv?d_*,convt2d_*_small")] == [
        "conv2d_mul_leaky_gelu", "conv2d_mul_leaky_gelu_small", "convt2d_global_mean_bias_logsumexp_small"]


def test_build_gives_identical_weights_and_inputs_for_the_same_seed(tiny: Workload) -> None:
    (m1, x1), (m2, x2) = tiny.build(7), tiny.build(7)
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters(), strict=True))
    assert torch.equal(x1[0], x2[0])


#: Every convnets workload: input shape, whether it is channels-last, the conv as (class, in, out, kernel,
#: stride, padding, groups), the layers after it, and the output shape at full size.
CONVNETS: dict[str, tuple[tuple[int, ...], bool, tuple[Any, ...], tuple[str, ...], tuple[int, ...]]] = {
    "conv2d_64_k3_relu":
        ((32, 64, 56, 56), False, ("Conv2d", 64, 64, 3, 1, 1, 1), ("ReLU",), (32, 64, 56, 56)),
    "conv2d_128_256_k3_s2_relu":
        ((32, 128, 28, 28), False, ("Conv2d", 128, 256, 3, 2, 1, 1), ("ReLU",), (32, 256, 14, 14)),
    "conv2d_256_k3_relu_maxpool":
        ((16, 256, 56, 56), False, ("Conv2d", 256, 256, 3, 1, 1, 1), ("ReLU", "MaxPool2d"), (16, 256, 28, 28)),
    "conv2d_depthwise_144_k3_relu6":
        ((32, 144, 56, 56), False, ("Conv2d", 144, 144, 3, 1, 1, 144), ("ReLU6",), (32, 144, 56, 56)),
    "conv2d_128_k3_silu":
        ((8, 128, 128, 128), False, ("Conv2d", 128, 128, 3, 1, 1, 1), ("SiLU",), (8, 128, 128, 128)),
    "convt2d_128_64_k2_s2_relu":
        ((8, 128, 64, 64), False, ("ConvTranspose2d", 128, 64, 2, 2, 0, 1), ("ReLU",), (8, 64, 128, 128)),
    "convt2d_256_128_k4_s2_relu":
        ((64, 256, 16, 16), False, ("ConvTranspose2d", 256, 128, 4, 2, 1, 1), ("ReLU",), (64, 128, 32, 32)),
    "convt2d_64_3_k4_s2_tanh":
        ((64, 64, 32, 32), False, ("ConvTranspose2d", 64, 3, 4, 2, 1, 1), ("Tanh",), (64, 3, 64, 64)),
    "conv3d_32_64_k3_leaky_maxpool":
        ((2, 32, 64, 64, 64), False, ("Conv3d", 32, 64, 3, 1, 1, 1), ("LeakyReLU", "MaxPool3d"),
         (2, 64, 32, 32, 32)),
    "convt3d_64_32_k2_s2_relu":
        ((2, 64, 32, 32, 32), False, ("ConvTranspose3d", 64, 32, 2, 2, 0, 1), ("ReLU",), (2, 32, 64, 64, 64)),
    "conv1d_80_256_k5_gelu":
        ((16, 80, 3000), False, ("Conv1d", 80, 256, 5, 1, 2, 1), ("GELU",), (16, 256, 3000)),
    "conv2d_512_k3_global_mean":
        ((32, 512, 7, 7), False, ("Conv2d", 512, 512, 3, 1, 1, 1), (), (32, 512)),
    "conv2d_64_k3_relu_batch1":
        ((1, 64, 56, 56), False, ("Conv2d", 64, 64, 3, 1, 1, 1), ("ReLU",), (1, 64, 56, 56)),
    "conv2d_128_k3_silu_batch1":
        ((1, 128, 128, 128), False, ("Conv2d", 128, 128, 3, 1, 1, 1), ("SiLU",), (1, 128, 128, 128)),
    "conv1d_80_256_k5_gelu_batch1":
        ((1, 80, 3000), False, ("Conv1d", 80, 256, 5, 1, 2, 1), ("GELU",), (1, 256, 3000)),
    "conv2d_64_k3_relu_channels_last":
        ((32, 64, 56, 56), True, ("Conv2d", 64, 64, 3, 1, 1, 1), ("ReLU",), (32, 64, 56, 56)),
    "conv2d_256_k3_relu_maxpool_channels_last":
        ((16, 256, 56, 56), True, ("Conv2d", 256, 256, 3, 1, 1, 1), ("ReLU", "MaxPool2d"), (16, 256, 28, 28)),
    "convt2d_128_64_k2_s2_relu_channels_last":
        ((8, 128, 64, 64), True, ("ConvTranspose2d", 128, 64, 2, 2, 0, 1), ("ReLU",), (8, 64, 128, 128)),
}


def test_convnets_suite_runs_every_file_of_demos_convnets_in_registry_order() -> None:
    workloads = resolve_suite("convnets")
    assert [w.name for w in workloads] == list(CONVNETS)
    folder = workloads[0].path.parent
    assert folder.name == "convnets" and folder.parent.name == "demos"
    on_disk = {p.name for p in folder.glob("*.py") if not p.name.startswith("_")}
    assert on_disk == set(SUITES["convnets"].files)  # no file left out of the suite, none missing


def test_convnets_models_have_the_documented_layers_and_shapes_and_run_on_cpu() -> None:
    """Full size on the meta device (shapes without allocating the inputs); a real forward on CPU with
    the same channels and a few pixels."""
    for workload in resolve_suite("convnets"):
        in_shape, channels_last, conv_spec, after, out_shape = CONVNETS[workload.name]
        module = workload.module
        doc = (module.__doc__ or "").strip()
        assert doc and "\n" not in doc, f"{workload.name}: docstring must be one line"
        assert conv_spec[0] in doc and "x".join(map(str, in_shape[1:])) in doc, (workload.name, doc)
        with torch.device("meta"):
            model = module.Model(*module.get_init_inputs())
            (x,) = module.get_inputs()
            out = model(x)
        conv, *rest = list(model.children())
        kind, cin, cout, k, stride, padding, groups = conv_spec
        assert (type(conv).__name__, conv.in_channels, conv.out_channels, conv.kernel_size[0], conv.stride[0],
                conv.padding[0], conv.groups) == conv_spec, workload.name
        assert tuple(type(m).__name__ for m in rest) == after, workload.name
        assert tuple(x.shape) == in_shape and tuple(out.shape) == out_shape, workload.name
        assert (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)
                and not x.is_contiguous()) == channels_last, workload.name

        model = module.Model(*module.get_init_inputs())
        small = torch.rand(1, cin, *([16] if x.dim() == 3 else [6] * (x.dim() - 2)))
        if channels_last:
            small = small.to(memory_format=torch.channels_last)
        with torch.no_grad():
            y = model(small)
        assert y.shape[:2] == (1, cout) and bool(torch.isfinite(y).all()), workload.name
    leaky = resolve_suite(str(Path(suite.__file__).resolve().parents[2] / "demos" / "convnets"
                              / "conv3d_32_64_k3_leaky_maxpool.py"))[0]
    assert leaky.module.Model(*leaky.module.get_init_inputs()).leaky_relu.negative_slope == 0.01


#: The families workloads: what each fuses today (pattern -> regions) on a few pixels, and the near miss
#: that names why the rest stays with Inductor.
FAMILIES = {
    "conv2d_64_k3_batchnorm_train_relu": ({"conv_batch_norm": 1}, None),
    "convt2d_64_32_k4_s2_groupnorm_silu": ({"conv_group_norm": 1}, None),
    "upsample2x_conv2d_128_k3_groupnorm_silu": ({"conv_group_norm": 1}, None),
    "conv3d_16_32_k3_softmax_mul": ({"conv_channel_reduce": 1}, None),
    "conv2d_64_128_k3_min_tanh": ({"conv_channel_reduce": 1}, None),
    "conv2d_3_64_k7_s2_batchnorm_eval_relu_maxpool": ({"conv_epilogue": 1}, None),
    "conv2d_3_64_k7_s2_batchnorm_train_relu_maxpool": ({"conv_batch_norm": 1}, None),
    "conv2d_64_k3_layernorm_chw_relu": ({"conv_layer_norm": 1}, None),
}
#: Workloads whose model fixes its spatial size (a layer norm over (C, H, W)): run at full spatial size, batch 2.
FULL_SPATIAL = {"conv2d_64_k3_layernorm_chw_relu"}


def test_families_suite_runs_every_file_and_says_what_fuses_and_why_not() -> None:
    from fusion_backend.testing import dry_run

    workloads = resolve_suite("families")
    assert [w.name for w in workloads] == list(FAMILIES)
    on_disk = {p.name for p in workloads[0].path.parent.glob("*.py") if not p.name.startswith("_")}
    assert on_disk == set(SUITES["families"].files)
    for workload in workloads:
        module = workload.module
        model = module.Model(*module.get_init_inputs())
        (x,) = module.get_inputs()
        small = torch.randn(2, *x.shape[1:]) if workload.name in FULL_SPATIAL else torch.randn(2, x.shape[1], *[8] * (x.dim() - 2))
        counts, reason = FAMILIES[workload.name]
        result = dry_run(model, [small])
        assert result.counts() == counts, (workload.name, result)
        if reason is not None:
            assert any(reason in m.message for m in result.near_misses), (workload.name, result.near_misses)


# -- backends and config -------------------------------------------------------------------------------------


def test_backend_names_resolve_to_torch_compile_settings() -> None:
    assert resolve_backend("inductor-max-autotune").description == (
        "torch.compile(m, backend='inductor', mode='max-autotune')")
    assert resolve_backend("aot_eager").description == "torch.compile(m, backend='aot_eager')"
    assert "max-autotune-no-cudagraphs" in resolve_backend("inductor:max-autotune-no-cudagraphs").description
    assert resolve_backend("inductor-max-autotune").cudagraphs
    assert resolve_backend("fusion-via-inductor").description == (
        "torch.compile(m, backend='fusion', options={'direct': False})")
    assert resolve_backend("fusion-unfused").options == {"decide": "inductor"}
    assert not resolve_backend("inductor:max-autotune-no-cudagraphs").cudagraphs
    assert [b.name for b in resolve_backends(["eager", "broken"], {"broken": BROKEN})] == ["eager", "broken"]
    with pytest.raises(BackendSpecError, match="unknown backend 'nonsense'.*eager"):
        resolve_backend("nonsense")


def test_fusion_unfused_matches_but_leaves_every_region_to_inductor() -> None:
    from fusion_backend.report import collect_reports

    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
    x = torch.randn(2, 3, 8, 8)
    with collect_reports() as reports:
        out = resolve_backend("fusion-unfused").compile(model)(x)
    torch.testing.assert_close(out, model(x))
    assert [m.pattern for r in reports for m in r.matches] == []
    assert [d.fused for r in reports for d in r.decisions] == [False]


def test_config_rejects_unknown_dtypes_modes_and_duplicates() -> None:
    with pytest.raises(ConfigError, match="unknown dtype 'fp8'"):
        BenchConfig(dtypes=("fp8",))
    with pytest.raises(ConfigError, match="unknown mode"):
        BenchConfig(modes=("serve",))
    with pytest.raises(ConfigError, match="duplicate"):
        BenchConfig(backends=("eager", "eager"))


def test_adaptive_repetitions_aim_at_the_target_time_within_bounds() -> None:
    cfg = MeasureConfig(target_ms=300.0, min_reps=10, max_reps=1000, rounds=1)
    assert cfg.choose_reps(1.5) == 200
    assert MeasureConfig(target_ms=300.0, rounds=3).choose_reps(1.5) == 66  # the target covers all rounds
    assert cfg.choose_reps(100.0) == 10
    assert cfg.choose_reps(0.001) == 1000
    assert MeasureConfig(reps=7).choose_reps(1.0) == 7
    stats = TimingStats.from_samples([5.0, 1.0, 2.0, 4.0, 3.0])
    assert (stats.median_ms, stats.min_ms, stats.max_ms, stats.reps) == (3.0, 1.0, 5.0, 5)
    assert stats.host_median_ms is None  # a timer that does not read the host


def test_the_host_time_comes_from_the_round_the_reading_comes_from() -> None:
    quiet = TimingStats.from_samples([2.0, 2.2], host_ms=[1.9, 2.1])
    noisy = TimingStats.from_samples([5.0, 5.2], host_ms=[4.9, 5.1])
    both = TimingStats.of_rounds([noisy, quiet])
    assert (both.median_ms, both.host_median_ms) == (2.1, 2.0)


def test_compile_mode_applies_to_every_compiled_backend_and_rejects_a_conflicting_one() -> None:
    assert with_compile_mode(["eager", "inductor", "fusion"], "reduce-overhead") == [
        "eager", "inductor:reduce-overhead", "fusion:reduce-overhead"]
    assert with_compile_mode(["inductor:reduce-overhead", "aot_eager"], "reduce-overhead") == [
        "inductor:reduce-overhead", "aot_eager:reduce-overhead"]  # the same mode twice is no conflict
    assert with_compile_mode(["inductor-max-autotune"], "max-autotune") == ["inductor-max-autotune"]
    assert with_compile_mode(["inductor", "fusion"], None) == ["inductor", "fusion"]
    with pytest.raises(BackendSpecError, match="conflicts with backend 'inductor:max-autotune'"):
        with_compile_mode(["fusion", "inductor:max-autotune"], "reduce-overhead")
    with pytest.raises(BackendSpecError, match="conflicts with backend 'fusion-max-autotune'"):
        with_compile_mode(["fusion-max-autotune"], "reduce-overhead")
    assert with_compile_mode(["fusion-via-inductor", "fusion-decide-all"], "reduce-overhead") == [
        "fusion-via-inductor:reduce-overhead", "fusion-decide-all:reduce-overhead"]  # options and a mode: fusion's
    with pytest.raises(ConfigError, match="unknown --compile-mode 'turbo'.*reduce-overhead"):
        with_compile_mode(["inductor"], "turbo")


def test_a_fusion_backend_with_options_takes_a_mode_as_its_inductor_options(monkeypatch) -> None:
    """torch.compile takes a mode or options: ``fusion-fused:reduce-overhead`` passes the options with the
    mode's Inductor options (CUDA graphs) among them, and is known to replay graphs."""
    backend = resolve_backend("fusion-fused:reduce-overhead")
    assert (backend.compiler, backend.mode, backend.options, backend.cudagraphs) == (
        "fusion", "reduce-overhead", {"decide": "fuse"}, True)
    seen = {}
    monkeypatch.setattr(torch, "compile", lambda module, **kwargs: seen.update(kwargs))
    backend.compile(torch.nn.Identity())
    assert "mode" not in seen and seen["options"]["decide"] == "fuse"
    assert seen["options"]["triton.cudagraphs"] is True
    from fusion_backend.options import FusionOptions
    opts = FusionOptions.parse(seen["options"], ("a",))  # fusion takes them
    assert opts.decide == "fuse" and opts.inductor["triton.cudagraphs"] is True


def test_cudagraph_modes_and_the_cudagraphs_backend_are_known_to_replay_graphs() -> None:
    ro = resolve_backend("fusion:reduce-overhead")
    assert ro.cudagraphs and (ro.compiler, ro.mode) == ("fusion", "reduce-overhead")
    assert resolve_backend("inductor:reduce-overhead").cudagraphs
    assert resolve_backend("cudagraphs").cudagraphs
    assert not resolve_backend("fusion").cudagraphs and not resolve_backend("eager").cudagraphs


def test_the_verdict_compares_fusion_with_the_inductor_backend_of_the_same_mode() -> None:
    assert pick_contenders(["eager", "inductor", "fusion"]) == ("fusion", "inductor")
    assert pick_contenders(["inductor", "inductor:reduce-overhead", "fusion:reduce-overhead"]) == (
        "fusion:reduce-overhead", "inductor:reduce-overhead")
    assert pick_contenders(["inductor-max-autotune", "fusion-max-autotune", "inductor"]) == (
        "fusion-max-autotune", "inductor-max-autotune")
    assert pick_contenders(["fusion-via-inductor", "fusion:default", "inductor"]) == ("fusion:default", "inductor")
    assert pick_contenders(["eager", "fusion"]) == ("fusion", None)
    assert pick_contenders(["eager", "inductor"]) == (None, "inductor")


# -- the correctness gate ------------------------------------------------------------------------------------


def test_backend_adding_1e_2_to_the_output_is_a_fail_and_is_never_timed(tiny: Workload) -> None:
    wrong = adds_offset(1e-2)
    timer = FakeTimer({"eager": 2.0, wrong.name: 0.1})  # it would look 20x faster if it were timed
    report = run([tiny], [BUILTIN_EAGER, wrong], timer=timer)
    for case in report.cases:
        item = case.item(wrong.name)
        assert item is not None and item.status is Status.FAIL
        assert "output[0]: rel err" in item.error and "> 1.0e-04" in item.error
        assert item.warm is None and item.cold is None and item.memory is None and item.median_ms is None
        assert case.speedup(wrong.name, "eager") is None
        assert case.item("eager").status is Status.OK  # type: ignore[union-attr]
    assert all(backend == "eager" for backend, _ in timer.timed)
    assert not report.all_ok
    table = summary_table(report)
    assert "FAIL" in table and f"FAIL: {wrong.name}" in table


def test_wrong_gradients_fail_train_mode_and_name_the_gradient(tiny: Workload) -> None:
    report = run([tiny], [BUILTIN_EAGER, WRONG_GRAD])
    infer, train = (c.item("wrong-grad") for c in report.cases)
    assert infer is not None and infer.status is Status.OK  # the forward is right
    assert train is not None and train.status is Status.FAIL
    assert "grad inputs[0]" in train.error
    assert {c.name for c in train.check.failures} == {  # type: ignore[union-attr]
        "grad inputs[0]", "grad param conv.weight", "grad param conv.bias", "grad param scale"}


def test_a_backend_that_raises_is_an_error_and_the_run_goes_on(tiny: Workload) -> None:
    report = run([tiny], [BUILTIN_EAGER, BROKEN])
    for case in report.cases:
        item = case.item("broken")
        assert item is not None and item.status is Status.ERROR
        assert "RuntimeError: this backend cannot compile anything" in item.error
        assert case.item("eager").ok  # type: ignore[union-attr]


def test_a_correct_torch_compile_backend_passes_forward_and_every_gradient(tiny: Workload) -> None:
    report = run([tiny], [BUILTIN_EAGER, resolve_backend("aot_eager")], modes=("train",))
    item = report.cases[0].item("aot_eager")
    assert item is not None and item.status is Status.OK, item
    assert item.check is not None and len(item.check.checks) == 5  # output + 4 gradients
    assert item.check.max_rel_err < 1e-6
    assert item.graph_breaks == 0
    assert item.compile_s == pytest.approx(0.5)  # the fake clock advances 0.5 s per reading


def test_bf16_autocast_is_checked_with_the_bf16_tolerance(tiny: Workload) -> None:
    report = run([tiny], [BUILTIN_EAGER, adds_offset(1e-3)], dtypes=("bf16",), modes=("infer",))
    item = report.cases[0].item("plus0.001")
    assert item is not None and item.status is Status.OK  # 1e-3 offset is inside bf16's 2e-2
    assert report.cases[0].item("eager").check.tolerance == 2e-2  # type: ignore[union-attr]


def test_beyond_the_tolerance_a_result_closer_to_float64_than_eager_passes(
        tiny: Workload, monkeypatch: pytest.MonkeyPatch) -> None:
    made = []
    original = Runner._fp64_reference

    def counting(self: Runner, *args: Any, **kwargs: Any) -> Any:
        made.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Runner, "_fp64_reference", counting)
    noisy = BenchBackend("noisy", lambda m: (lambda *a: m(*a) * (1 + 1e-5)), "1e-5 relative error",
                         uses_dynamo=False)
    tight = {"fp32": 1e-9}  # so that even float64-inside fails rule 1 and rule 2 decides
    report = run([tiny], [BUILTIN_EAGER, MORE_ACCURATE, noisy], tolerances=tight)
    for case in report.cases:
        better, worse = case.item("float64-inside"), case.item("noisy")
        assert better is not None and better.status is Status.OK, better
        assert better.check is not None and "output[0]" in better.check.passed_by_fp64
        assert worse is not None and worse.status is Status.FAIL
        assert "vs float64" in worse.error and "2 x eager's" in worse.error
    assert len(made) == 2  # once per case, shared by both backends that needed it
    assert "*" in details_table(report)

    strict = run([tiny], [BUILTIN_EAGER, MORE_ACCURATE], tolerances=tight, fp64_check=False)
    assert all(c.item("float64-inside").status is Status.FAIL for c in strict.cases)  # type: ignore[union-attr]


def test_fp32_tolerance_widens_to_tf32_noise_only_while_tf32_convs_are_allowed() -> None:
    config = BenchConfig()
    assert config.tolerance("fp32", conv_tf32=False) == 1e-4
    assert config.tolerance("fp32", conv_tf32=True) == 2e-3
    assert config.tolerance("bf16", conv_tf32=True) == 2e-2
    assert BenchConfig(tolerances={"fp32": 1e-6}).tolerance("fp32", conv_tf32=True) == 1e-6


def test_an_interrupted_run_keeps_the_cases_that_finished(tiny: Workload) -> None:
    calls = []

    def interrupt_second_time(module: torch.nn.Module) -> Callable[..., Any]:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return module

    stopper = BenchBackend("stopper", interrupt_second_time, "Ctrl-C during the 2nd case", uses_dynamo=False)
    report = run([tiny], [BUILTIN_EAGER, stopper])
    assert not report.complete and [c.mode for c in report.cases] == ["infer"]
    assert "PARTIAL REPORT" in format_report(report)


def test_a_stop_request_whose_interrupt_was_lost_still_ends_the_run_after_the_item(tiny: Workload) -> None:
    # A signal handler's KeyboardInterrupt raised inside a finalizer is dropped by Python: the request
    # itself (the event the handler sets) stops the run after the item it arrived in.
    requested, compiled = [], []

    def request_stop_second_time(module: torch.nn.Module) -> Callable[..., Any]:
        compiled.append(1)
        if len(compiled) == 2:
            requested.append(True)  # the handler ran; its exception went nowhere
        return module

    after: list[int] = []
    quiet = BenchBackend("quiet", request_stop_second_time, "a stop request during the 2nd case", uses_dynamo=False)
    later = BenchBackend("later", lambda module: after.append(1) or module, "the item after it", uses_dynamo=False)
    report = run([tiny], [BUILTIN_EAGER, quiet, later], stop_requested=lambda: bool(requested))
    assert not report.complete and [c.mode for c in report.cases] == ["infer"]
    assert len(compiled) == 2 and len(after) == 1  # the 2nd case stopped before its next item


@pytest.mark.heavy
def test_sigterm_ends_a_command_line_run_with_a_partial_report(tmp_path: Path) -> None:
    """``timeout``, job schedulers and CI stop a run with SIGTERM: like Ctrl-C, the finished cases are
    written (``complete: false``) and the command exits 130."""
    import json
    import signal
    import subprocess
    import sys

    # The train case is slow (3 s per forward) so that the signal lands in it even on a loaded machine
    # (the infer case, run under no_grad, stays quick).  Its first forward, the eager reference the case
    # computes before it says "compiling", is not: its 3 s were spent before the signal was sent.
    slow = TINY_CONV.replace(
        "    def forward(self, x):\n",
        "    def forward(self, x):\n"
        "        TRAIN_FORWARDS[0] += torch.is_grad_enabled()\n"
        "        time.sleep((3.0 if TRAIN_FORWARDS[0] > 1 else 0.0) if torch.is_grad_enabled() else 0.05)\n",
    )
    model = write_model(tmp_path / "models", "slow", "import time\nTRAIN_FORWARDS = [0]\n" + slow)
    out_dir = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fusion_backend", "bench", "--suite", str(model), "--backends", "eager",
         "--dtype", "fp32", "--mode", "infer,train", "--check-only", "--no-fp64-check", "--out", str(out_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stderr is not None
    for line in proc.stderr:  # the first case has been recorded; the second has started
        if "train eager: compiling" in line:
            break
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, stdout
    assert "interrupted: partial report" in stdout
    report = json.loads((out_dir / "bench.json").read_text())
    assert report["complete"] is False and [c["mode"] for c in report["cases"]] == ["infer"]


def test_compare_tensor_flags_structural_differences() -> None:
    x = torch.ones(3)
    assert compare_tensor("t", x, x.clone(), 1e-4).ok
    assert "shape" in compare_tensor("t", torch.ones(4), x, 1e-4).problem
    assert "dtype" in compare_tensor("t", x.double(), x, 1e-4).problem
    assert "missing on the backend side" in compare_tensor("t", None, x, 1e-4).problem
    nan = torch.tensor([1.0, float("nan"), 2.0])
    assert compare_tensor("t", nan, nan.clone(), 1e-4).ok
    assert "non-finite" in compare_tensor("t", nan, torch.tensor([1.0, 5.0, 2.0]), 1e-4).problem
    zero = torch.zeros(3)
    assert compare_tensor("t", zero + 1e-6, zero, 1e-4).ok  # zero reference: absolute error norm
    assert not compare_tensor("t", zero + 1e-3, zero, 1e-4).ok


# -- roofline ------------------------------------------------------------------------------------------------


def test_roofline_of_a_tiny_conv_counts_bytes_and_flops_from_the_shapes(tiny: Workload) -> None:
    report = run([tiny], [BUILTIN_EAGER])
    infer, train = report.cases
    n, cin, cout, h, w, k = 2, 3, 4, 8, 8, 3
    ho, wo = h - k + 1, w - k + 1
    x_b, out_b = n * cin * h * w * 4, n * cout * ho * wo * 4
    params_b = (cout * cin * k * k + cout + cout) * 4  # weight, bias, scale
    conv_flops = 2 * n * cout * ho * wo * cin * k * k
    assert infer.roofline is not None and train.roofline is not None
    assert infer.roofline.traffic == Traffic(inputs_read=x_b, params_read=params_b, outputs_written=out_b)
    assert infer.roofline.flops == conv_flops
    assert train.roofline.traffic == Traffic(
        inputs_read=x_b, params_read=params_b, outputs_written=out_b, grad_outputs_read=out_b,
        inputs_reread=x_b, params_reread=params_b, grads_written=x_b + params_b)
    assert train.roofline.flops == 3 * conv_flops  # forward, grad input, grad weight
    r = infer.roofline
    assert r.compute_unit == "fp32"  # no TF32 off CUDA (on CUDA, PyTorch's default gives "tf32")
    assert r.memory_ms == pytest.approx(r.traffic.total / 1e12 * 1e3)
    assert r.compute_ms == pytest.approx(conv_flops / 5e13 * 1e3)
    assert r.floor_ms == max(r.memory_ms, r.compute_ms) and r.bound == "memory"
    assert infer.floor_multiple("eager") == pytest.approx(2.0 / r.floor_ms)


def test_roofline_takes_the_larger_of_the_memory_and_compute_times() -> None:
    traffic = Traffic(inputs_read=10**9, params_read=0, outputs_written=10**9)
    line = roofline(traffic, 10**12, FAKE_RATES, "bf16")
    assert (line.memory_ms, line.compute_ms, line.floor_ms, line.bound) == (2.0, 2.5, 2.5, "compute")
    assert compute_unit("bf16", True) == "bf16" and compute_unit("fp32", False) == "fp32"


def test_transposed_conv_flops_count_every_input_element_times_the_kernel(tmp_path: Path) -> None:
    model, inputs = load_workload(write_model(tmp_path, "convt", TINY_CONVT)).build(0)
    with FlopCount() as fc:
        model(*inputs)
    assert fc.total == 2 * 2 * 2 * 4 * 4 * 3 * 3 * 3  # 2 * N * Cin * Hin * Win * Cout * kh * kw
    traffic = count_traffic(inputs, list(model.parameters()), [torch.zeros(2, 3)])
    assert traffic.total == (2 * 2 * 4 * 4 + 2 * 3 * 9 + 3 + 2 * 3) * 4


# -- report writing ------------------------------------------------------------------------------------------


def test_report_round_trips_through_json_and_tables_show_the_numbers(tiny: Workload, tmp_path: Path) -> None:
    events: list[ProgressEvent] = []
    backends = [BUILTIN_EAGER, FAKE_INDUCTOR, FAKE_FUSION, adds_offset(1e-2)]
    report = run([tiny], backends, events=events)
    files = write_reports(report, tmp_path / "out")
    assert read_json(files.json) == report
    data = json.loads(files.json.read_text())
    assert data["environment"]["command"] == "test" and data["schema_version"] == 1
    fusion_row = next(r for r in data["rows"] if r["backend"] == "fusion" and r["mode"] == "infer")
    assert fusion_row["median_ms"] == 0.5 and fusion_row["cold_median_ms"] == 0.625
    assert fusion_row["speedup_vs_eager"] == 4.0 and fusion_row["speedup_vs_inductor"] == 2.0
    assert fusion_row["step_peak_bytes"] == 4000 and fusion_row["held_bytes"] == 3000
    assert fusion_row["total_peak_bytes"] == 4000 and fusion_row["resident_bytes"] == 0
    fail_row = next(r for r in data["rows"] if r["backend"] == "plus0.01")
    assert fail_row["status"] == "FAIL" and fail_row["median_ms"] is None

    table = summary_table(report)
    header, _, first = table.splitlines()[:3]
    assert "fusion vs eager" in header and "fusion vs inductor" in header and "floor ms" in header
    assert "4.00x" in first and "2.00x" in first and "0.5000 (" in first and "FAIL: plus0.01" in first
    text = files.text.read_text()
    assert "Roofline" in text and "Failures (never timed)" in text and "rel err" in text
    assert "| workload |" in files.markdown.read_text()
    assert "0.6250" in details_table(report)  # cold median
    # every item is done once; the failed one (never timed) before its case's timed ones
    assert sorted(e.index for e in events if e.phase == "done") == list(range(1, 9))
    assert [e.index for e in events if e.phase == "done"][:4] == [4, 1, 2, 3]
    assert all(e.total == 8 for e in events)


def test_memory_a_backend_keeps_between_steps_counts_in_its_peak(tiny: Workload) -> None:
    # As with CUDA graphs: the step allocates little, but the backend holds 600 bytes since compiling.
    report = run([tiny], [BUILTIN_EAGER], modes=("train",), memory=FakeMemory(start=400))
    mem = report.cases[0].item("eager").memory  # type: ignore[union-attr]
    assert mem is not None and mem.resident_bytes == 600
    assert (mem.step_peak_bytes, mem.total_peak_bytes) == (4000, 4600)


def test_cuda_graph_backends_get_a_note_instead_of_a_false_zero_memory(tiny: Workload) -> None:
    graphs = BenchBackend("graphs", lambda m: m, "pretends to replay CUDA graphs", uses_dynamo=False,
                          cudagraphs=True)
    report = run([tiny], [BUILTIN_EAGER, graphs], modes=("train",))
    item = report.cases[0].item("graphs")
    assert item is not None and item.ok and item.median_ms is not None and item.memory is None
    assert "CUDA graphs" in item.notes[0] and "Notes" in format_report(report)


def test_cuda_graph_backends_start_every_call_with_a_new_cudagraph_step(
        tiny: Workload, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: calls.append("mark"))

    def logging_compile(module: torch.nn.Module) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            calls.append("forward")
            return module(*args)

        return call

    graphs = BenchBackend("graphs", logging_compile, "replays CUDA graphs", uses_dynamo=False, cudagraphs=True)
    report = run([tiny], [BUILTIN_EAGER, graphs])
    assert all(i.ok for i in report.items)
    # Per mode: the checked first call, a warm and a cold measurement per round (memory is not measured).
    rounds = MeasureConfig().rounds
    assert calls == ["mark", "forward"] * 2 * (1 + 2 * rounds)
    calls.clear()
    plain = BenchBackend("plain", logging_compile, "no CUDA graphs", uses_dynamo=False)
    run([tiny], [BUILTIN_EAGER, plain], modes=("train",))
    assert calls == ["forward"] * (2 + 2 * rounds)  # first call, memory, warm and cold per round: and no mark


def test_channels_last_inputs_reach_every_call_channels_last(tmp_path: Path) -> None:
    workload = load_workload(write_model(tmp_path, "tiny_channels_last", TINY_CHANNELS_LAST))
    # A tolerance float64-inside misses, so that the gate also runs the model on float64 copies.
    report = run([workload], [BUILTIN_EAGER, MORE_ACCURATE], tolerances={"fp32": 1e-9})
    assert all(c.item("float64-inside").check.passed_by_fp64 for c in report.cases)  # type: ignore[union-attr]
    seen = workload.module.SEEN
    assert len(seen) >= 12 and all(seen)  # reference, float64 run, first calls, timings, memory


def test_check_only_report_has_no_timings_but_keeps_the_gate(tiny: Workload, tmp_path: Path) -> None:
    report = run([tiny], [BUILTIN_EAGER, adds_offset(1e-2)], check_only=True, rates=None)
    assert all(i.warm is None and i.memory is None for i in report.items)
    assert [i.status for i in report.items] == [Status.OK, Status.FAIL, Status.OK, Status.FAIL]
    assert "floor ms" not in summary_table(report)
    assert "FAIL" in format_report(report) and "FAIL" in format_markdown(report)
    files = write_reports(report, tmp_path)
    assert files.chart is None and files.chart_note == "no timings to chart"
    assert read_json(files.json) == report


def test_chart_is_written_with_matplotlib_or_skipped_with_a_note(tiny: Workload, tmp_path: Path) -> None:
    report = run([tiny], [BUILTIN_EAGER, FAKE_FUSION])
    files = write_reports(report, tmp_path)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert files.chart is None and "matplotlib" in files.chart_note
    else:
        assert files.chart is not None and files.chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_non_finite_numbers_are_written_as_strict_json(tiny: Workload, tmp_path: Path) -> None:
    report = run([tiny], [BUILTIN_EAGER, BenchBackend("nan", lambda m: (lambda *a: m(*a) * math.nan), "nan",
                                                      uses_dynamo=False)], modes=("infer",))
    path = write_reports(report, tmp_path).json
    assert "NaN" not in path.read_text()
    assert read_json(path).cases[0].item("nan").status is Status.FAIL  # type: ignore[union-attr]


# -- the verdict ---------------------------------------------------------------------------------------------


def synthetic_report(rows: list[tuple[str, str, str, dict[str, float | Status]]],
                     backends: tuple[str, ...] = ("eager", "inductor", "fusion")) -> BenchReport:
    """A report without running anything: per row, each backend's warm median in ms or its failure
    (backends a row does not name took 1 ms); every timed item's first call took 2.5 s."""
    cases = []
    for workload, dtype, mode, results in rows:
        items = []
        for backend in backends:
            result = results.get(backend, 1.0)
            if isinstance(result, Status):
                items.append(ItemResult(workload, dtype, mode, backend, result, error="synthetic failure"))
            else:
                items.append(ItemResult(workload, dtype, mode, backend, Status.OK, compile_s=2.5,
                                        warm=TimingStats.from_samples([result])))
        cases.append(CaseResult(workload, dtype, mode, roofline=None, items=tuple(items)))
    return BenchReport(config=BenchConfig(backends=backends), environment={"command": "test"}, rates=None,
                       workloads={}, cases=tuple(cases))


def test_a_speedup_pairs_the_rounds_the_two_backends_were_timed_in_together() -> None:
    """Round by round, fusion and Inductor took about the same time, but fusion's quietest round was
    quieter than any of Inductor's: the paired ratio says 1.02x, not the quietest rounds' 1.5x.
    Rounds that do not pair up (different counts) fall back to the medians' ratio."""
    def item(backend: str, rounds: list[float]) -> ItemResult:
        warm = TimingStats.of_rounds([TimingStats.from_samples([t]) for t in rounds])
        return ItemResult("conv", "fp32", "train", backend, Status.OK, warm=warm)

    case = CaseResult("conv", "fp32", "train", roofline=None,
                      items=(item("fusion", [1.0, 1.5, 1.52]), item("inductor", [1.6, 1.5, 1.55])))
    assert case.speedup("fusion", "inductor") == pytest.approx(1.55 / 1.52)
    assert case.item("inductor").median_ms / case.item("fusion").median_ms == pytest.approx(1.5)
    unpaired = CaseResult("conv", "fp32", "train", roofline=None,
                          items=(item("fusion", [1.0, 1.5]), item("inductor", [1.6, 1.5, 1.55])))
    assert unpaired.speedup("fusion", "inductor") == pytest.approx(1.5)


def test_verdict_counts_ties_at_0_97_names_the_slowest_row_and_takes_the_geomean() -> None:
    report = synthetic_report([
        ("conv_a", "fp32", "infer", {"inductor": 2.0, "fusion": 1.0}),   # 2x faster
        ("conv_b", "fp32", "train", {"inductor": 1.0, "fusion": 1.0}),   # equal
        ("conv_c", "bf16", "infer", {"inductor": 0.97, "fusion": 1.0}),  # 0.97x: a tie, counts
        ("conv_d", "bf16", "train", {"inductor": 0.96, "fusion": 1.0}),  # 0.96x: slower
        ("conv_e", "fp32", "infer", {"inductor": 0.9, "fusion": 1.0}),   # 0.90x: the worst
    ])
    verdict = verdict_of(report)
    assert (verdict.at_least_baseline, verdict.compared, len(verdict.rows)) == (3, 5, 5)
    assert verdict.geomean == pytest.approx((2.0 * 1.0 * 0.97 * 0.96 * 0.9) ** (1 / 5))
    assert verdict.worst is not None and verdict.worst.label == "conv_e fp32 infer"
    assert verdict.line() == ("fusion >= inductor on 3/5 rows (0.97x counts as a tie); worst: conv_e fp32 infer "
                              "0.90x; geomean vs inductor 1.11x")


def test_verdict_says_which_rows_below_the_tie_ran_inductor_s_code_in_both_columns() -> None:
    """A fusion item that rewrote no region runs Inductor's code: the line counts such rows among
    those below the tie and marks the worst row if it is one; the counts themselves do not change."""
    def with_regions(report: BenchReport, fused: dict[str, int]) -> BenchReport:
        cases = tuple(dataclasses.replace(case, items=tuple(
            dataclasses.replace(item, fused_regions=fused[case.workload]) if item.backend == "fusion" else item
            for item in case.items)) for case in report.cases)
        return dataclasses.replace(report, cases=cases)

    report = with_regions(synthetic_report([
        ("conv_a", "fp32", "infer", {"inductor": 2.0, "fusion": 1.0}),   # fused, 2x
        ("conv_b", "fp32", "train", {"inductor": 0.95, "fusion": 1.0}),  # Inductor's code, 0.95x
        ("conv_c", "bf16", "infer", {"inductor": 0.96, "fusion": 1.0}),  # fused, 0.96x
    ]), {"conv_a": 1, "conv_b": 0, "conv_c": 2})
    verdict = verdict_of(report)
    assert [r.same_code for r in verdict.rows] == [False, True, False]
    assert verdict.at_least_baseline == 1
    assert verdict.line() == (
        "fusion >= inductor on 1/3 rows (0.97x counts as a tie; of the 2 rows below, 1 ran Inductor's code in "
        "both columns); worst: conv_b fp32 train 0.95x (Inductor's code in both columns); geomean vs inductor 1.22x")
    assert verdict.json_extras()["worst"]["same_code"] is True  # type: ignore[index]
    unknown = verdict_of(synthetic_report([("conv_b", "fp32", "train", {"inductor": 0.95, "fusion": 1.0})]))
    assert "Inductor's code" not in unknown.line(), "a report without the count claims nothing"


def test_the_fusion_item_records_how_many_regions_it_rewrote(tiny: Workload) -> None:
    """The real backend on the tiny conv -> relu: forced to fuse it rewrites the one region; told to
    leave every region to Inductor it rewrites none; the other backends' items record nothing."""
    backends = [BUILTIN_EAGER, resolve_backend("inductor"), resolve_backend("fusion-fused"),
                resolve_backend("fusion-unfused")]
    report = run([tiny], backends, modes=("infer",), timer=FakeTimer({}))
    items = {item.backend: item for item in report.cases[0].items}
    assert all(item.ok for item in items.values()), {b: i.error for b, i in items.items()}
    assert (items["fusion-fused"].fused_regions, items["fusion-unfused"].fused_regions) == (1, 0)
    assert items["inductor"].fused_regions is None and items["eager"].fused_regions is None


def test_a_row_whose_decisions_were_deferred_is_checked_and_timed_on_its_settled_code(
        tiny: Workload, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a decision left pending by the first call (a fake background compile that is done at
    once, a fake region timer that makes the fused op win), the row settles before the check: its
    notes and region count are the settled graph's, and it records how long settling took."""
    from fusion_backend.runtime import decision, deferred

    monkeypatch.setenv("FUSION_CACHE_DIR", str(tmp_path / "fusion"))  # no decision cached yet
    decision.forget_in_memory()

    class DoneAtOnce:
        def ready(self) -> bool:
            return True

        def collect(self, timeout: float) -> int:
            return 0

    fusion = torch_compile_backend("fusion-measured", "fusion", options={"decide": "measure"})
    with deferred.preparing_with(lambda *args: DoneAtOnce()), \
            decision.timing_override(lambda steps: {"fused": 1.0, "inductor": 2.0}, measure_on=("cpu",)):
        report = run([tiny], [BUILTIN_EAGER, fusion], modes=("infer",), timer=FakeTimer({}))
    item = report.cases[0].item("fusion-measured")
    assert item.ok, item.error
    assert item.fused_regions == 1 and item.settle_s is not None and item.settle_s >= 0
    assert len(item.notes) == 1 and "fused: fused is faster" in item.notes[0]


def test_a_failed_fusion_row_never_counts_and_is_the_worst_row_ahead_of_any_slow_one() -> None:
    report = synthetic_report([
        ("conv_a", "fp32", "infer", {"inductor": 1.0, "fusion": 2.0}),           # 0.5x, slow but correct
        ("conv_b", "fp32", "train", {"inductor": 1.0, "fusion": Status.FAIL}),   # wrong: worst
        ("conv_c", "bf16", "infer", {"inductor": Status.ERROR, "fusion": 0.5}),  # Inductor failed: left out
        ("conv_d", "bf16", "train", {"inductor": 3.0, "fusion": 1.0}),           # 3x faster
        ("conv_e", "bf16", "train", {"inductor": 1.0, "fusion": Status.ERROR}),  # also failed, named second
    ])
    verdict = verdict_of(report)
    assert (verdict.at_least_baseline, verdict.compared) == (1, 2)
    assert [r.problem for r in verdict.rows] == ["", "fusion FAIL", "inductor ERROR", "", "fusion ERROR"]
    assert [r.subject_failed for r in verdict.rows] == [False, True, False, False, True]
    assert verdict.line() == (
        "fusion >= inductor on 1/4 rows (0.97x counts as a tie; 2 rows without both timings counted as not >=; "
        "1 row left out as inductor failed it: conv_c bf16 infer (ERROR)); "
        "worst: conv_b fp32 train fusion FAIL; geomean vs inductor 1.22x over 2 rows")

    all_failed = synthetic_report([("conv_a", "fp32", "infer", {"fusion": Status.ERROR})])
    assert verdict_of(all_failed).line() == (
        "fusion >= inductor on 0/1 rows (0.97x counts as a tie; 1 row without both timings counted as not >=); "
        "worst: conv_a fp32 infer fusion ERROR; geomean vs inductor -: no row has both timings")


def test_verdict_reports_how_far_apart_two_copies_of_inductor_read_without_changing_any_count() -> None:
    backends = ("eager", "inductor", "fusion", "inductor:default")
    report = synthetic_report([
        ("conv_a", "fp32", "infer", {"inductor": 1.1, "fusion": 1.0, "inductor:default": 1.0}),
        ("conv_b", "fp32", "train", {"inductor": 1.8, "fusion": 2.0, "inductor:default": 1.9}),
    ], backends=backends)
    verdict = verdict_of(report)
    assert (verdict.copy, verdict.at_least_baseline) == ("inductor", 1)
    assert verdict.copies_spread == pytest.approx((1.0 / 1.1, 1.9 / 1.8))
    assert verdict.line() == (
        "fusion >= inductor:default on 1/2 rows (0.97x counts as a tie); worst: conv_b fp32 train 0.95x; "
        "geomean vs inductor:default 0.97x; inductor and inductor:default (the same code) read 0.91-1.06x apart")
    assert "apart" not in verdict_of(synthetic_report([("conv_a", "fp32", "infer", {"inductor": 2.0, "fusion": 1.0})])).line()


def test_first_calls_are_compared_with_the_inductor_copy_compiled_first_against_the_budget(tmp_path: Path) -> None:
    """Inductor's copy compiled after fusion finds the row's graph in its caches: the first calls are
    compared with the copy compiled first.  A failed row has no ratio; the verdict's counts do not move."""
    backends = ("eager", "inductor", "fusion", "inductor:default")
    report = synthetic_report([
        ("conv_a", "fp32", "infer", {"inductor": 1.0, "fusion": 0.5, "inductor:default": 1.0}),
        ("conv_b", "fp32", "train", {"inductor": 1.0, "fusion": 0.5, "inductor:default": 1.0}),
        ("conv_c", "bf16", "infer", {"fusion": Status.FAIL}),
    ], backends=backends)
    first_calls = {("conv_a", "fusion"): 5.0, ("conv_a", "inductor"): 1.0, ("conv_b", "fusion"): 3.0,
                   ("conv_b", "inductor"): 1.5, ("conv_a", "inductor:default"): 0.01, ("conv_b", "inductor:default"): 0.01}
    report = dataclasses.replace(report, cases=tuple(dataclasses.replace(case, items=tuple(
        dataclasses.replace(item, compile_s=first_calls.get((case.workload, item.backend), item.compile_s))
        for item in case.items)) for case in report.cases))
    verdict = verdict_of(report)
    assert [r.first_call_ratio for r in verdict.rows] == [pytest.approx(5.0), pytest.approx(2.0), None]
    line = verdict.first_call_line()
    assert line == "first call fusion / inductor 2.0-5.0x; 1/2 rows above the 3x budget, the highest conv_a fp32 infer"
    assert verdict.at_least_baseline == 2  # the verdict itself is unchanged
    files = write_reports(report, tmp_path, chart=False)
    assert json.loads(files.json.read_text())["verdict"]["first_call_line"] == line
    assert f"**First calls:** {line}" in files.markdown.read_text()
    assert line in files.text.read_text()
    within = synthetic_report([("conv_a", "fp32", "infer", {"inductor": 1.0, "fusion": 0.5})])
    assert verdict_of(within).first_call_line() == "first call fusion / inductor 1.0-1.0x; 0/1 rows above the 3x budget"
    assert verdict_of(synthetic_report([("conv_a", "fp32", "infer", {"fusion": Status.FAIL})])).first_call_line() == ""


def test_the_first_call_line_says_how_long_after_their_first_call_deferred_rows_settled() -> None:
    report = synthetic_report([(w, "fp32", "infer", {"inductor": 1.0, "fusion": 0.5}) for w in ("conv_a", "conv_b", "conv_c")])
    settles = {"conv_a": 2.25, "conv_b": 0.75}
    report = dataclasses.replace(report, cases=tuple(dataclasses.replace(case, items=tuple(
        dataclasses.replace(item, settle_s=settles.get(case.workload)) if item.backend == "fusion" else item
        for item in case.items)) for case in report.cases))
    assert verdict_of(report).first_call_line() == (
        "first call fusion / inductor 1.0-1.0x; 0/3 rows above the 3x budget; 2 rows decided after their first call, "
        "settled 0.8-2.2 s later")


def test_a_run_with_a_steady_state_budget_holds_each_rows_first_call_and_settle_to_it(tmp_path: Path) -> None:
    """Whole networks are held to 1.25x Inductor's first call for fusion's first call and settle
    together (``--steady-state-budget``); the clause names the row furthest over it, survives the JSON
    report, and is absent where the run sets no budget."""
    report = synthetic_report([(w, "bf16", "infer", {"inductor": 1.0, "fusion": 1.0}) for w in ("net_a", "net_b", "net_c")])
    times = {"net_a": (1.0, 2.0), "net_b": (1.5, 9.5), "net_c": (1.0, None)}  # fusion's first call, its settle

    def item(item: ItemResult) -> ItemResult:
        first, settle = times[item.workload]
        if item.backend == "fusion":
            return dataclasses.replace(item, compile_s=first, settle_s=settle)
        return dataclasses.replace(item, compile_s=8.0)

    report = dataclasses.replace(report, cases=tuple(
        dataclasses.replace(case, items=tuple(item(i) for i in case.items)) for case in report.cases))
    assert "steady state" not in verdict_of(report).first_call_line()
    budgeted = dataclasses.replace(report, config=dataclasses.replace(report.config, steady_state_budget=1.25))
    verdict = verdict_of(budgeted)
    assert [r.steady_state_ratio for r in verdict.rows] == [pytest.approx(3 / 8), pytest.approx(11 / 8),
                                                            pytest.approx(1 / 8)]
    line = verdict.first_call_line()
    assert line.endswith("; time to steady state 0.1-1.4x, 1/3 rows above the 1.25x budget, the highest net_b bf16 infer")
    files = write_reports(budgeted, tmp_path, chart=False)
    data = json.loads(files.json.read_text())
    assert data["verdict"]["first_call_line"] == line and data["config"]["steady_state_budget"] == 1.25
    assert BenchReport.from_dict(data).config.steady_state_budget == 1.25
    with pytest.raises(ConfigError, match="steady_state_budget must be > 0"):
        BenchConfig(steady_state_budget=0.0)


def test_the_steady_state_budget_is_an_option_of_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--suite", "seeds-small", "--steady-state-budget", "1.25", "--dry-run"]) == 0
    assert cli.main(["--steady-state-budget", "-1", "--dry-run"]) == 2
    assert "steady_state_budget must be > 0" in capsys.readouterr().err


def test_rows_whose_inductor_first_call_came_from_its_caches_are_held_to_the_warm_budget() -> None:
    """1.2x where Inductor's first call found its graphs in its disk caches (a rerun on warm caches),
    3x elsewhere; the highest row is the one furthest over its own budget."""
    report = synthetic_report([(w, "fp32", "infer", {"inductor": 1.0, "fusion": 0.5})
                               for w in ("conv_a", "conv_b", "conv_c", "conv_d")])
    first_calls = {"conv_a": (1.5, True), "conv_b": (2.5, False), "conv_c": (1.1, True), "conv_d": (3.3, False)}

    def item(item: ItemResult) -> ItemResult:
        ratio, warm = first_calls[item.workload]
        if item.backend == "fusion":
            return dataclasses.replace(item, compile_s=ratio)
        return dataclasses.replace(item, compile_s=1.0, from_inductor_caches=warm if item.backend == "inductor" else None)

    report = dataclasses.replace(report, cases=tuple(
        dataclasses.replace(case, items=tuple(item(i) for i in case.items)) for case in report.cases))
    assert verdict_of(report).first_call_line() == (
        "first call fusion / inductor 1.1-3.3x; 2/4 rows above the budget (3x, 1.2x where Inductor's graphs came "
        "from its caches: 2 rows), the highest conv_a fp32 infer")


def test_inductors_first_call_counts_as_warm_only_where_it_compiled_no_graph() -> None:
    assert _from_caches((4, 1), (4, 1)) is None  # no Inductor graph in this first call
    assert _from_caches((4, 1), (6, 1)) is True
    assert _from_caches((4, 1), (6, 2)) is False


def test_an_item_records_whether_inductors_first_call_came_from_its_caches(
        tiny: Workload, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On empty Inductor caches its first call compiles; a second run of the row (as a second process
    would, Dynamo reset) finds the graph in them; eager compiles nothing."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    reports = [run([tiny], [BUILTIN_EAGER, resolve_backend("inductor")], modes=("infer",), timer=FakeTimer({}))
               for _ in range(2)]
    items = [{item.backend: item for item in report.cases[0].items} for report in reports]
    assert all(item.ok for run_items in items for item in run_items.values())
    assert [i["inductor"].from_inductor_caches for i in items] == [False, True]
    assert all(i["eager"].from_inductor_caches is None for i in items)
    assert reports[1].rows()[1]["from_inductor_caches"] is True
    assert BenchReport.from_dict(json.loads(json.dumps(reports[1].to_dict()))).cases[0].items[1].from_inductor_caches


def test_verdict_without_timings_or_without_both_contenders_says_why() -> None:
    timed = [("conv_a", "fp32", "infer", {"inductor": 2.0, "fusion": 1.0})]
    no_inductor = synthetic_report(timed, backends=("eager", "fusion"))
    assert verdict_of(no_inductor).line() == (
        "no fusion-vs-inductor verdict: the run has no inductor backend (backends: eager, fusion)")
    check_only = dataclasses.replace(synthetic_report(timed), config=BenchConfig(check_only=True))
    assert verdict_of(check_only).line() == "nothing was timed (--check-only): no fusion-vs-inductor verdict"


def test_verdict_under_a_compile_mode_compares_the_backends_of_that_mode() -> None:
    backends = ("eager", "inductor", "inductor:reduce-overhead", "fusion:reduce-overhead")
    report = synthetic_report([("conv_a", "fp32", "infer", {"inductor": 0.5, "inductor:reduce-overhead": 2.0,
                                                            "fusion:reduce-overhead": 1.0})], backends=backends)
    assert verdict_of(report).line().startswith(
        "fusion:reduce-overhead >= inductor:reduce-overhead on 1/1 rows (0.97x counts as a tie); worst: conv_a "
        "fp32 infer 2.00x")
    header = summary_table(report).splitlines()[0]
    assert "fusion:reduce-overhead vs inductor:reduce-overhead" in header
    row = next(r for r in report.rows() if r["backend"] == "fusion:reduce-overhead")
    assert row["speedup_vs_inductor"] == 2.0  # against the Inductor of the same mode, not plain inductor


def test_verdict_and_first_call_times_are_in_bench_json_md_and_txt(tmp_path: Path) -> None:
    report = synthetic_report([
        ("conv_a", "fp32", "infer", {"inductor": 2.0, "fusion": 1.0}),
        ("conv_b", "fp32", "train", {"inductor": 1.0, "fusion": Status.FAIL}),
    ])
    line = verdict_of(report).line()
    assert line.startswith("fusion >= inductor on 1/2 rows")
    files = write_reports(report, tmp_path, chart=False)
    data = json.loads(files.json.read_text())
    verdict = data["verdict"]
    assert (verdict["subject"], verdict["baseline"], verdict["statistic"]) == ("fusion", "inductor", "warm median")
    assert (verdict["at_least_baseline"], verdict["compared"], verdict["total_rows"]) == (1, 1, 2)
    assert verdict["geomean"] == 2.0 and verdict["tie_ratio"] == 0.97 and verdict["line"] == line
    assert verdict["worst"] == {"workload": "conv_b", "dtype": "fp32", "mode": "train", "ratio": None,
                                "problem": "fusion FAIL", "same_code": False}
    assert read_json(files.json) == report  # the derived verdict does not disturb the round trip
    assert all(r["compile_s"] == 2.5 for r in data["rows"] if r["status"] == "ok")
    markdown = files.markdown.read_text()
    assert f"**Verdict:** {line}" in markdown
    assert "| compile s |" in markdown and "| 2.5 |" in markdown  # first call, compilation included
    assert line in files.text.read_text()


# -- command line --------------------------------------------------------------------------------------------


def test_without_cuda_the_command_says_so_and_exits_0_without_timings(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    monkeypatch.setattr(cli, "cuda_available", lambda: False)
    out_dir = tmp_path / "out"
    assert cli.main(["--suite", "seeds", "--out", str(out_dir)]) == 0
    captured = capsys.readouterr()
    assert "timing needs CUDA" in captured.err and "Nothing was timed" in captured.err
    assert captured.out == "nothing was timed (no CUDA device): no fusion-vs-inductor verdict\n"
    assert not out_dir.exists()


def test_bad_model_file_is_a_usage_error_naming_what_is_missing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = write_model(tmp_path, "bad", "def get_inputs():\n    return []\n")
    assert cli.main(["--suite", str(bad), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "bad.py is not a benchmark model file" in err and "Model, get_init_inputs" in err


def test_unknown_backend_and_dtype_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--backends", "eager,warp-drive", "--dry-run"]) == 2
    assert "unknown backend 'warp-drive'" in capsys.readouterr().err
    assert cli.main(["--dtype", "fp8", "--dry-run"]) == 2
    assert "unknown dtype 'fp8'" in capsys.readouterr().err


def test_dry_run_prints_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--suite", "seeds", "--backends", "eager,inductor-max-autotune", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "5 workload(s)" in out and "= 40 item(s)" in out and "mode='max-autotune'" in out


def test_compile_mode_option_renames_compiled_backends_and_conflicts_are_usage_errors(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--suite", "seeds-small", "--backends", "eager,inductor,fusion", "--compile-mode",
                     "reduce-overhead", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "backends eager,inductor:reduce-overhead,fusion:reduce-overhead = 24 item(s)" in out
    assert "torch.compile(m, backend='fusion', mode='reduce-overhead')" in out
    assert cli.main(["--backends", "inductor:max-autotune,fusion", "--compile-mode", "reduce-overhead",
                     "--dry-run"]) == 2
    assert "conflicts with backend 'inductor:max-autotune'" in capsys.readouterr().err
    assert cli.main(["--compile-mode", "fastest", "--dry-run"]) == 2
    assert "unknown --compile-mode 'fastest'" in capsys.readouterr().err


def test_log_prints_what_the_fusion_backend_compiles_and_times_with_the_run_s_seconds(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def run(*args: object) -> int:
        logging.getLogger("fusion_backend.decision").info("timing conv_epilogue fused vs Inductor")
        logging.getLogger("fusion_backend.launch").debug("a detail --log leaves out")
        return 0

    monkeypatch.setattr(cli, "_run", run)
    levels = {name: logging.getLogger(name).level for name in cli.FIRST_CALL_LOGGERS}
    assert cli.main(["--dry-run", "--log"]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and re.fullmatch(
        r" +\d+\.\d s fusion_backend\.decision: timing conv_epilogue fused vs Inductor", lines[0]), lines
    assert {name: logging.getLogger(name).level for name in cli.FIRST_CALL_LOGGERS} == levels
    assert cli.main(["--dry-run"]) == 0
    assert capsys.readouterr().err == ""


def test_check_only_on_cpu_runs_the_gate_and_writes_reports(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "cuda_available", lambda: False)
    model = write_model(tmp_path / "m", "tiny")
    out_dir = tmp_path / "out"
    code = cli.main(["--suite", str(model), "--backends", "eager", "--dtype", "fp32", "--check-only",
                     "--out", str(out_dir), "--tol", "fp32=1e-5"])
    assert code == 0
    captured = capsys.readouterr()
    assert "tiny" in captured.out and "ok" in captured.out
    assert captured.out.splitlines()[-1] == "nothing was timed (--check-only): no fusion-vs-inductor verdict"
    report = read_json(out_dir / "bench.json")
    assert report.config.tolerances["fp32"] == 1e-5 and report.config.check_only
    assert len(report.items) == 2 and report.all_ok
    assert "--check-only" in report.environment["command"]
    assert report.environment["cpu_affinity"] == "not pinned: no CUDA device"


BUILTIN_EAGER = resolve_backend("eager")


class DriftingTimer(FakeTimer):
    """Every backend equally fast, but the host slows down by 20% with every measurement."""

    def __init__(self) -> None:
        super().__init__({})
        self.calls = 0

    def time_one(self, step: TimedStep, cold: bool) -> TimingStats:
        super().time_one(step, cold)
        self.calls += 1
        ms = 1.2 ** self.calls
        return TimingStats.from_samples([ms, ms])


def test_backends_of_a_row_are_timed_in_interleaved_rounds_so_drift_hits_them_alike(tiny: Workload) -> None:
    timer = DriftingTimer()
    report = run([tiny], [BUILTIN_EAGER, FAKE_INDUCTOR, FAKE_FUSION], modes=("infer",), timer=timer,
                 measure=MeasureConfig(extra_rounds=0))
    names = ["eager", "inductor", "fusion"]
    rotated = [names[r % len(names):] + names[:r % len(names)] for r in range(MeasureConfig().rounds)]
    assert [b for b, cold in timer.timed if not cold] == [b for order in rotated for b in order]
    assert [b for b, cold in timer.timed if cold] == [b for order in rotated for b in order]
    case = report.cases[0]
    # One backend after the other, the last would look 1.2**6 = 3x slower than the first; interleaved
    # and rotated, equally fast backends differ by at most one drift step.
    times = [case.item(b).warm.median_ms for b in names]  # type: ignore[union-attr]
    assert max(times) / min(times) <= 1.2 ** 2
    assert case.item("fusion").warm.reps == 2 * MeasureConfig().rounds  # type: ignore[union-attr]


class DisturbedTimer(FakeTimer):
    """Every backend equally fast (1 ms), but some measurement windows are disturbed (2 ms): two of
    fusion's three warm rounds and one of Inductor's."""

    def __init__(self) -> None:
        super().__init__({})
        self.rounds: dict[str, int] = {}

    def time_one(self, step: TimedStep, cold: bool) -> TimingStats:
        super().time_one(step, cold)
        r = self.rounds[self.backend, cold] = self.rounds.get((self.backend, cold), -1) + 1
        disturbed = {"fusion": (0, 2), "inductor": (1,)}.get(self.backend, ())
        ms = 2.0 if r in disturbed and not cold else 1.0
        return TimingStats.from_samples([ms, ms])


def test_an_item_s_time_is_its_quietest_round_so_disturbed_windows_do_not_rank_backends(tiny: Workload) -> None:
    report = run([tiny], [BUILTIN_EAGER, FAKE_INDUCTOR, FAKE_FUSION], modes=("infer",), timer=DisturbedTimer(),
                 measure=MeasureConfig(rounds=3))
    case = report.cases[0]
    # the median of the rounds would put fusion at 2 ms and Inductor at 1 ms: 0.5x for equal code
    assert case.item("fusion").warm.median_ms == case.item("inductor").warm.median_ms == 1.0  # type: ignore[union-attr]
    assert case.item("fusion").warm.max_ms == 2.0, "the disturbed rounds still show in the extremes"  # type: ignore[union-attr]


class WindowTimer(FakeTimer):
    """Each backend's warm rounds take the listed times in turn, then 1 ms (cold rounds: 1 ms)."""

    def __init__(self, windows: dict[str, list[float]]) -> None:
        super().__init__({})
        self.windows = windows
        self.rounds: dict[tuple[str, bool], int] = {}

    def time_one(self, step: TimedStep, cold: bool) -> TimingStats:
        super().time_one(step, cold)
        r = self.rounds[self.backend, cold] = self.rounds.get((self.backend, cold), -1) + 1
        listed = self.windows.get(self.backend, [])
        ms = listed[r] if r < len(listed) and not cold else 1.0
        return TimingStats.from_samples([ms, ms])

    def warm_rounds(self, backend: str) -> int:
        return self.rounds.get((backend, False), -1) + 1


def test_a_row_whose_quietest_rounds_disagree_gets_more_rounds(tiny: Workload) -> None:
    """Inductor's first three windows are disturbed by different amounts (3, 2, 3 ms for 1 ms of
    work): its quietest round would make equal code read 2x slower than fusion's.  The row gets more
    rounds (every backend, still interleaved) until each backend's two quietest rounds agree."""
    timer = WindowTimer({"inductor": [3.0, 2.0, 3.0]})
    report = run([tiny], [BUILTIN_EAGER, FAKE_INDUCTOR, FAKE_FUSION], modes=("infer",), timer=timer,
                 measure=MeasureConfig(rounds=3))
    case = report.cases[0]
    assert case.item("fusion").warm.median_ms == case.item("inductor").warm.median_ms == 1.0  # type: ignore[union-attr]
    # rounds 4 and 5 are quiet; after them Inductor's two quietest agree
    assert {b: timer.warm_rounds(b) for b in ("eager", "inductor", "fusion")} == {"eager": 5, "inductor": 5, "fusion": 5}
    without = WindowTimer({"inductor": [3.0, 2.0, 3.0]})
    case = run([tiny], [BUILTIN_EAGER, FAKE_INDUCTOR, FAKE_FUSION], modes=("infer",), timer=without,
               measure=MeasureConfig(rounds=3, extra_rounds=0)).cases[0]
    assert case.item("inductor").warm.median_ms == 2.0  # type: ignore[union-attr]


def test_quiet_rows_take_exactly_the_configured_rounds_and_noisy_ones_stop_at_the_cap(tiny: Workload) -> None:
    quiet = WindowTimer({})
    run([tiny], [BUILTIN_EAGER, FAKE_FUSION], modes=("infer",), timer=quiet)
    assert quiet.warm_rounds("fusion") == MeasureConfig().rounds
    noisy = DriftingTimer()  # every measurement 20% slower than the last: rounds never agree
    run([tiny], [BUILTIN_EAGER, FAKE_FUSION], modes=("infer",), timer=noisy,
        measure=MeasureConfig(rounds=2, extra_rounds=3))
    assert sum(1 for b, cold in noisy.timed if b == "fusion" and not cold) == 5


@pytest.mark.parametrize("field, value", [("extra_rounds", -1), ("agreement", -0.1), ("consecutive", 0)])
def test_bad_round_settings_are_named(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=field):
        MeasureConfig(**{field: value})


# -- merging the parts of a suite ----------------------------------------------------------------------------


def test_parts_of_a_suite_merge_into_one_report_with_one_verdict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = load_workload(write_model(tmp_path / "models", "part_a"))
    b = load_workload(write_model(tmp_path / "models", "part_b", TINY_CONVT))
    backends = [BUILTIN_EAGER, FAKE_INDUCTOR, FAKE_FUSION]
    for name, workload in (("a", a), ("b", b)):
        write_reports(run([workload], backends), tmp_path / name, chart=False)
    whole = run([a, b], backends)

    out = tmp_path / "merged"
    assert cli.main(["--merge", str(tmp_path / "a"), str(tmp_path / "b" / "bench.json"), "--out", str(out),
                     "--no-chart"]) == 0  # fmt: skip
    merged = read_json(out / "bench.json")
    assert [(c.workload, c.mode) for c in merged.cases] == [(c.workload, c.mode) for c in whole.cases]
    assert merged.workloads.keys() == {"part_a", "part_b"} and merged.complete
    assert verdict_of(merged).line() == verdict_of(whole).line()
    assert verdict_of(merged).line() in capsys.readouterr().out


def test_parts_of_other_precisions_and_modes_merge_into_their_union(tmp_path: Path) -> None:
    from fusion_backend.bench.merge import merge_reports

    a = load_workload(write_model(tmp_path / "models", "part_a"))
    backends = [BUILTIN_EAGER, FAKE_INDUCTOR, FAKE_FUSION]
    parts = [run([a], backends, modes=("train",)), run([a], backends, dtypes=("bf16", "fp32"), modes=("infer",))]
    merged = merge_reports(parts)
    assert merged.config.dtypes == ("fp32", "bf16") and merged.config.modes == ("train", "infer")
    assert [(c.dtype, c.mode) for c in merged.cases] == [("fp32", "train"), ("bf16", "infer"), ("fp32", "infer")]


def test_merging_refuses_other_settings_a_repeated_row_or_a_single_report(tmp_path: Path) -> None:
    from fusion_backend.bench.merge import merge_reports

    a = load_workload(write_model(tmp_path / "models", "part_a"))
    backends = [BUILTIN_EAGER, FAKE_INDUCTOR, FAKE_FUSION]
    fp32, bf16 = run([a], backends), run([a], backends, dtypes=("bf16",))
    unchecked = run([a], backends, dtypes=("bf16",), fp64_check=False)
    with pytest.raises(ConfigError, match=r"report 2 was run with other settings than report 1 \(fp64_check\)"):
        merge_reports([fp32, unchecked])
    with pytest.raises(ConfigError, match="row part_a fp32 infer is in more than one report"):
        merge_reports([fp32, fp32])
    other_gpu = dataclasses.replace(fp32, environment={**fp32.environment, "torch": "0.0"})
    with pytest.raises(ConfigError, match="report 2 has torch '0.0'"):
        merge_reports([fp32, other_gpu])
    with pytest.raises(ConfigError, match="at least two"):
        merge_reports([fp32])
    later = dataclasses.replace(bf16, config=fp32.config, environment={**fp32.environment, "git_commit": "b" * 40})
    with pytest.raises(ConfigError, match="report 2 has git_commit 'bbbb"):
        merge_reports([fp32, later])
    assert cli.main(["--merge", str(tmp_path / "nowhere"), str(tmp_path / "nowhere"), "--out", str(tmp_path / "m")]) == 2


def test_parts_from_different_commits_merge_only_when_asked_and_name_each_commit_and_tree(tmp_path: Path) -> None:
    a = load_workload(write_model(tmp_path / "models", "part_a"))
    b = load_workload(write_model(tmp_path / "models", "part_b", TINY_CONVT))
    backends = [BUILTIN_EAGER, FAKE_INDUCTOR, FAKE_FUSION]
    for name, workload, commit in (("a", a, "a" * 40), ("b", b, "b" * 40)):
        report = run([workload], backends)
        code = {"git_commit": commit, "git_tree": name * 40, "git_local_changes": name == "b"}
        write_reports(dataclasses.replace(report, environment={**report.environment, **code}), tmp_path / name,
                      chart=False)  # fmt: skip
    parts = [str(tmp_path / "a"), str(tmp_path / "b")]
    assert cli.main(["--merge", *parts, "--out", str(tmp_path / "refused"), "--no-chart"]) == 2
    assert cli.main(["--merge", *parts, "--merge-across-commits", "--out", str(tmp_path / "m"), "--no-chart"]) == 0
    merged = read_json(tmp_path / "m" / "bench.json")
    assert merged.environment["git_commit"] is None
    assert merged.environment["part_git_commits"] == ["a" * 40, "b" * 40]
    assert merged.environment["git_tree"] is None and merged.environment["part_git_trees"] == ["a" * 40, "b" * 40]
    assert merged.environment["git_local_changes"]  # one part ran local changes
    assert len(merged.environment["merged_from"]) == 2 and len(merged.cases) == 2 * len(run([a], backends).cases)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events time GPU steps")
def test_the_cuda_timer_interleaves_steps_repetition_by_repetition_and_survives_a_failing_one() -> None:
    from fusion_backend.bench.measure import CudaEventTimer

    ran: list[str] = []
    collector_on: set[bool] = set()
    x = torch.randn(1 << 20, device="cuda")

    def step(name: str) -> Callable[[], object]:
        def run() -> object:
            ran.append(name)
            collector_on.add(gc.isenabled())
            if name == "broken" and len(ran) > 12:
                raise RuntimeError("step broke while being timed")
            return x * 2

        return run

    timer = CudaEventTimer(torch.device("cuda"), MeasureConfig(warmup=1, reps=5))
    steps = [TimedStep(n, step(n)) for n in ("a", "broken", "b")]
    results = timer.time(steps)
    assert isinstance(results[1], RuntimeError) and "broke" in str(results[1])
    assert [r.reps for r in (results[0], results[2])] == [5, 5]  # type: ignore[union-attr]
    # warmup a, broken, b; then per repetition each step twice (untimed + timed), in order
    assert ran[:9] == ["a", "broken", "b", "a", "a", "broken", "broken", "b", "b"]
    assert ran[-4:] == ["a", "a", "b", "b"], "once broken, a step is left out and the others go on"
    assert collector_on == {False} and gc.isenabled(), "no garbage collection while timing, and on again after"
    cold = timer.time([TimedStep("a", step("a"), reset=lambda: ran.append("reset a"))], cold=True)
    assert cold[0].reps == 5 and ran[-2:] == ["reset a", "a"]  # type: ignore[union-attr]
    ran.clear()
    blocks = CudaEventTimer(torch.device("cuda"), MeasureConfig(warmup=0, reps=3, consecutive=2))
    assert [r.reps for r in blocks.time([TimedStep(n, step(n)) for n in ("a", "b")])] == [3, 3]  # type: ignore[union-attr]
    assert ran == ["a"] * 4 + ["b"] * 4 + ["a", "a", "b", "b"], "two repetitions of a step in a row, then the next"


def test_repetitions_run_one_at_a_time_in_turn_or_in_blocks_of_one_step() -> None:
    from fusion_backend.bench.measure import repetition_order

    assert list(repetition_order(2, 3)) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    blocks = list(repetition_order(3, 5, consecutive=2))
    assert blocks == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2),
                      (2, 0), (3, 0), (2, 1), (3, 1), (2, 2), (3, 2), (4, 0), (4, 1), (4, 2)]
    assert sorted(blocks) == sorted(repetition_order(3, 5)), "every repetition of every step, once"
    assert list(repetition_order(2, 2, consecutive=9)) == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert list(repetition_order(0, 3)) == [] and list(repetition_order(2, 0)) == []


def test_a_row_whose_paired_ratios_straddle_the_tie_gets_more_rounds_whichever_side_its_median_is_on(
        tiny: Workload) -> None:
    """Equal code, but Inductor's first four windows alternate 0.8 and 1.2 ms against fusion's 1 ms:
    every backend's two quietest rounds agree, yet the paired ratios (0.8, 1.2, 0.8, 1.2) leave the
    row on no side of the 0.97x tie.  The row gets rounds until they do, and reads 1.0x."""
    timer = WindowTimer({"inductor": [0.8, 1.2, 0.8, 1.2]})
    case = run([tiny], [BUILTIN_EAGER, FAKE_INDUCTOR, FAKE_FUSION], modes=("infer",), timer=timer,
               measure=MeasureConfig(rounds=4, extra_rounds=20)).cases[0]
    assert 4 < timer.warm_rounds("fusion") < 24
    assert case.speedup("fusion", "inductor") == 1.0
    below = WindowTimer({"fusion": [1.2] * 30})  # a steady loss is decided at once: no extra rounds
    case = run([tiny], [BUILTIN_EAGER, FAKE_INDUCTOR, FAKE_FUSION], modes=("infer",), timer=below,
               measure=MeasureConfig(rounds=4, extra_rounds=20)).cases[0]
    assert below.warm_rounds("fusion") == 4
    assert case.speedup("fusion", "inductor") == pytest.approx(1 / 1.2)


@pytest.mark.parametrize("ratios, decided", [
    ([1.0], False),                      # one round says nothing about its spread
    ([0.99, 1.01, 1.0, 1.02], True),     # together, above the tie
    ([0.90, 0.92, 0.91, 0.93], True),    # together, below the tie: a loss, not noise
    ([0.80, 1.24, 0.95, 0.94, 1.01, 1.0], False),  # the middle half holds the tie
])
def test_a_row_is_decided_when_the_tie_lies_outside_its_paired_ratios_middle_half(ratios, decided) -> None:
    assert _decided(ratios) is decided


_ROOT = Path(__file__).resolve().parents[2]


def _tool(name: str):
    """The module of ``tools/<name>.py`` (the tools are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, _ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_first_call_tool_prints_each_child_s_time_as_it_is_measured(capsys):
    """``tools/first_call.py`` runs one child process per first call, minutes in all on a GPU host: a
    run cut short (a device call's time limit) must still have printed what it measured so far."""
    module = _tool("first_call")
    # (first call, settle): inductor cold, fusion cold, inductor warm 1; then the limit
    times = iter([(2.0, 0.0), (2.5, 0.5), (0.5, 0.0)])

    class Stopped(Exception):
        """The time limit, here: the run ends in the middle."""

    def measure(path, backend, *args, **kwargs):
        try:
            return next(times)
        except StopIteration:
            raise Stopped from None

    module.measure = measure
    with pytest.raises(Stopped):
        module.main([str(_ROOT / "demos" / "convnets" / "conv2d_64_k3_relu.py"), "--warm-runs", "2"])
    assert capsys.readouterr().out.splitlines() == [
        "  inductor cold: 2.00 s (first call 2.00 s + settle 0.00 s)",
        "  fusion cold: 3.00 s (first call 2.50 s + settle 0.50 s)",
        "  inductor warm 1: 0.50 s (first call 0.50 s + settle 0.00 s)"]


def test_results_table_prints_a_committed_report_row_by_row_with_its_lines():
    """``tools/results_table.py`` (the tables of ``docs/perf/RESULTS.md``) on the committed seeds report:
    one row per case, the verdict's ratio, both first calls and the decision read from fusion's notes."""
    module = _tool("results_table")
    report_path = _ROOT / "docs" / "perf" / "h100" / "seeds" / "bench.json"
    text = module.table(report_path)
    report = read_json(report_path)
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| workload")]
    assert len(rows) == len(report.cases)
    verdict = verdict_of(report)
    first = rows[0].split(" | ")
    ratio = next(r for r in verdict.rows if (r.workload, r.dtype, r.mode) == tuple(first[i].strip("| ") for i in range(3)))
    assert first[6] == f"{ratio.ratio:.2f}x"
    case = report.cases[0]
    reference, fusion = case.item(verdict.first_call_reference), case.item(verdict.subject)
    assert first[8] == f"{reference.compile_s:.1f} / {fusion.compile_s:.1f}"
    assert all(row.split(" | ")[-1].startswith(("fused: ", "Inductor: ")) for row in rows)
    assert f"`{verdict.line()}`" in text and f"`{verdict.first_call_line()}`" in text


def test_first_call_runs_takes_each_rows_median_over_the_runs_against_its_budget(tmp_path):
    """``tools/first_call_runs.py`` on three warm reruns made from the committed one: a row over 1.2x in
    one run only is within its budget by the median; a row over in two of three is above it."""
    module = _tool("first_call_runs")
    text = (_ROOT / "docs" / "perf" / "h100" / "warm" / "seeds-small" / "bench.json").read_text()
    committed = json.loads(text)

    def run(name: str, fusion_s: dict[int, float]) -> Path:
        data = json.loads(text)
        for case_index, seconds in fusion_s.items():
            case = data["cases"][case_index]
            fusion = next(item for item in case["items"] if item["backend"] == "fusion")
            inductor = next(item for item in case["items"] if item["backend"] == "inductor")
            inductor["compile_s"], fusion["compile_s"] = 0.1, seconds
        path = tmp_path / name / "bench.json"
        path.parent.mkdir()
        path.write_text(json.dumps(data))
        return path

    # (case 3, over in the committed run, is set within: only cases 1 and 2 differ between the runs)
    paths = [run("a", {1: 0.13, 2: 0.13, 3: 0.1}), run("b", {1: 0.10, 2: 0.13, 3: 0.1}), run("c", {1: 0.11, 2: 0.10, 3: 0.1})]
    table = module.table(paths)
    rows = {tuple(cell.strip() for cell in line.split("|")[1:4]): line.split("|")[4:-1]
            for line in table.splitlines() if line.startswith("| conv")}  # fmt: skip
    case1, case2 = committed["cases"][1], committed["cases"][2]
    assert [c.strip() for c in rows[case1["workload"], case1["dtype"], case1["mode"]]] == ["1.30x", "1.00x", "1.10x", "1.10x", "1.2x"]
    assert [c.strip() for c in rows[case2["workload"], case2["dtype"], case2["mode"]]] == ["1.30x", "1.30x", "1.00x", "1.30x", "1.2x"]
    label = f"{case2['workload']} {case2['dtype']} {case2['mode']}"
    assert table.splitlines()[-1].endswith(f"1/8 rows above their budget, the highest {label}`")
    with pytest.raises(ValueError, match="different budgets"):
        module.table([paths[0], _ROOT / "docs" / "perf" / "h100" / "seeds-small" / "bench.json"])
