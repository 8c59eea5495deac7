"""The model fuzzer: random conv pipelines (``fuzz_models.py``) compiled with ``backend="fusion"``
must give eager's output and every gradient, whatever matched, fell back or was left alone.

In the suite the examples are fixed (hypothesis derandomized) and few; a long run draws fresh ones:

    FUSION_FUZZ_EXAMPLES=300 FUSION_FUZZ_SEED=7 python -m pytest tests/test_fuzz.py -q

Every counterexample the fuzzer finds becomes an ``@example(spec=Pipeline(...))`` of the test, which
runs it first, every time.
"""

import os

from conftest import KERNEL_DEVICE
from fuzz_models import check, pipelines
from hypothesis import HealthCheck, Phase, given, seed, settings

EXAMPLES = int(os.environ.get("FUSION_FUZZ_EXAMPLES", "6"))
SEED = os.environ.get("FUSION_FUZZ_SEED")


def _settings(fn):
    fn = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=SEED is None,
                  phases=[Phase.explicit, Phase.generate],  # no shrinking: one compile per example is slow
                  suppress_health_check=list(HealthCheck))(fn)
    return seed(int(SEED))(fn) if SEED is not None else fn


@_settings
@given(spec=pipelines())
def test_random_pipelines_match_eager(spec):
    problem = check(spec, KERNEL_DEVICE)
    assert problem is None, f"{spec}\n{problem}"
