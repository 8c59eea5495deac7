"""What a user who mistypes something gets: one line naming the mistake and what is accepted, for
options, pattern names and environment switches alike, wherever they are given."""

from __future__ import annotations

import pytest
import torch

from fusion_backend.errors import InvalidEnvironmentError, UnknownOptionError, UnknownPatternError
from fusion_backend.options import FusionOptions

REGISTERED = ("conv_epilogue", "conv_global_mean")


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())


X = torch.rand(1, 3, 6, 6)


@pytest.mark.parametrize("key, guess", [("stict", "strict"), ("decide_margn", "decide_margin"),
                                        ("max_autotun", "max_autotune")])
def test_an_unknown_option_key_names_the_closest_valid_one(key, guess):
    with pytest.raises(UnknownOptionError) as info:
        FusionOptions.parse({key: True}, REGISTERED)
    message = str(info.value)
    assert f"unknown option {key!r} for backend 'fusion' (did you mean {guess!r}?)" in message
    assert "\n" not in message


def test_a_misspelled_option_reaches_the_caller_as_itself_in_one_line():
    """Not Dynamo's ``BackendCompilerFailed`` with its hints: our error, its one-line message."""
    with pytest.raises(UnknownOptionError) as info:
        torch.compile(small_model(), backend="fusion", options={"stict": True})(X)
    assert not isinstance(info.value, torch._dynamo.exc.BackendCompilerFailed)
    assert str(info.value).startswith("unknown option 'stict' for backend 'fusion' (did you mean 'strict'?)")
    assert "\n" not in str(info.value)


def test_a_misspelled_pattern_option_names_the_closest_family():
    with pytest.raises(UnknownPatternError, match=r"unknown pattern 'conv_epilog' \(did you mean 'conv_epilogue'\?\)"):
        FusionOptions.parse({"disable_patterns": "conv_epilog"}, REGISTERED)


@pytest.mark.parametrize("variable, value", [
    ("FUSION_CPU_KERNELS", "yes"), ("FUSION_CONV_IMPL", "fast"), ("FUSION_CONV_AUTOTUNE", "maybe"),
    ("FUSION_DECIDE", "always"),
])
def test_a_bad_environment_switch_is_refused_where_it_is_read_and_at_compile(monkeypatch, variable, value):
    from fusion_backend import environment

    monkeypatch.setenv(variable, value)
    reader = {"FUSION_CPU_KERNELS": environment.cpu_kernels_triton, "FUSION_CONV_IMPL": environment.conv_impl,
              "FUSION_CONV_AUTOTUNE": environment.measuring, "FUSION_DECIDE": environment.decide}[variable]
    with pytest.raises(InvalidEnvironmentError) as info:
        reader()
    message = str(info.value)
    assert message.startswith(f"{variable}={value!r} is not accepted: use one of ") and "\n" not in message
    with pytest.raises(InvalidEnvironmentError, match=variable):
        FusionOptions.parse({}, REGISTERED)


@pytest.mark.parametrize("variable, value, read", [
    ("FUSION_CPU_KERNELS", "Triton", True), ("FUSION_CPU_KERNELS", "reference", False), ("FUSION_CPU_KERNELS", "", False),
    ("FUSION_CONV_AUTOTUNE", "0", False), ("FUSION_CONV_AUTOTUNE", "1", True), ("FUSION_CONV_AUTOTUNE", "", True),
])
def test_accepted_environment_values_read_as_documented(monkeypatch, variable, value, read):
    from fusion_backend import environment

    monkeypatch.setenv(variable, value)
    reader = environment.cpu_kernels_triton if variable == "FUSION_CPU_KERNELS" else environment.measuring
    assert reader() is read


def test_assert_not_fused_refuses_an_unknown_pattern_name():
    from fusion_backend.testing import assert_not_fused

    with pytest.raises(UnknownPatternError, match=r"'conv_epilog' \(did you mean 'conv_epilogue'\?\)"):
        assert_not_fused(small_model(), [X], "conv_epilog")


def test_assert_fused_and_dry_run_refuse_unknown_pattern_names():
    from fusion_backend.testing import assert_fused, dry_run

    with pytest.raises(UnknownPatternError, match="conv_epilog"):
        assert_fused(small_model(), [X], expect={"conv_epilog": 1})
    with pytest.raises(UnknownPatternError, match="conv_globalmean"):
        dry_run(small_model(), [X], patterns=["conv_globalmean"])


def test_the_fixture_counts_fused_regions_and_refuses_an_unknown_pattern_name(fusion_rewrites):
    torch.compile(small_model(), backend="fusion", options={"decide": "fuse"})(X)
    assert fusion_rewrites.counts() == {"conv_epilogue": 1}
    assert fusion_rewrites.fused("conv_epilogue") == 1 and fusion_rewrites.fused("conv_global_mean") == 0
    with pytest.raises(UnknownPatternError, match="conv_epilog"):
        fusion_rewrites.fused("conv_epilog")


def test_fusion_patterns_sets_the_patterns_options_default_and_its_names_are_checked(monkeypatch):
    monkeypatch.setenv("FUSION_PATTERNS", " conv_global_mean ,")
    assert FusionOptions.parse({}, REGISTERED).patterns == ("conv_global_mean",)
    assert FusionOptions.parse({"patterns": "all"}, REGISTERED).patterns == REGISTERED  # the option wins
    monkeypatch.setenv("FUSION_PATTERNS", "conv_epilog")
    with pytest.raises(UnknownPatternError, match=r"unknown pattern 'conv_epilog' \(did you mean 'conv_epilogue'\?\)"):
        FusionOptions.parse({}, REGISTERED)
    monkeypatch.setenv("FUSION_PATTERNS", "")
    assert FusionOptions.parse({}, REGISTERED).patterns == REGISTERED


def test_an_opt_in_family_runs_only_where_it_is_named(monkeypatch):
    assert FusionOptions.parse({}, REGISTERED, default=("conv_epilogue",)).patterns == ("conv_epilogue",)
    assert FusionOptions.parse({"patterns": "all"}, REGISTERED, default=("conv_epilogue",)).patterns == REGISTERED
    monkeypatch.setenv("FUSION_PATTERNS", "conv_global_mean")
    assert FusionOptions.parse({}, REGISTERED, default=("conv_epilogue",)).patterns == ("conv_global_mean",)
