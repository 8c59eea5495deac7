"""The tools that run one row of a benchmark file (``tools/first_call.py``, ``tools/profile_step.py``, ...)
put the model in the state the benchmark runs that row in (``Workload.set_mode``): a file declaring
``INFER_EVAL`` is timed in eval mode for inference, so its BatchNorms use their running statistics
there as in the benchmark's rows.  Checked through ``first_call.child`` with Dynamo's ``eager``
backend (nothing compiled)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import first_call  # noqa: E402

from fusion_backend.bench.suite import load_workload  # noqa: E402

SPY = """
import torch
import torch.nn as nn
{head}
SEEN = []

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3)

    def forward(self, x):
        SEEN.append(self.training)
        return self.conv(x)

def get_inputs():
    return [torch.rand(2, 2, 6, 6)]

def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("infer_eval", [True, False])
@pytest.mark.parametrize("mode", ["infer", "train"])
def test_first_call_runs_the_row_in_the_mode_the_benchmark_runs_it(tmp_path: Path, capsys, infer_eval: bool,
                                                                    mode: str) -> None:  # fmt: skip
    path = tmp_path / f"spy_{infer_eval}_{mode}.py"
    path.write_text(SPY.format(head="INFER_EVAL = True" if infer_eval else ""))
    first_call.child(str(path), "eager", mode, "fp32", False, "cpu")
    assert '"first_call_s"' in capsys.readouterr().out
    (module,) = [m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == str(path)]
    assert set(module.SEEN) == {not (infer_eval and mode == "infer")}


def test_set_mode_is_what_the_benchmark_runs_a_row_in(tmp_path: Path) -> None:
    path = tmp_path / "spy_set_mode.py"
    path.write_text(SPY.format(head="INFER_EVAL = True"))
    workload = load_workload(path)
    model, _ = workload.build(seed=0)
    assert workload.set_mode(model, "infer") is model and not model.training
    assert workload.set_mode(model, "train").training
