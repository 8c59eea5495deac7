"""The parity checks' reference follows the model's own casts: ``assert_fused`` and ``python -m
fusion_backend explain`` run the float64 reference with the parameters, buffers and floating inputs
promoted (integer inputs as they are); a model that still cannot run in float64 (``x.float()`` of a
uint8 input, ``.to(torch.float32)`` of an intermediate, both meeting float64 parameters) is checked
against eager alone, and the output says which reference was used.

The models fuse every conv with its ReLU and keep only casts besides, so their graphs run direct
(no Inductor compile): the tests stay fast on a CPU."""

import io

import pytest
import torch
import torch.nn as nn

from fusion_backend import explain_cli, testing
from fusion_backend.testing import assert_fused

NO_FLOAT64 = "Reference: eager (the model does not run in float64: RuntimeError: Input type (float) and bias type (double)"


class Uint8Image(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return torch.relu(self.c(x.float()))


class IntermediateCast(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c1, self.c2 = nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 1)

    def forward(self, x):
        return torch.relu(self.c2(torch.relu(self.c1(x)).to(torch.float32)))


class RefusesFloat64(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        if x.dtype != torch.float32:
            raise TypeError("this model runs in float32 only")
        return torch.relu(self.c(x))


def uint8_image():
    return torch.randint(0, 256, (2, 3, 6, 6), dtype=torch.uint8)


@pytest.mark.parametrize("model, x, expect, why", [
    (Uint8Image, uint8_image, 1, NO_FLOAT64),
    (IntermediateCast, lambda: torch.rand(2, 3, 6, 6), 2, NO_FLOAT64),
    (RefusesFloat64, lambda: torch.rand(2, 3, 6, 6), 1,
     "Reference: eager (the model does not run in float64: TypeError: this model runs in float32 only)"),
], ids=["uint8_cast", "intermediate_cast", "refuses_float64"])
def test_assert_fused_checks_a_model_that_cannot_run_in_float64_against_eager(model, x, expect, why):
    inputs = [x()]
    assert_fused(model(), inputs, expect={"conv_epilogue": expect}, train=True, options={"decide": "fuse"})
    with pytest.raises(AssertionError) as info:  # a failure's message names the reference used
        assert_fused(model(), inputs, expect={"conv_epilogue": expect + 1}, train=True, options={"decide": "fuse"})
    assert why in str(info.value), str(info.value)


def test_assert_fused_keeps_the_float64_reference_where_the_model_runs_in_float64():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    with pytest.raises(AssertionError) as info:
        assert_fused(model, [torch.rand(2, 3, 6, 6)], expect={"conv_epilogue": 2}, options={"decide": "fuse"})
    assert "Reference: float64 (parameters, buffers and floating inputs promoted to float64)" in str(info.value)
    ref = testing.reference_run(model, [torch.rand(2, 3, 6, 6)], train=False)
    assert ref.is_float64 and ref.output.dtype == torch.float64


def test_the_float64_reference_leaves_integer_inputs_as_they_are():
    model = nn.Embedding(5, 3)
    ref = testing.reference_run(model, [torch.tensor([0, 4, 2])], train=True)
    assert ref.is_float64 and ref.output.dtype == torch.float64 and ref.grads["param weight"].dtype == torch.float64


MODEL_FILE = '''import torch
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c = torch.nn.Conv2d(3, 4, 3)
    def forward(self, x):
        return torch.relu(self.c(x{cast}))
def get_inputs():
    return [{inputs}]
def get_init_inputs():
    return []
'''
UINT8_FILE = MODEL_FILE.format(cast=".float()", inputs="torch.randint(0, 256, (2, 3, 6, 6), dtype=torch.uint8)")
FLOAT_FILE = MODEL_FILE.format(cast="", inputs="torch.rand(2, 3, 6, 6)")


@pytest.mark.parametrize("source, reference, grads", [
    (UINT8_FILE, "reference: eager (the model does not run in float64: RuntimeError: Input type (float) and bias type (double)", 2),
    (FLOAT_FILE, "reference: float64 (parameters, buffers and floating inputs promoted to float64)", 3),
], ids=["uint8_cast", "float"])
def test_explain_cli_states_the_reference_it_used(tmp_path, capsys, source, reference, grads):
    model_file = tmp_path / "m.py"
    model_file.write_text(source)
    out = io.StringIO()
    code = explain_cli.main([str(model_file), "--device", "cpu", "--decide", "fuse", "--train"], out=out)
    assert code == 0 and capsys.readouterr().err == "", out.getvalue()
    text = out.getvalue()
    assert "[fused] conv_epilogue" in text and reference in text
    assert f"OK: output and {grads} gradients match eager" in text


def test_explain_cli_on_a_uint8_model_exits_zero_without_a_traceback(tmp_path, capsys):
    model_file = tmp_path / "m.py"
    model_file.write_text(UINT8_FILE)
    out = io.StringIO()
    code = explain_cli.main([str(model_file), "--device", "cpu", "--decide", "fuse"], out=out)
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err, out.getvalue()[-3000:] + err[-3000:]
    assert "reference: eager (the model does not run in float64" in out.getvalue()
    assert "OK: output match" in out.getvalue()
