"""pytest plugin (entry point ``pytest11``): active in any test session once the package is installed.

Fixture ``fusion_rewrites``: the list of ``GraphReport``s produced while the test runs, e.g.

    def test_my_model_fuses(fusion_rewrites):
        torch.compile(model, backend="fusion")(x)
        assert sum(r.counts().get("conv_epilogue", 0) for r in fusion_rewrites) == 1

On a failing test that used the fixture, the reports are added to the failure output.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .report import GraphReport, collect_reports


@pytest.fixture
def fusion_rewrites(request: pytest.FixtureRequest) -> Iterator[list[GraphReport]]:
    """Every rewrite report produced during the test (in the test's thread)."""
    with collect_reports() as reports:
        request.node._fusion_reports = reports
        yield reports


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    reports = getattr(item, "_fusion_reports", None)
    if report.when == "call" and report.failed and reports:
        report.sections.append(("fusion reports", "\n".join(str(r) for r in reports)))
