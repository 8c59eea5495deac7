"""Visibility: explain(), reports with source lines and reasons, dumps (code, Markdown, JSON, DOT),
the explain CLI, logging, and the pytest helpers' failure messages."""

import io
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fusion_backend
from fusion_backend.report import GraphReport, ReasonKind
from fusion_backend.testing import assert_fused

REPO = Path(__file__).resolve().parents[2]


class TwoMatchesOneMiss(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c1 = nn.Conv2d(3, 4, 3)
        self.c2 = nn.Conv2d(4, 4, 3)
        self.c3 = nn.Conv2d(4, 4, 1)
        self.m = nn.Parameter(torch.randn(4, 1, 1))

    def forward(self, x):
        a = F.max_pool2d(F.relu(self.c1(x)), 2)  # match 1
        b = self.c2(a) * self.m  # match 2 ...
        b = torch.tanh(b)
        shared = F.gelu(self.c3(b))  # near miss: `shared` is also used below
        return shared + shared.mean()


X = torch.rand(2, 3, 18, 18)


def test_explain_shows_both_matches_with_source_lines_and_the_near_miss_with_its_reason():
    result = fusion_backend.explain(TwoMatchesOneMiss(), X)
    assert result.counts() == {"conv_epilogue": 3}
    text = str(result)
    assert "conv2d -> relu -> max_pool2d" in text and "conv2d -> mul -> tanh" in text
    assert "test_explain_and_dumps.py" in text and "a = F.max_pool2d(F.relu(self.c1(x)), 2)" in text
    (miss,) = result.near_misses
    assert miss.reason is ReasonKind.SHARED_INTERMEDIATE and miss.node == "shared"
    assert "`shared` is used by" in miss.message and "test_explain_and_dumps.py:" in miss.message
    torch.testing.assert_close(result.output, TwoMatchesOneMiss()(X))


def test_report_json_round_trips():
    (report,) = fusion_backend.explain(TwoMatchesOneMiss(), X).reports
    again = GraphReport.from_dict(json.loads(json.dumps(report.to_dict())))
    assert again == report


def test_dump_renders_clusters_and_marks_the_near_miss(tmp_path):
    fusion_backend.explain(TwoMatchesOneMiss(), X, options={"dump_dir": str(tmp_path)})
    folder = tmp_path / "graph_000"
    dot = (folder / "graph.dot").read_text()
    assert dot.count("subgraph cluster_") == 3
    assert "color=red" in dot and "shared_intermediate" in dot
    md = (folder / "report.md").read_text()
    assert "## Near misses" in md and "shared_intermediate" in md
    if shutil.which("dot"):
        assert (folder / "graph.svg").read_text().lstrip().startswith("<?xml")
    else:
        assert "Graphviz" in md
    # The DOT grammar (pydot's parser): one graph, both fused clusters and the near miss's cluster as
    # subgraphs, every node of the clusters declared.
    pydot = pytest.importorskip("pydot", reason="the DOT grammar check needs pydot (the test extra installs it)")

    (graph,) = pydot.graph_from_dot_data(dot)
    clusters = [g for g in graph.get_subgraphs() if g.get_name().startswith("cluster_")]
    assert len(clusters) == 3 and all(c.get_nodes() for c in clusters)
    assert graph.get_edges(), "the dataflow edges are drawn"


def test_dump_names_are_stable_across_runs(tmp_path):
    for run in ("one", "two"):
        torch._dynamo.reset()
        fusion_backend.explain(TwoMatchesOneMiss(), X, options={"dump_dir": str(tmp_path / run)})
    names = [sorted(p.relative_to(tmp_path / run).as_posix() for p in (tmp_path / run).rglob("*")) for run in ("one", "two")]
    assert names[0] == names[1]
    assert (tmp_path / "one/graph_000/after.py").read_text() == (tmp_path / "two/graph_000/after.py").read_text()


def test_logger_reports_matches_at_info_and_near_misses_at_debug(caplog):
    with caplog.at_level(logging.DEBUG, logger="fusion_backend"):
        fusion_backend.explain(TwoMatchesOneMiss(), X)
    infos = [r for r in caplog.records if r.name == "fusion_backend" and r.levelno == logging.INFO]
    debugs = [r for r in caplog.records if r.name == "fusion_backend" and r.levelno == logging.DEBUG]
    assert len(infos) == 3 and any("shared_intermediate" in r.getMessage() for r in debugs)


def run_cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "fusion_backend", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


# One model file per pattern family: the CLI path is the same for every file.
@pytest.mark.parametrize("name", ["convt3d_leaky_mul_leaky_maxpool", "convt2d_global_mean_bias_logsumexp_small"])
def test_explain_cli_on_the_seeds_suite_files(name, tmp_path):
    # Full-size models are heavy on a CPU: run a copy with the batch cut to 2 and the spatial size to 8.
    src = (REPO / "demos" / "seeds" / f"{name}.py").read_text()
    src = src.replace("return [torch.rand(", "return [t[(slice(0, 2), slice(None)) + tuple(slice(0, 8) for _ in t.shape[2:])].contiguous() for t in [torch.rand(").replace(")]\n\n\ndef get_init", ")]]\n\n\ndef get_init")
    model_file = tmp_path / f"{name}.py"
    model_file.write_text(src)
    # In-process (a subprocess costs seconds of imports on a CPU box): ``python -m fusion_backend`` itself
    # runs in the test below.
    from fusion_backend import explain_cli

    out = io.StringIO()
    code = explain_cli.main([str(model_file), "--train", "--dump", str(tmp_path / "dump")], out=out)
    assert code == 0, out.getvalue()[-3000:]
    assert "[fused]" in out.getvalue() and "OK: output and 4 gradients match eager" in out.getvalue()
    assert (tmp_path / "dump" / "graph_000" / "report.json").exists()


@pytest.mark.heavy
def test_explain_cli_rejects_a_file_without_the_layout(tmp_path, capsys):
    # in-process: the subprocess runs above cover ``python -m fusion_backend explain`` itself
    from fusion_backend import explain_cli

    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nclass Model(torch.nn.Module):\n    pass\n")
    assert explain_cli.main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert "get_inputs" in err and "Traceback" not in err


def test_explain_cli_exit_code_is_nonzero_on_a_mismatch(tmp_path, capsys, monkeypatch):
    # A fused op that is wrong on purpose: the CLI must say MISMATCH and exit 1 (in-process: the
    # subprocess runs above already cover ``python -m fusion_backend explain`` itself).
    import fusion_backend.ops.conv_epilogue as ce
    from fusion_backend import explain_cli

    real = ce.conv_epilogue
    monkeypatch.setattr(ce, "conv_epilogue", lambda *a: real(*a) * 1.01)
    model_file = tmp_path / "m.py"
    model_file.write_text(SMALL_MODEL.format(extra=""))
    out = io.StringIO()
    assert explain_cli.main([str(model_file), "--device", "cpu"], out=out) == 1
    assert "MISMATCH" in out.getvalue(), out.getvalue()


def test_a_broken_rewrite_fails_assert_fused_with_a_message_that_explains_itself(monkeypatch):
    import fusion_backend.ops.conv_epilogue as ce

    real = ce.conv_epilogue
    monkeypatch.setattr(ce, "conv_epilogue", lambda *a: real(*a) + 1e-3)  # a "broken pattern"
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.SiLU())
    with pytest.raises(AssertionError) as info:
        assert_fused(model, [torch.rand(2, 3, 8, 8)], expect={"conv_epilogue": 1})
    message = str(info.value)
    assert "output[0]: relative error" in message and "largest mismatches" in message and "at (" in message
    assert "[fused] conv_epilogue: conv2d -> silu" in message  # the report is part of the message


def test_assert_fused_reports_wrong_counts():
    with pytest.raises(AssertionError, match=r"rewrites: expected \{'conv_epilogue': 2\}, got \{'conv_epilogue': 1\}"):
        assert_fused(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()), [torch.rand(1, 3, 6, 6)], expect={"conv_epilogue": 2})


def test_fixture_records_rewrites(fusion_rewrites):
    torch.compile(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()), backend="fusion")(torch.rand(1, 3, 6, 6))
    assert [r.counts() for r in fusion_rewrites] == [{"conv_epilogue": 1}]


def test_structured_trace_artifact_is_emitted_when_available(monkeypatch):
    from fusion_backend import backend

    seen = []
    monkeypatch.setattr(backend, "_emit_trace_artifact", lambda report: seen.append(report))
    fusion_backend.explain(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()), torch.rand(1, 3, 6, 6))
    assert len(seen) == 1 and seen[0].counts() == {"conv_epilogue": 1}


def test_compare_judges_against_an_all_zero_truth_in_absolute_terms():
    """A gradient the model cancels exactly ((c - y) + y: zero in float64) leaves fp32 rounding
    residue in a differently ordered kernel; relative to zero that would read as an error of 1e21."""
    from fusion_backend.testing import compare

    zero = torch.zeros(2, 3, dtype=torch.float64)
    residue = torch.full((2, 3), 1.5e-9)
    assert compare("input[0]", residue, torch.zeros(2, 3), reference=zero) is None
    assert compare("input[0]", residue, torch.zeros(2, 3)) is None
    problem = compare("input[0]", residue + 1e-3, torch.zeros(2, 3), reference=zero)
    assert problem == "input[0]: largest magnitude 0.001 where the truth is zero everywhere > 1e-05"


def test_compare_judges_a_float64_residue_truth_in_absolute_terms():
    """A gradient that is mathematically zero (the conv bias's through a normalization without
    affine) is float64 rounding residue in the reference (1e-16) and fp32 residue in eager and in
    the kernel (1e-7): relative to the residue every fp32 result reads as an error of 1e8 or more."""
    from fusion_backend.testing import compare

    gen = torch.Generator().manual_seed(0)
    truth = torch.randn(5, generator=gen, dtype=torch.float64) * 1e-16
    eager = torch.randn(5, generator=gen) * 2e-7
    assert compare("grad of bias", torch.randn(5, generator=gen) * 3e-7, eager, reference=truth) is None
    problem = compare("grad of bias", torch.full((5,), 1e-3), eager, reference=truth)
    assert problem.startswith("grad of bias: largest magnitude 0.001 where the truth is zero everywhere > 1e-05")
    # a truth with digits keeps the relative measure, however small its scale
    small = torch.randn(5, generator=gen, dtype=torch.float64) * 1e-12
    assert compare("g", small.float() * 1.5, small.float(), reference=small).startswith("g: relative error")


def test_compare_accepts_equal_infinities_and_names_differing_ones():
    from fusion_backend.testing import compare

    want = torch.tensor([1.0, float("inf"), -float("inf"), float("nan"), 2.0])
    assert compare("out", want.clone(), want) is None  # equal inf/NaN positions: the finite rest is compared
    assert compare("out", want + torch.tensor([0, 0, 0, 0, 1e-3]), want).startswith("out: relative error")
    flipped = want.clone()
    flipped[1] = -float("inf")
    assert compare("out", flipped, want) == "out: infinities differ from eager's at [[1]]"
    finite = want.clone()
    finite[2] = 0.0
    assert compare("out", finite, want) == "out: infinities differ from eager's at [[2]]"


SMALL_MODEL = (
    "import torch\n"
    "class Model(torch.nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__(); self.c = torch.nn.Conv2d(3, 4, 3)\n"
    "    def forward(self, x):\n"
    "        return torch.relu(self.c(x)){extra}\n"
    "def get_inputs():\n    return [torch.rand(2, 3, 8, 8)]\n"
    "def get_init_inputs():\n    return []\n"
)


def _explain(tmp_path, capsys, *args, extra=""):
    from fusion_backend import explain_cli

    model_file = tmp_path / "m.py"
    model_file.write_text(SMALL_MODEL.format(extra=extra))
    code = explain_cli.main([str(model_file), *args], out=io.StringIO())
    return code, capsys.readouterr().err


@pytest.mark.parametrize("device, message", [
    ("tpu", "error: --device 'tpu' is not a device: use cpu or cuda[:N]"),
    ("meta", "error: --device 'meta': the fusion backend runs on cpu or cuda[:N]"),
])
def test_explain_cli_an_unknown_device_is_a_usage_error_in_one_line(tmp_path, capsys, device, message):
    code, err = _explain(tmp_path, capsys, "--device", device)
    assert code == 2 and err.strip() == message


def test_explain_cli_a_model_that_fails_in_eager_is_bad_input_in_one_line(tmp_path, capsys):
    code, err = _explain(tmp_path, capsys, "--device", "cpu", extra=".view(3, -1, 7)")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("error: ") and "the model fails in eager on cpu: RuntimeError" in err


def test_explain_cli_parity_exits_zero(tmp_path, capsys):
    code, err = _explain(tmp_path, capsys, "--device", "cpu")
    assert code == 0 and err == ""


@pytest.mark.parametrize("args, fragment", [
    (["--options", '{"stict": true}'], "unknown option 'stict' for backend 'fusion' (did you mean 'strict'?)"),
    (["--options", '{"patterns": ["conv_epilog"]}'], "unknown pattern 'conv_epilog' (did you mean 'conv_epilogue'?)"),
    (["--options", '{"decide": "always"}'], "option 'decide' must be one of ['measure', 'fuse', 'inductor'], got 'always'"),
    (["--options", "decide=fuse"], "--options is not JSON"),
    (["--options", '["decide"]'], "--options must be a JSON object"),
    (["--decide", "always"], "--decide must be one of measure, fuse, inductor, got 'always'"),
])
def test_explain_cli_bad_options_are_a_usage_error_in_one_line(tmp_path, capsys, args, fragment):
    code, err = _explain(tmp_path, capsys, "--device", "cpu", *args)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: ") and fragment in err


def test_explain_cli_decide_fuse_shows_the_fusion_on_cpu(tmp_path, capsys, monkeypatch):
    """Without ``FUSION_DECIDE`` (a user's machine), CPU leaves the region to Inductor; ``--decide fuse``
    (or ``--options``) shows it fused."""
    from fusion_backend import explain_cli

    monkeypatch.delenv("FUSION_DECIDE", raising=False)
    model_file = tmp_path / "m.py"
    model_file.write_text(SMALL_MODEL.format(extra=""))
    for args, fused in ([], False), (["--decide", "fuse"], True), (["--options", '{"decide": "fuse"}'], True):
        out = io.StringIO()
        assert explain_cli.main([str(model_file), "--device", "cpu", *args], out=out) == 0
        assert ("[fused] conv_epilogue" in out.getvalue()) is fused, out.getvalue()


class _InSequential(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 1),
                                       torch.nn.Softmax(dim=2))

    def forward(self, z):
        return self.net(z)


def test_source_lines_inside_a_sequential_name_the_module_path():
    """Every layer of a ``Sequential`` has the source line ``return self.net(z)``: the module path
    (from Dynamo's ``nn_module_stack``) says which layer a region or a near miss is."""
    result = fusion_backend.explain(_InSequential(), torch.rand(1, 3, 6, 6), options={"decide": "fuse"})
    (match,) = [m for r in result.reports for m in r.matches]
    assert [s.module for s in match.source_lines] == ["net.0", "net.1"]
    assert all(s.code == "return self.net(z)" for s in match.source_lines)
    assert any(n.source_line and n.source_line.module == "net.3" for n in result.near_misses), result
    text = str(result)
    assert "(net.0)  `return self.net(z)`" in text and "(net.3)  `return self.net(z)`" in text
