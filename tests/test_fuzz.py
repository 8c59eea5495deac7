"""The model fuzzer: random conv pipelines (``fuzz_models.py``) compiled with ``backend="fusion"``
must give eager's output and every gradient, whatever matched, fell back or was left alone.

In the suite the examples are fixed (hypothesis derandomized) and few; a long run draws fresh ones:

    FUSION_FUZZ_EXAMPLES=300 FUSION_FUZZ_SEED=7 python -m pytest tests/test_fuzz.py -q

Every counterexample the fuzzer finds becomes an ``@example(spec=Pipeline(...))`` of the test, which
runs it first, every time.
"""

import os

from conftest import KERNEL_DEVICE
from fuzz_models import Pipeline, check, pipelines
from hypothesis import HealthCheck, Phase, example, given, seed, settings

EXAMPLES = int(os.environ.get("FUSION_FUZZ_EXAMPLES", "3"))
SEED = os.environ.get("FUSION_FUZZ_SEED")


def _settings(fn):
    fn = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=SEED is None,
                  phases=[Phase.explicit, Phase.generate],  # no shrinking: one compile per example is slow
                  suppress_health_check=list(HealthCheck))(fn)
    return seed(int(SEED))(fn) if SEED is not None else fn


@_settings
@given(spec=pipelines())
# found on the H100 in a long run: a transposed 3-d conv alone, channels-last input, frozen weight
@example(spec=Pipeline(nd=3, transposed=True, batch=1, c_in=3, c_out=1, groups=1, size=(3, 4, 3), kernel=3, stride=1,
                       padding=1, dilation=1, output_padding=0, bias=False, steps=(), branch="none", tail="none",
                       ceil_mode=False, layout="channels_last", conv_grad=False))
def test_random_pipelines_match_eager(spec):
    problem = check(spec, KERNEL_DEVICE)
    assert problem is None, f"{spec}\n{problem}"
