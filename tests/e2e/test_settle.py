"""Settling a deferred graph: nothing fused costs nothing, decisions in context, in seconds, and the
same on every rank.

On CPU no worker pool compiles anything, so a fake preparation stands in for the background compiles
(``deferred.preparing_with``), a fake timer for the region timing (``decision.timing_override``) and
a fake whole-graph timer for the context check (its ``graph_timer``)."""

import logging
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fusion_backend
from fusion_backend import backend, measurements
from fusion_backend.errors import InvalidOptionError
from fusion_backend.report import collect_reports
from fusion_backend.runtime import decision, deferred


class Blocks(nn.Module):
    """Three conv -> ReLU regions of one shape (one decision key), then a conv -> tanh of another."""

    def __init__(self):
        super().__init__()
        self.same = nn.ModuleList(nn.Conv2d(8, 8, 3, padding=1) for _ in range(3))
        self.last = nn.Conv2d(8, 4, 3)

    def forward(self, x):
        for conv in self.same:
            x = F.relu(conv(x)) * 0.5
        return torch.tanh(self.last(x))


class Compiles:
    """A fake background compile per prepared region, ready at once."""

    def __init__(self):
        self.prepared = 0

    def __call__(self, gm, candidate, example_inputs, strict):
        self.prepared += 1
        return self

    def ready(self):
        return True

    def collect(self, timeout):
        return 0


class RegionTimer:
    """Region times by call: ``times[i]`` is the (fused, inductor) pair of the i-th measurement."""

    def __init__(self, *times):
        self.times, self.calls = list(times), 0

    def __call__(self, steps):
        fused, inductor = self.times[min(self.calls, len(self.times) - 1)]
        self.calls += 1
        return {"fused": fused, "inductor": inductor}


class GraphTimer:
    """Whole-graph times by call, as ``RegionTimer``; records how many candidates were timed."""

    def __init__(self, *times):
        self.times, self.calls = list(times), 0

    def __call__(self, steps):
        assert set(steps) == {"fused", "inductor"}
        fused, inductor = self.times[min(self.calls, len(self.times) - 1)]
        self.calls += 1
        return {"fused": [fused], "inductor": [inductor]}


@pytest.fixture(autouse=True)
def fresh_caches(tmp_path, monkeypatch):
    monkeypatch.setattr(deferred, "SETTLE_WAIT_S", 0.2)  # a fake compile that never finishes is not waited for
    monkeypatch.setenv("FUSION_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FUSION_DECIDE", raising=False)
    decision.forget_in_memory()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    decision.forget_in_memory()


def settle_once(model, x, options=None, region=(1.0, 2.0), graph=(1.0, 2.0), compiles=None):
    """Compile ``model``, call it, settle; the compiled function, the settled reports, the timers."""
    compiles = compiles or Compiles()
    region_timer = region if isinstance(region, RegionTimer) else RegionTimer(region)
    graph_timer = graph if isinstance(graph, GraphTimer) else GraphTimer(graph)
    compiled = torch.compile(model, backend="fusion", options={"decide_budget": None, **(options or {})})
    with deferred.preparing_with(compiles), decision.timing_override(region_timer, ("cpu",), graph_timer), \
            torch.no_grad():
        with collect_reports() as first:
            compiled(x)
        assert any(d.pending for r in first for d in r.decisions)
        with collect_reports() as settled:
            fusion_backend.settle()
        compiled(x)
    return compiled, settled, region_timer, graph_timer, compiles


def deferred_graphs():
    return list(deferred._pending)


def test_a_settled_graph_with_nothing_fused_runs_inductors_first_compile_and_compiles_nothing_again(monkeypatch):
    compiles_of_graphs = []
    real_compile = backend._compile_inductor

    def counting(gm, example_inputs, patches):
        compiled = real_compile(gm, example_inputs, patches)
        compiles_of_graphs.append(compiled)
        return compiled

    monkeypatch.setattr(backend, "_compile_inductor", counting)
    captured = []
    real_init = deferred.DeferredGraph.__init__

    def keep_instance(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        captured.append(self)

    monkeypatch.setattr(deferred.DeferredGraph, "__init__", keep_instance)
    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(2, 8, 10, 10)
    _, settled, region_timer, graph_timer, _ = settle_once(model, x, region=(2.0, 1.0))
    ((graph,),) = [captured]
    assert graph.settled and graph._current is compiles_of_graphs[0] and len(compiles_of_graphs) == 1
    ((report,),) = [settled]
    assert report.matches == () and not any(d.fused for d in report.decisions) and report.graph_checks == ()
    assert graph_timer.calls == 0 and region_timer.calls == 2  # one measurement per key: 2 keys


def test_regions_of_one_signature_share_one_measurement_and_one_preparation():
    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(2, 8, 10, 10)
    _, settled, region_timer, _, compiles = settle_once(model, x)
    ((report,),) = [settled]
    assert len(report.decisions) == 4 and all(d.fused for d in report.decisions)
    assert [d.cached for d in report.decisions] == [False, True, True, False]
    assert region_timer.calls == 2 and compiles.prepared == 2


def test_the_whole_graph_decides_a_kept_region_that_makes_it_slower_goes_back_to_inductor():
    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(2, 8, 10, 10)
    want = model(x)
    # the 3 same-shaped regions win by 1.5x alone, the last by 2x; the graph with all four is slower,
    # with the weakest (the first three) dropped faster
    compiled, settled, _, graph_timer, _ = settle_once(
        model, x, region=RegionTimer((1.0, 1.5), (1.0, 2.0)), graph=GraphTimer((1.1, 1.0), (1.0, 1.2)))
    ((report,),) = [settled]
    assert graph_timer.calls == 2
    first, second = report.graph_checks
    assert not first.fused and len(first.kept) == 4 and "0.91x" in first.rule and "dropped `conv2d`" in first.rule
    assert second.fused and len(second.kept) == 3 and second.rule == "the whole graph is faster with them"
    dropped = [d for d in report.decisions if not d.fused]
    assert [d.anchor for d in dropped] == ["conv2d"] and dropped[0].rule.startswith("dropped in context")
    assert len(report.matches) == 3 and "[graph] dropped" in str(report)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), want)


def test_a_graph_that_is_slower_with_its_only_region_keeps_inductors_code_and_the_answer_is_cached():
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()), torch.randn(2, 3, 8, 8)
    _, settled, _, graph_timer, _ = settle_once(model, x, graph=(1.0, 1.01))
    ((report,),) = [settled]
    ((check,),) = [report.graph_checks]
    assert not check.fused and not check.cached and "dropped all" in check.rule and report.matches == ()
    assert "within 3% goes to Inductor" in report.decisions[0].rule
    # a second process finds both answers in the cache: the region, faster alone, is decided at the
    # first compile, and the whole graph's answer drops it there, with nothing timed or deferred
    decision.forget_in_memory()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusion")
    timer, graphs = RegionTimer((1.0, 2.0)), GraphTimer((1.0, 2.0))
    with decision.timing_override(timer, ("cpu",), graphs), torch.no_grad(), collect_reports() as reports:
        compiled(x)
    ((report,),) = [reports]
    ((check,),) = [report.graph_checks]
    assert timer.calls == 0 and graphs.calls == 0 and check.cached and not check.fused
    assert report.matches == () and report.decisions[0].rule.startswith("dropped in context")
    assert not report.decisions[0].pending and not deferred_graphs()


def test_a_region_kept_alone_in_the_cache_waits_for_the_whole_graphs_check_in_a_new_process():
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()), torch.randn(2, 3, 8, 8)
    timer = RegionTimer((1.0, 2.0))
    with decision.timing_override(timer, ("cpu",)), torch.no_grad():
        torch.compile(model, backend="fusion", options={"defer": False})(x)  # measured; no graph check
    torch._dynamo.reset()
    graphs = GraphTimer((1.0, 1.5))
    compiled = torch.compile(model, backend="fusion")
    with decision.timing_override(timer, ("cpu",), graphs), torch.no_grad():
        with collect_reports() as first:
            compiled(x)
        ((d,),) = [r.decisions for r in first]
        assert d.pending and "timed with it once Inductor's code" in d.rule and first[0].matches == ()
        with collect_reports() as settled:
            compiled(x)  # the second call settles: nothing was left to compile in the background
    ((report,),) = [settled]
    assert timer.calls == 1 and graphs.calls == 1 and report.graph_checks[0].fused and len(report.matches) == 1


def test_a_kind_of_region_that_lost_clearly_is_predicted_to_lose_and_not_measured():
    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(2, 8, 10, 10)
    # two measured keys of one kind (the 8->8 and 8->4 convs with a pointwise chain) lost clearly ...
    timer = RegionTimer((3.0, 1.0))
    settle_once(model, x, region=timer)
    assert timer.calls == 2
    # ... so a third shape of that kind is predicted to lose, with the evidence in the report
    torch._dynamo.reset()
    other = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
    compiled = torch.compile(other, backend="fusion")
    with decision.timing_override(timer, ("cpu",)), torch.no_grad(), collect_reports() as reports:
        compiled(torch.randn(2, 8, 12, 12))
    ((d,),) = [r.decisions for r in reports]
    assert not d.fused and not d.pending and timer.calls == 2
    assert d.rule.startswith("predicted to lose, not measured: the 2 measured regions of this kind")


@pytest.mark.parametrize("evidence", [((3.0, 1.0), (1.05, 1.0)), ((3.0, 1.0),)], ids=["one-came-close", "one-only"])
def test_no_prediction_without_two_clear_losses(evidence):
    torch.manual_seed(0)
    timer = RegionTimer(*evidence)
    model = nn.Sequential(*[m for i in range(len(evidence)) for m in (nn.Conv2d(8, 8, 3, padding=i + 1), nn.ReLU())])
    settle_once(model, torch.randn(2, 8, 12, 12), region=timer)
    torch._dynamo.reset()
    compiled = torch.compile(nn.Sequential(nn.Conv2d(8, 8, 5, padding=2), nn.ReLU()), backend="fusion",
                             options={"defer": False})
    with decision.timing_override(timer, ("cpu",)), torch.no_grad(), collect_reports() as reports:
        compiled(torch.randn(2, 8, 12, 12))
    assert timer.calls == len(evidence) + 1 and not reports[0].decisions[0].rule.startswith("predicted")


def test_the_decision_budget_leaves_the_regions_it_cannot_measure_to_inductor_unmeasured():
    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(2, 8, 10, 10)
    _, settled, timer, graphs, _ = settle_once(model, x, options={"decide_budget": 0.0})
    ((report,),) = [settled]
    measured, *same, last = report.decisions
    assert measured.speedup == 2.0 and all(d.cached for d in same) and timer.calls == 1
    assert not last.fused and "decision budget is spent" in last.rule
    # nothing was cached for the unmeasured region: a later settle measures it
    assert sum(1 for e in measurements._memory.values() if "class" in e) == 1
    # and the three kept alone wait for a later process: the graph's second compile is past the budget
    assert not any(d.fused for d in [measured, *same]) and graphs.calls == 0 and report.matches == ()
    assert all("kept from a later process on" in d.rule for d in [measured, *same])


class ConvThenCumsum(nn.Module):
    """One conv -> ReLU region and an op for Inductor after it: the rewritten graph compiles again."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return torch.cumsum(F.relu(self.conv(x)), dim=1)


def counting_graph_compiles(monkeypatch):
    compiles = []
    real_compile = backend._compile_inductor

    def counting(gm, example_inputs, patches):
        compiles.append(gm)
        return real_compile(gm, example_inputs, patches)

    monkeypatch.setattr(backend, "_compile_inductor", counting)
    return compiles


def test_a_settle_that_measured_compiles_the_graph_again_only_where_the_compile_fits_its_budget_and_a_later_process_does(
        monkeypatch):
    """The settle that measured the region keeps it alone but does not compile the graph again past
    its budget (Inductor's first compile runs on, the report says why); the next process finds the
    region in the cache, measures nothing, and compiles the graph with it at its settle, checked in
    the whole graph."""
    compiles = counting_graph_compiles(monkeypatch)
    torch.manual_seed(0)
    model, x = ConvThenCumsum(), torch.randn(2, 3, 8, 8)
    want = model(x)
    compiled, settled, timer, graphs, _ = settle_once(model, x, options={"decide_budget": 0.0})
    ((report,),) = [settled]
    ((d,),) = [report.decisions]
    assert not d.fused and not d.pending and d.speedup == 2.0 and report.matches == ()
    assert re.match(r"faster alone \(2\.00x\), kept from a later process on: compiling the graph with it "
                    r"\(about [\d.]+ s\) does not fit this process's decision budget \([\d.]+ s of a 0\.0 s "
                    r"budget; option decide_budget\)", d.rule), d.rule
    assert timer.calls == 1 and graphs.calls == 0 and len(compiles) == 1  # Inductor's first compile only
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), want)

    decision.forget_in_memory()  # a later process: the cache on disk alone remembers
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusion", options={"decide_budget": 0.0})
    graphs = GraphTimer((1.0, 1.5))
    with decision.timing_override(timer, ("cpu",), graphs), torch.no_grad():
        with collect_reports() as first:
            compiled(x)
        assert first[0].decisions[0].pending
        with collect_reports() as settled:
            torch.testing.assert_close(compiled(x), want)  # the second call settles
    ((report,),) = [settled]
    assert timer.calls == 1 and graphs.calls == 1 and report.graph_checks[0].fused and len(report.matches) == 1
    assert len(compiles) == 3  # this process: Inductor's graph, then the graph with the region


def test_a_later_process_compiles_the_regions_an_earlier_one_kept_though_it_measures_others_itself():
    """Blocks and an op for Inductor, with no budget: the first process measures the three
    same-shaped regions' key (kept, postponed) and leaves the last region unmeasured; the second
    measures that one and compiles the graph with all four, the three it owes the compile and the
    one it kept itself."""
    torch.manual_seed(0)
    model, x = BlocksThenCumsum(), torch.randn(2, 8, 10, 10)
    _, settled, timer, _, _ = settle_once(model, x, options={"decide_budget": 0.0})
    assert timer.calls == 1 and not any(d.fused for r in settled for d in r.decisions)
    decision.forget_in_memory()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusion", options={"decide_budget": 0.0})
    graphs = GraphTimer((1.0, 1.5))
    with deferred.preparing_with(Compiles()), decision.timing_override(timer, ("cpu",), graphs), torch.no_grad():
        compiled(x)
        with collect_reports() as settled:
            fusion_backend.settle()
        torch.testing.assert_close(compiled(x), model(x))
    ((report,),) = [settled]
    assert timer.calls == 2 and graphs.calls == 1  # the last region measured here, then the graph checked
    assert all(d.fused for d in report.decisions) and [d.cached for d in report.decisions] == [True] * 3 + [False]
    assert len(report.matches) == 4


class BlocksThenCumsum(Blocks):
    """Blocks and an op for Inductor after them: the rewritten graph compiles again."""

    def forward(self, x):
        return torch.cumsum(super().forward(x), dim=1)


def test_a_region_new_to_a_graph_whose_first_compile_holds_the_earlier_ones_waits_for_a_later_process(tmp_path):
    """The first compile holds the regions an earlier process kept and checked; a settle that then
    measures a new winner alone does not compile the graph again past its budget: the new region
    waits (the first compile, with the others, runs on)."""
    import json

    torch.manual_seed(0)
    model, x = BlocksThenCumsum(), torch.randn(2, 8, 10, 10)
    # an earlier process: the three same-shaped regions win and are kept in the whole graph; the last loses
    settle_once(model, x, region=RegionTimer((1.0, 2.0), (2.0, 1.0)), graph=GraphTimer((1.0, 1.5)))
    cache = tmp_path / measurements.FILE
    data = json.loads(cache.read_text())
    data["entries"] = {k: e for k, e in data["entries"].items() if "tanh" not in e.get("what", "")}
    cache.write_text(json.dumps(data))  # the last region never measured, as if past that process's budget
    decision.forget_in_memory()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusion", options={"decide_budget": 0.0})
    timer, graphs = RegionTimer((1.0, 2.0)), GraphTimer((1.0, 1.5))  # the last region wins now
    with deferred.preparing_with(Compiles()), decision.timing_override(timer, ("cpu",), graphs), torch.no_grad():
        with collect_reports() as first:
            compiled(x)
        assert len(first[0].matches) == 3  # the first compile holds the three, checked by the earlier process
        with collect_reports() as settled:
            fusion_backend.settle()
        torch.testing.assert_close(compiled(x), model(x))
    ((report,),) = [settled]
    *same, last = report.decisions
    assert timer.calls == 1 and all(d.fused for d in same) and not last.fused
    assert "kept from a later process on" in last.rule and len(report.matches) == 3


def test_a_settle_compiles_the_graph_with_its_regions_where_the_compile_fits_what_is_left_of_its_budget(
        monkeypatch):
    """The same graph with room in the budget for the compile (its estimate set low): kept at once."""
    monkeypatch.setattr(backend._FirstCompile, "recompile_seconds", lambda self, nodes: 0.0)
    torch.manual_seed(0)
    model, x = ConvThenCumsum(), torch.randn(2, 3, 8, 8)
    _, settled, timer, graphs, _ = settle_once(model, x, options={"decide_budget": 1e6})
    ((report,),) = [settled]
    assert report.decisions[0].fused and graphs.calls == 1 and len(report.matches) == 1


def test_a_graph_that_is_its_regions_runs_directly_and_has_no_compile_to_wait_for():
    """A graph whose rewrite runs without Inductor (``runtime/direct.py``) compiles nothing again: the
    settle keeps its region whatever the budget."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()), torch.randn(2, 3, 8, 8)
    _, settled, _, graphs, _ = settle_once(model, x, options={"decide_budget": 0.0})
    ((report,),) = [settled]
    assert report.decisions[0].fused and report.runner == "direct" and len(report.matches) == 1


def test_the_recompile_estimate_scales_the_larger_reading_to_the_rewritten_graphs_nodes():
    first = backend._FirstCompile(graph_nodes=100, seconds=2.0, estimated_s=5.0, regions=frozenset())
    assert first.recompile_seconds(100) == pytest.approx(5.0) and first.recompile_seconds(20) == pytest.approx(1.0)
    assert backend._FirstCompile(100, 3.0, 0.0, frozenset()).recompile_seconds(50) == pytest.approx(1.5)  # no rate
    assert backend._FirstCompile(0, 3.0, 0.0, frozenset()).recompile_seconds(5) == 0.0


def test_a_settle_logs_where_its_time_went(caplog):
    """The settle's lines, on the decisions' logger (the one ``bench --log`` and ``first_call.py --log``
    show): how many regions it decided and measured, then its waits and its decisions apart."""
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="fusion_backend.decision"):
        settle_once(Blocks(), torch.randn(2, 8, 10, 10))
    lines = [r.getMessage() for r in caplog.records if r.name == "fusion_backend.decision"]
    assert any(re.fullmatch(r"settling graph_\d+: 4 regions decided in [\d.]+ s, 2 of them measured \(.*\)", m)
               for m in lines), lines
    assert any(re.fullmatch(r"settled a deferred graph in [\d.]+ s \(waited [\d.]+ s, decided [\d.]+ s, "
                            r"waited after [\d.]+ s; first call [\d.]+ s\)", m) for m in lines), lines


@pytest.mark.parametrize("value", [-0.1, "fast", True])
def test_a_bad_decision_budget_is_named(value):
    from fusion_backend.match.engine import registered_patterns
    from fusion_backend.options import FusionOptions

    with pytest.raises(InvalidOptionError, match=r"option 'decide_budget' must be a number >= 0 .* or None"):
        FusionOptions.parse({"decide_budget": value}, tuple(registered_patterns()))
    assert FusionOptions.parse({"decide_budget": None}, tuple(registered_patterns())).decide_budget == float("inf")


def test_the_budget_is_a_fraction_of_the_first_call(monkeypatch):
    seen = {}
    def decide(inputs, budget):
        seen["b"] = budget

    graph = deferred.DeferredGraph(lambda x: x, [Compiles()], decide, strict=False, inputs=[1], budget_fraction=0.5,
                                   compiled_at=0.0)
    monkeypatch.setattr(deferred.time, "perf_counter", lambda: 10.0)
    graph(1)  # the first call
    graph(2)  # the second: the first call took 10 s since the compile began
    assert seen["b"].seconds == pytest.approx(5.0)


def test_what_the_first_calls_decisions_took_comes_out_of_the_budget(monkeypatch):
    seen = {}

    def decide(inputs, budget):
        seen["b"] = budget

    graph = deferred.DeferredGraph(lambda x: x, [Compiles()], decide, strict=False, inputs=[1], budget_fraction=0.5,
                                   compiled_at=0.0, decided_in_compile_s=2.0)
    monkeypatch.setattr(deferred.time, "perf_counter", lambda: 10.0)
    graph(1)
    graph(2)
    assert seen["b"].seconds == pytest.approx(3.0)  # half of the 10 s first call, less the 2 s its decisions took


def test_a_budget_measures_another_region_only_where_one_more_fits_in_the_time_left(monkeypatch):
    from fusion_backend.runtime import decision

    now = [0.0]
    monkeypatch.setattr(decision.time, "perf_counter", lambda: now[0])
    budget = decision.DecisionBudget(5.0, began=0.0)
    assert budget.allows_another()  # the first always
    budget.measured, now[0] = 1, 2.0  # the first took 2 s: a second would end at 4 s
    assert budget.allows_another()
    budget.measured, now[0] = 2, 4.0  # two took 4 s: a third would end at 6 s, past the 5 s
    assert not budget.allows_another() and not budget.spent_all()


def test_under_torch_distributed_every_graph_settles_at_the_same_call_waiting_for_its_compiles():
    class Slow:
        collected = 0

        def ready(self):
            return False

        def collect(self, timeout):
            Slow.collected += 1
            return 0

    settled_at = []
    graph = deferred.DeferredGraph(lambda x: x, [Slow()], lambda inputs, budget: settled_at.append(calls[-1]),
                                   strict=False, inputs=[1], settle_at_call=deferred.DISTRIBUTED_SETTLE_CALL)
    calls = []
    for call in range(1, 6):
        calls.append(call)
        graph(call)
    assert settled_at == [deferred.DISTRIBUTED_SETTLE_CALL] and Slow.collected == 0 and graph.settled


def _ranks(monkeypatch, *others):
    """Stand in for ``torch.distributed`` with this rank and ``others``: each other rank's
    ``(graph digest or None for this rank's, kept anchors)``."""
    dist = torch.distributed

    def all_gather_object(out, mine):
        out[:] = [mine] + [(mine[0] if digest is None else digest, kept) for digest, kept in others]

    monkeypatch.setattr(dist, "get_world_size", lambda: 1 + len(others))
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)


def _decided(*anchors_fused):
    from fusion_backend.report import Decision

    return {a: Decision("conv_epilogue", "conv2d -> relu", a, fused, "fused is faster" if fused else "slower")
            for a, fused in anchors_fused}


GRAPH = torch.fx.symbolic_trace(nn.Conv2d(2, 2, 1))


def test_ranks_keep_only_the_regions_every_rank_keeps(monkeypatch):
    _ranks(monkeypatch, (None, ["a", "c"]))  # the other rank kept the first and the third region
    agreed = backend._agree_across_ranks(_decided(("a", True), ("b", True), ("c", False)), GRAPH)
    assert [d.fused for d in agreed.values()] == [True, False, False]
    assert "not on every rank" in agreed["b"].rule and agreed["c"].rule == "slower"


def test_ranks_that_decided_different_alternates_keep_what_all_of_them_keep(monkeypatch):
    # this rank kept "a" and so never decided "x", an alternate over the same nodes; the other rank
    # did not keep "a" and kept "x" instead; both kept "b"
    _ranks(monkeypatch, (None, ["b", "x"]))
    agreed = backend._agree_across_ranks(_decided(("a", True), ("b", True)), GRAPH)
    assert [d.fused for d in agreed.values()] == [False, True]
    assert "not on every rank" in agreed["a"].rule


def test_ranks_whose_graphs_differ_keep_nothing(monkeypatch):
    _ranks(monkeypatch, ("another graph", ["a", "b"]))
    agreed = backend._agree_across_ranks(_decided(("a", True), ("b", False)), GRAPH)
    assert not any(d.fused for d in agreed.values())
    assert "graphs differ" in agreed["a"].rule and agreed["b"].rule == "slower"


def test_under_cuda_graphs_regions_are_decided_during_the_compile_within_a_budget_and_inductors_code_runs(
        monkeypatch):
    """Nothing is deferred under CUDA graphs: the regions are decided during the compile, the first
    measurement always runs, and where nothing is kept Inductor's compile of the graph as given is
    what runs (compiled once)."""
    compiles_of_graphs = []
    real_compile = backend._compile_inductor

    def counting(gm, example_inputs, patches):
        compiles_of_graphs.append(patches.get("triton.cudagraphs"))
        return real_compile(gm, example_inputs, patches)

    monkeypatch.setattr(backend, "_compile_inductor", counting)
    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(2, 8, 10, 10)
    timer = RegionTimer((2.0, 1.0))
    compiled = torch.compile(model, backend="fusion", options={"triton.cudagraphs": True, "decide_budget": 0.0})
    with decision.timing_override(timer, ("cpu",)), torch.no_grad(), collect_reports() as reports:
        torch.testing.assert_close(compiled(x), model(x))
    ((report,),) = [reports]
    first, *same, last = report.decisions
    assert not first.fused and all(d.cached for d in same) and "budget is spent" in last.rule
    assert timer.calls == 1 and compiles_of_graphs == [True] and not deferred_graphs()


def test_under_cuda_graphs_a_graph_compiles_once_whether_its_regions_are_measured_or_cached(monkeypatch):
    """The decision budget is estimated, not compiled for: the graph that measures its regions
    compiles the rewritten graph alone, as does the next compile, whose regions are cached."""
    compiles_of_graphs = []
    real_compile = backend._compile_inductor

    def counting(gm, example_inputs, patches):
        compiles_of_graphs.append(patches.get("triton.cudagraphs"))
        return real_compile(gm, example_inputs, patches)

    monkeypatch.setattr(backend, "_compile_inductor", counting)
    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(2, 8, 10, 10)
    timer = RegionTimer((1.0, 2.0))  # the fused op wins
    options = {"triton.cudagraphs": True, "decide_budget": None}
    with decision.timing_override(timer, ("cpu",)), torch.no_grad():
        for cached in ([False, True, True, False], [True] * 4):  # regions of one key share a measurement
            torch._dynamo.reset()
            compiles_of_graphs.clear()
            with collect_reports() as reports:
                torch.testing.assert_close(torch.compile(model, backend="fusion", options=options)(x), model(x))
            assert all(d.fused for d in reports[0].decisions) and timer.calls == 2
            assert [d.cached for d in reports[0].decisions] == cached
            assert compiles_of_graphs == [True]
            stages = reports[0].stage_seconds  # where the compile's time went
            assert list(stages) == ["match", "decide", "rewrite", "inductor", "total"]
            assert stages["total"] >= sum(v for k, v in stages.items() if k != "total") > 0
            assert stages["decide"] > 0  # the decisions made before the build that replays them


def test_under_cuda_graphs_the_budget_is_a_multiple_of_the_compile_rate_times_the_graphs_size(tmp_path, monkeypatch):
    """The budget under CUDA graphs: ``decide_budget`` (default ``CUDA_GRAPHS_DECIDE_BUDGET``) times
    Inductor's expected compile of the graph: this machine's rate per node (each compile past
    Inductor's caches keeps it in the measurement cache) times the graph's size, and before any graph
    of its kind compiled here, a prior rate."""
    from fusion_backend.options import CUDA_GRAPHS_DECIDE_BUDGET
    from fusion_backend.runtime import compile_estimate

    budgets = []

    def recorded(*args, **kwargs):
        budgets.append(decision.DecisionBudget(*args, **kwargs))
        return budgets[-1]

    monkeypatch.setattr(backend, "DecisionBudget", recorded)
    size = compile_estimate.RATE_MIN_NODES  # the graph's operations: as many as a rate needs
    monkeypatch.setattr(compile_estimate, "graph_size", lambda gm: size)
    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(2, 8, 10, 10)
    timer = RegionTimer((2.0, 1.0))  # Inductor wins: nothing kept

    def compile_once(**options):
        torch._dynamo.reset()
        with torch._inductor.config.patch(fx_graph_cache=False):  # a compile, not a cache hit
            torch.compile(model, backend="fusion", options={"triton.cudagraphs": True, **options})(x)
        return budgets[-1].seconds

    with decision.timing_override(timer, ("cpu",)), torch.no_grad():
        prior = compile_estimate.PRIOR_SECONDS_PER_NODE[False]
        assert compile_once() == pytest.approx(CUDA_GRAPHS_DECIDE_BUDGET * prior * size)
        assert compile_estimate.estimate(1, training=False, cuda_graphs=True, cache_dir=tmp_path) > 0.0  # kept
        for given, fraction in ({}, CUDA_GRAPHS_DECIDE_BUDGET), ({"decide_budget": 0.5}, 0.5):
            compile_estimate.record(size, 2.0 * size, training=False, cuda_graphs=True, cache_dir=tmp_path)
            assert compile_once(**given) == pytest.approx(fraction * 2.0 * size)
        assert compile_once(decide_budget=None) == float("inf")
    assert timer.calls == 2  # the two decision keys, measured once: the later compiles found them cached


def test_under_cuda_graphs_the_regions_a_process_measured_are_kept_in_the_compile_that_measured_them(
        monkeypatch, tmp_path):
    """The graph compiles once, with what its decisions keep, those measured in this process
    included (where Inductor's caches held the graph as given, that compile is the cold one a later
    process would pay instead); the next process finds them in the cache.  The compile of a
    rewritten graph is no rate of Inductor's compile of graphs as given: none is kept."""
    from fusion_backend.runtime import compile_estimate

    compiles = counting_graph_compiles(monkeypatch)
    monkeypatch.setattr(compile_estimate, "graph_size", lambda gm: compile_estimate.RATE_MIN_NODES)  # a rate's size
    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(2, 8, 10, 10)
    options = {"triton.cudagraphs": True}
    timer = RegionTimer((1.0, 2.0))  # the fused op wins
    with decision.timing_override(timer, ("cpu",)), torch.no_grad():
        for cached in ([False, True, True, False], [True] * 4):
            torch._dynamo.reset()
            compiles.clear()
            with collect_reports() as reports:
                torch.testing.assert_close(torch.compile(model, backend="fusion", options=options)(x), model(x))
            assert all(d.fused for d in reports[0].decisions) and [d.cached for d in reports[0].decisions] == cached
            assert timer.calls == 2 and len(compiles) == 1
            decision.forget_in_memory()  # a later process
    assert compile_estimate.estimate(1, training=False, cuda_graphs=True, cache_dir=tmp_path) == 0.0


def test_under_cuda_graphs_a_compile_that_fits_the_budget_keeps_what_this_process_measured(tmp_path):
    from fusion_backend.runtime import compile_estimate

    n = compile_estimate.RATE_MIN_NODES
    compile_estimate.record(n, 1e-6 * n, training=False, cuda_graphs=True, cache_dir=tmp_path)  # a fast compiler
    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(2, 8, 10, 10)
    timer = RegionTimer((1.0, 2.0))
    with decision.timing_override(timer, ("cpu",)), torch.no_grad(), collect_reports() as reports:
        compiled = torch.compile(model, backend="fusion", options={"triton.cudagraphs": True, "decide_budget": 1e6})
        torch.testing.assert_close(compiled(x), model(x))
    assert timer.calls == 2 and all(d.fused for d in reports[0].decisions)


class SlowCompiles(Compiles):
    """Fake background compiles of which the ``slow``-th prepared (from 1) never finishes."""

    def __init__(self, slow):
        super().__init__()
        self.slow, self.batches = slow, []

    def __call__(self, gm, candidate, example_inputs, strict):
        self.prepared += 1
        self.batches.append(Batch(ready=self.prepared != self.slow))
        return self.batches[-1]


class Batch:
    """A fake background compile, ready or never; says whether it was collected."""

    def __init__(self, ready):
        self.ready_now, self.collected = ready, False

    def ready(self):
        return self.ready_now

    def collect(self, timeout):
        self.collected = True
        return 0


def test_under_cuda_graphs_the_kernels_of_every_region_compile_first_and_those_not_ready_within_the_budget_wait(
        tmp_path):
    """The fused kernels of every region to be measured (one region per decision key) go to the
    compile workers at once, before any measurement; a region whose kernels had not compiled when the
    budget was spent stays with Inductor, unmeasured (the report says why), and a later process,
    whose kernels are compiled, measures it.  A batch still compiling is not collected (that would
    turn the workers off as late)."""
    from fusion_backend.runtime import compile_estimate

    n = compile_estimate.RATE_MIN_NODES
    compile_estimate.record(n, 1e-4 * n, training=False, cuda_graphs=True, cache_dir=tmp_path)  # a budget of ms
    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(2, 8, 10, 10)
    compiles, timer = SlowCompiles(slow=2), RegionTimer((1.0, 2.0))  # the last conv's kernels never compile
    with deferred.preparing_with(compiles), decision.timing_override(timer, ("cpu",)), torch.no_grad(), \
            collect_reports() as reports:
        torch.testing.assert_close(torch.compile(model, backend="fusion", options={"triton.cudagraphs": True})(x),
                                   model(x))
    *same, last = reports[0].decisions
    assert compiles.prepared == 2 and timer.calls == 1 and all(d.fused for d in same) and not last.fused
    assert re.match(r"not measured: its fused kernels were still compiling in the worker processes when the "
                    r"decision budget was spent \(.* budget; option decide_budget\)", last.rule), last.rule
    assert [b.collected for b in compiles.batches] == [True, False]
    torch._dynamo.reset()
    with deferred.preparing_with(lambda *args: None), decision.timing_override(timer, ("cpu",)), \
            torch.no_grad(), collect_reports() as reports:  # the kernels compiled since: measured
        torch.compile(model, backend="fusion", options={"triton.cudagraphs": True})(x)
    assert timer.calls == 2 and all(d.fused for d in reports[0].decisions)


def test_under_cuda_graphs_without_a_budget_cold_regions_are_measured_in_the_first_process(monkeypatch):
    """``decide_budget=None``: no limit, so a region whose kernels are cold is measured during the compile
    instead of waiting for a later process: one process makes every decision, the kernels of each
    decision key sent to the compile workers first, all at once (two keys: the three regions of one
    shape and the last conv)."""
    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(2, 8, 10, 10)
    compiles, timer = Compiles(), RegionTimer((1.0, 2.0))  # the fused op would win
    with deferred.preparing_with(compiles), decision.timing_override(timer, ("cpu",)), torch.no_grad(), \
            collect_reports() as reports:
        compiled = torch.compile(model, backend="fusion", options={"triton.cudagraphs": True, "decide_budget": None})
        torch.testing.assert_close(compiled(x), model(x))
    assert compiles.prepared == 2 and timer.calls == 2 and all(d.fused for d in reports[0].decisions)
    torch._dynamo.reset()
    with deferred.preparing_with(compiles), decision.timing_override(timer, ("cpu",)), torch.no_grad(), \
            collect_reports() as reports:  # a later process: the decisions cached, nothing sent or measured
        torch.compile(model, backend="fusion", options={"triton.cudagraphs": True, "decide_budget": None})(x)
    assert compiles.prepared == 2 and timer.calls == 2 and all(d.fused and d.cached for d in reports[0].decisions)


def test_a_small_graphs_compile_is_no_rate(tmp_path):
    """A graph of fewer than ``RATE_MIN_NODES`` operations compiles mostly what any compile costs: its
    seconds per node would make a large graph's estimate several times too large, so none is kept."""
    from fusion_backend.runtime import compile_estimate

    n = compile_estimate.RATE_MIN_NODES
    compile_estimate.record(n - 1, 5.0, training=False, cuda_graphs=True, cache_dir=tmp_path)
    assert compile_estimate.estimate(175, training=False, cuda_graphs=True, cache_dir=tmp_path) == 0.0
    assert compile_estimate.expected(175, training=False, cuda_graphs=True, cache_dir=tmp_path) == pytest.approx(
        compile_estimate.PRIOR_SECONDS_PER_NODE[False] * 175)
    compile_estimate.record(n, 0.1 * n, training=False, cuda_graphs=True, cache_dir=tmp_path)
    assert compile_estimate.estimate(175, training=False, cuda_graphs=True, cache_dir=tmp_path) == pytest.approx(17.5)
