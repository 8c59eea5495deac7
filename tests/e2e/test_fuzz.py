"""The model fuzzer: random conv pipelines (``fuzz_models.py``) compiled with ``backend="fusion"``
must give eager's output and every gradient, whatever matched, fell back or was left alone.

In the suite the examples are fixed (hypothesis derandomized) and few; a long run draws fresh ones:

    FUSION_FUZZ_EXAMPLES=300 FUSION_FUZZ_SEED=7 python -m pytest tests/e2e/test_fuzz.py -q

Every counterexample the fuzzer finds becomes an ``@example(spec=Pipeline(...))`` of the test, which
runs it first, every time.

A model that ``backend="inductor"`` alone gets wrong in exactly the same way is not counted against
the fusion backend (it handed that graph to Inductor untouched): the example is dropped with a warning
that names the problem.  Known case: torch < 2.13's fake ``convolution_backward`` predicts a contiguous
``grad_input`` where cuDNN returns channels-last (pytorch/pytorch#171622), so Inductor's compiled
backward of a channels-last transposed conv fails its own stride assertion on CUDA.
"""

import os
import warnings

from conftest import KERNEL_DEVICE
from fuzz_models import Pipeline, outcome, pipelines
from hypothesis import HealthCheck, Phase, example, given, reject, seed, settings

EXAMPLES = int(os.environ.get("FUSION_FUZZ_EXAMPLES", "3"))
SEED = os.environ.get("FUSION_FUZZ_SEED")


def _settings(fn):
    fn = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=SEED is None,
                  phases=[Phase.explicit, Phase.generate],  # no shrinking: one compile per example is slow
                  suppress_health_check=list(HealthCheck))(fn)
    return seed(int(SEED))(fn) if SEED is not None else fn


@_settings
@given(spec=pipelines())
# found on the H100 in a long run (torch 2.11): a transposed 3-d conv alone, channels-last input, frozen
# weight; Inductor alone fails the same way there (pytorch/pytorch#171622), and it must stay that way
@example(spec=Pipeline(nd=3, transposed=True, batch=1, c_in=3, c_out=1, groups=1, size=(3, 4, 3), kernel=3, stride=1,
                       padding=1, dilation=1, output_padding=0, bias=False, steps=(), branch="none", tail="none",
                       ceil_mode=False, layout="channels_last", conv_grad=False))
# a model eager refuses (the in-place step overwrites relu's saved output): dropped, not failed
@example(spec=Pipeline(nd=1, transposed=False, batch=1, c_in=1, c_out=2, groups=1, size=(5,), kernel=1, stride=1,
                       padding=0, dilation=1, output_padding=0, bias=True,
                       steps=(("relu", "F.relu", 0.5, False), ("mul_scalar", "inplace", 2.0, False)), branch="none",
                       tail="none", ceil_mode=False, layout="contiguous", conv_grad=True))
# found on the H100: (2 - y) + y cancels, so the input gradient is zero in float64 and fp32 leaves 1e-9
# of rounding residue (judged in absolute terms by ``compare``, not as a relative error of 1e21)
@example(spec=Pipeline(nd=1, transposed=True, batch=2, c_in=6, c_out=4, groups=2, size=(10,), kernel=3, stride=2,
                       padding=2, dilation=2, output_padding=1, bias=False, steps=(("sub_scalar", "rsub", 2.0, False),),
                       branch="add_conv_output", tail="global_mean", ceil_mode=False, layout="sliced",
                       conv_grad=False))
# found on the H100 with TF32 left on (the fused kernel then rounds operands to TF32 as cuDNN may, but
# cuDNN ran this grouped 1x1 conv in full fp32): the parity check runs in exact fp32
@example(spec=Pipeline(nd=1, transposed=False, batch=1, c_in=2, c_out=2, groups=2, size=(3,), kernel=1, stride=1,
                       padding=0, dilation=1, output_padding=0, bias=False, steps=(), branch="none", tail="max_pool",
                       ceil_mode=False, layout="contiguous", conv_grad=False))
# found on CPU (seed 29): a one-element conv output added to itself before the mean was taken by
# conv_global_mean as an outside one-element operand, and its rewrite failed (the graph fell back)
@example(spec=Pipeline(nd=2, transposed=False, batch=1, c_in=3, c_out=1, groups=1, size=(3, 3), kernel=3, stride=2,
                       padding=0, dilation=1, output_padding=0, bias=True, steps=(), branch="add_conv_output",
                       tail="global_mean", ceil_mode=False, layout="sliced", conv_grad=False))
def test_random_pipelines_match_eager(spec, exact_fp32):
    problem = outcome(spec, KERNEL_DEVICE)
    if problem is not None and outcome(spec, KERNEL_DEVICE, "inductor") == problem:
        warnings.warn(f"inherited from Inductor, not counted: {spec}: {problem}", stacklevel=1)
        reject()
    assert problem is None, f"{spec}\n{problem}"
