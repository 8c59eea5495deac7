"""pytest plugin (entry point ``pytest11``): active in any test session once the package is installed.

Fixture ``fusion_rewrites``: the list of ``GraphReport``s produced while the test runs
(``testing.FusionRewrites``: ``counts()`` totals the fused regions per pattern over the graphs,
``fused(pattern)`` one pattern's, refusing a pattern name no family has), e.g.

    def test_my_model_fuses(fusion_rewrites):
        torch.compile(model, backend="fusion", options={"decide": "fuse"})(x)
        assert fusion_rewrites.fused("conv_epilogue") == 1

On a failing test that used the fixture, the reports are added to the failure output.  A decision the
backend deferred past the first call (option ``defer``; its report's decision reads "pending") comes in
a later report of the same graph, published when it settles (``fusion_backend.settle()`` settles at once).

NOTE: pytest imports this module before any conftest runs, so it imports nothing of the package at
module level: importing the backend pulls in Dynamo and Triton, and Triton must not be imported
before a conftest has had the chance to set ``TRITON_INTERPRET``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def fusion_rewrites(request: pytest.FixtureRequest) -> Iterator[list[Any]]:
    """Every ``GraphReport`` produced during the test (in the test's thread)."""
    from .report import collect_reports
    from .testing import FusionRewrites

    with collect_reports(FusionRewrites()) as reports:
        request.node._fusion_reports = reports
        yield reports


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    reports = getattr(item, "_fusion_reports", None)
    if report.when == "call" and report.failed and reports:
        report.sections.append(("fusion reports", "\n".join(str(r) for r in reports)))
