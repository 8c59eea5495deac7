"""Deferred decisions: Inductor's code runs a region until the fused op's kernels have compiled in the
background, then the decision is measured and the graph swapped.

On CPU no worker pool compiles anything, so a fake preparation stands in for the background compiles
(``deferred.preparing_with``) and a fake timer for the GPU (``decision.timing_override``)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fusion_backend
from fusion_backend.errors import RewriteError
from fusion_backend.report import collect_reports
from fusion_backend.runtime import decision, deferred
from fusion_backend.testing import run_and_backward


class ConvLeakyPool(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.scale = nn.Parameter(torch.randn(8, 1, 1))

    def forward(self, x):
        return F.max_pool2d(F.leaky_relu(self.conv(x), 0.1) * self.scale, 2)


class Compiles:
    """A fake background compile per pending region: ready once ``finish()`` is called."""

    def __init__(self):
        self.done = False
        self.prepared: list[str] = []
        self.collected = 0

    def __call__(self, gm, candidate, example_inputs, strict):
        self.prepared.append(candidate.pattern)
        return self

    def ready(self):
        return self.done

    def collect(self, timeout):
        self.collected += 1
        return 1

    def finish(self):
        self.done = True


class Timer:
    def __init__(self, fused, inductor):
        self.times, self.calls = {"fused": fused, "inductor": inductor}, 0

    def __call__(self, steps):
        self.calls += 1
        return dict(self.times)


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


@pytest.fixture
def faked(request):
    """(compiles, timer) in force for the test; the timer's times from ``request.param`` (fused,
    inductor), the fused op faster by default."""
    compiles, timer = Compiles(), Timer(*getattr(request, "param", (1.0, 2.0)))
    with deferred.preparing_with(compiles), decision.timing_override(timer, measure_on=("cpu",)):
        yield compiles, timer


def run(fn, x, train):
    """One step of ``fn`` (forward; with ``train``, a backward; else under ``torch.no_grad()``) and
    the reports it published."""
    with collect_reports() as reports, torch.set_grad_enabled(train):
        out, _ = run_and_backward(fn, [x], train, None)
    return out, reports


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "through-inductor"])
@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
def test_the_first_calls_run_inductors_code_and_the_first_call_after_the_compiles_swaps_in_the_rewrite(
        faked, train, direct, monkeypatch):
    compiles, timer = faked
    # the calls before the compiles finish must not give up on them, however slow a loaded machine runs them
    monkeypatch.setattr(deferred, "SETTLE_WAIT_S", 600.0)
    torch.manual_seed(0)
    model, x = ConvLeakyPool(), torch.randn(2, 3, 12, 12, requires_grad=train)
    want = run(model, x, train)[0]
    want_grads = grads(model) if train else []
    # (no budget: here the settle compiles the graph again whatever it takes; test_settle.py has the budget's rule)
    compiled = torch.compile(model, backend="fusion", options={"direct": direct, "decide_budget": None})
    for call in range(3):
        model.zero_grad(set_to_none=True)
        out, reports = run(compiled, x, train)
        torch.testing.assert_close(out, want)
        if train:
            for got, expected in zip(grads(model), want_grads, strict=True):
                torch.testing.assert_close(got, expected)
        if call == 0:
            ((pending,),) = [r.decisions for r in reports]
            assert pending.pending and not pending.fused and str(pending).startswith("pending: measured once")
            assert reports[0].matches == () and compiles.prepared == ["conv_epilogue"]
        else:
            assert reports == [] and timer.calls == 0  # not ready yet: nothing measured, nothing recompiled
    compiles.finish()
    model.zero_grad(set_to_none=True)
    out, reports = run(compiled, x, train)
    torch.testing.assert_close(out, want)
    ((settled,),) = [r.decisions for r in reports]
    assert settled.fused and not settled.pending and timer.calls == 1 and compiles.collected == 1
    assert len(reports[0].matches) == 1 and reports[0].runner == ("direct" if direct else "inductor")
    if train:
        for got, expected in zip(grads(model), want_grads, strict=True):
            torch.testing.assert_close(got, expected)
    run(compiled, x, train)
    assert timer.calls == 1  # settled for good


def test_the_deferred_decision_reads_dynamos_graph_as_it_was_though_inductor_mutated_it(faked, monkeypatch):
    """Where nothing is rewritten, Dynamo's graph itself goes to Inductor, which may mutate it; the
    decision made later must start from the graph as Dynamo gave it (copied before that compile)."""
    import torch.fx as fx

    from fusion_backend import backend

    compiles, timer = faked
    compile_inductor = backend._compile_inductor

    def compile_then_mutate(gm, example_inputs, patches):
        compiled = compile_inductor(gm, example_inputs, patches)
        gm.graph = fx.Graph()  # nothing of the graph is left for anyone reading it after this compile
        return compiled

    monkeypatch.setattr(backend, "_compile_inductor", compile_then_mutate)
    torch.manual_seed(0)
    model, x = ConvLeakyPool(), torch.randn(2, 3, 12, 12)
    want = model(x)
    compiled = torch.compile(model, backend="fusion")
    run(compiled, x, False)
    compiles.finish()
    out, reports = run(compiled, x, False)
    assert [d.fused for r in reports for d in r.decisions] == [True] and timer.calls == 1
    torch.testing.assert_close(out, want)


def test_the_first_call_never_settles_even_where_the_compiles_finished_during_the_compile(faked):
    compiles, timer = faked
    compiles.finish()  # ready before the first call runs
    model, x = ConvLeakyPool(), torch.randn(2, 3, 12, 12)
    compiled = torch.compile(model, backend="fusion")
    _, first = run(compiled, x, False)
    assert [d.pending for r in first for d in r.decisions] == [True] and timer.calls == 0
    _, second = run(compiled, x, False)
    assert [d.fused for r in second for d in r.decisions] == [True] and timer.calls == 1


@pytest.mark.parametrize("faked", [(2.0, 1.0)], indirect=True)
def test_settle_decides_every_pending_graph_without_a_call_and_a_slower_rewrite_stays_with_inductor(faked):
    compiles, timer = faked
    model, x = ConvLeakyPool(), torch.randn(2, 3, 12, 12)
    compiled = torch.compile(model, backend="fusion")
    with torch.no_grad():
        want = compiled(x)
    with collect_reports() as reports:
        assert fusion_backend.settle() == 1
    ((settled,),) = [r.decisions for r in reports]
    assert not settled.fused and not settled.pending and settled.rule == "Inductor is faster"
    assert compiles.collected == 0 and timer.calls == 1  # never finished: waited for within the budget, not collected
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), want)
    assert fusion_backend.settle() == 0


def test_settle_decides_in_the_grad_mode_the_graph_was_compiled_in(faked):
    compiles, timer = faked
    model, x = ConvLeakyPool(), torch.randn(2, 3, 12, 12, requires_grad=True)
    compiled = torch.compile(model, backend="fusion")
    with torch.no_grad():
        compiled(x)
    seen = []

    def timer_seeing_grad_mode(steps):
        seen.append(torch.is_grad_enabled())
        return {"fused": 1.0, "inductor": 2.0}

    with decision.timing_override(timer_seeing_grad_mode, measure_on=("cpu",)):
        assert torch.is_grad_enabled()
        fusion_backend.settle()
    assert seen == [False]


def test_a_cached_decision_is_not_deferred(faked):
    compiles, timer = faked
    model, x = ConvLeakyPool(), torch.randn(2, 3, 12, 12)
    compiled = torch.compile(model, backend="fusion")
    with torch.no_grad():
        compiled(x)
    fusion_backend.settle()
    torch._dynamo.reset()
    decision.forget_in_memory()  # as a second process: the answer is on disk
    with collect_reports() as reports, torch.no_grad():
        torch.compile(model, backend="fusion")(x)
    ((d,),) = [r.decisions for r in reports]
    assert d.fused and d.cached and not d.pending and compiles.prepared == ["conv_epilogue"]


def test_a_decision_settled_outside_a_disabled_autocast_is_found_by_the_next_process_inside_it(faked):
    """``torch.autocast(device, dtype, enabled=False)``, as a benchmark wraps an fp32 step, still sets the
    autocast dtype; the decision settled after the block must be the one the next process looks up."""
    compiles, timer = faked
    model, x = ConvLeakyPool(), torch.randn(2, 3, 12, 12)
    off = torch.float16 if torch.get_autocast_dtype("cpu") != torch.float16 else torch.bfloat16
    for process in range(2):
        torch._dynamo.reset()
        decision.forget_in_memory()
        with torch.autocast("cpu", off, enabled=False), collect_reports() as reports, torch.no_grad():
            torch.compile(model, backend="fusion")(x)
        fusion_backend.settle()
        ((d,),) = [r.decisions for r in reports]
        assert d.pending == (process == 0) and d.fused == (process == 1)
    assert compiles.prepared == ["conv_epilogue"] and timer.calls == 1


def test_defer_false_decides_during_the_first_call(faked):
    compiles, timer = faked
    model, x = ConvLeakyPool(), torch.randn(2, 3, 12, 12)
    with collect_reports() as reports, torch.no_grad():
        torch.compile(model, backend="fusion", options={"defer": False})(x)
    ((d,),) = [r.decisions for r in reports]
    assert d.fused and not d.pending and timer.calls == 1 and compiles.prepared == []


@pytest.mark.parametrize("preparer", [lambda *args: None, None], ids=["no-worker-pool", "the-real-one-off-the-gpu"])
def test_a_region_with_nothing_to_compile_in_the_background_waits_for_the_next_call(faked, preparer):
    """Where no kernel compiles in the background (no worker pool; a CPU region), the region still
    waits: the first call costs what Inductor's does, and the next call settles it, measuring it
    within the budget."""
    compiles, timer = faked
    model, x = ConvLeakyPool(), torch.randn(2, 3, 12, 12)
    compiled = torch.compile(model, backend="fusion")
    with deferred.preparing_with(preparer), torch.no_grad():
        with collect_reports() as reports:
            compiled(x)
        ((d,),) = [r.decisions for r in reports]
        assert d.pending and timer.calls == 0 and compiles.prepared == []
        with collect_reports() as settled:
            compiled(x)
    ((d,),) = [r.decisions for r in settled]
    assert d.fused and not d.pending and timer.calls == 1 and settled[0].graph_checks[0].fused


@pytest.mark.parametrize("strict", [False, True])
def test_a_failing_deferred_decision_keeps_inductors_code_or_raises_when_strict(faked, strict, monkeypatch):
    compiles, timer = faked
    model, x = ConvLeakyPool(), torch.randn(2, 3, 12, 12)
    with torch.no_grad():
        want = model(x)
        compiled = torch.compile(model, backend="fusion", options={"strict": strict})
        compiled(x)

    def broken(*args, **kwargs):
        raise RuntimeError("the GPU fell off the bus")

    monkeypatch.setattr("fusion_backend.backend.decide", broken)  # the settling compile's decision fails
    compiles.finish()
    with torch.no_grad():
        if strict:
            with pytest.raises(RewriteError, match="fell off the bus"):
                compiled(x)
        else:
            with pytest.warns(UserWarning, match="fell off the bus.*with Inductor unchanged"):
                out = compiled(x)
            torch.testing.assert_close(out, want)
            torch.testing.assert_close(compiled(x), want)
    assert timer.calls == 0


def test_the_defer_option_must_be_a_bool():
    from fusion_backend.match.engine import registered_patterns
    from fusion_backend.options import FusionOptions

    with pytest.raises(fusion_backend.InvalidOptionError) as info:
        FusionOptions.parse({"defer": "yes"}, tuple(registered_patterns()))
    assert str(info.value) == "option 'defer' must be a bool, got 'yes'"


def test_every_public_name_of_the_package_resolves_to_what_it_names():
    """Also after the modules behind them were imported directly: a submodule named like the
    function it defines would take the function's place on the package."""
    import importlib
    import inspect

    for module in ("explainer", "explain_cli", "report", "errors", "backend", "match.engine", "runtime.deferred"):
        importlib.import_module(f"fusion_backend.{module}")
    for name in fusion_backend.__all__:
        value = getattr(fusion_backend, name)
        assert not inspect.ismodule(value), f"fusion_backend.{name} is a module"
    assert callable(fusion_backend.explain) and callable(fusion_backend.settle)


def test_explain_reports_the_settled_decisions(faked):
    model, x = ConvLeakyPool(), torch.randn(2, 3, 12, 12)
    with torch.no_grad():
        result = fusion_backend.explain(model, x)
    ((d,),) = [r.decisions for r in result.reports]
    assert d.fused and not d.pending and "fused is faster" in str(result)


def test_graphs_with_symbolic_shapes_are_decided_at_once(faked):
    compiles, timer = faked
    model = ConvLeakyPool()
    compiled = torch.compile(model, backend="fusion", dynamic=True)
    with collect_reports() as reports, torch.no_grad():
        for size in (12, 14):
            compiled(torch.randn(2, 3, size, size))
    assert reports and not any(d.pending for r in reports for d in r.decisions)
    assert compiles.prepared == []


def test_a_graph_with_fake_example_inputs_is_deferred_to_its_first_real_call():
    """DDPOptimizer compiles its pieces on fake activations: such a graph waits for its first call's
    real tensors, prepares then (outside the compile's fake mode) and is decided on those tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    gm = torch.fx.symbolic_trace(ConvLeakyPool())
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.randn(2, 3, 12, 12))
    assert deferred.deferrable(gm, [torch.randn(2, 3, 12, 12)]) and deferred.deferrable(gm, [fake])
    assert deferred.real_inputs([torch.randn(1)]) and not deferred.real_inputs([fake])

    seen = {}

    def prepare(args):
        seen["prepared"] = args
        return [DoneAtOnce()]

    def decide(inputs, budget):
        seen["decided"] = inputs
        return lambda x: ("settled", x)

    graph = deferred.DeferredGraph(lambda x: ("first", x), [], decide, strict=False, inputs=None, prepare=prepare)
    deferred.settle()  # no real call yet: nothing to decide on
    assert not graph.settled and "decided" not in seen
    real = torch.randn(2)
    assert graph(real) == ("first", real) and seen["prepared"] == (real,) and not graph.settled
    assert graph(1) == ("settled", 1) and seen["decided"] == [real]


class DoneAtOnce:
    def ready(self):
        return True

    def collect(self, timeout):
        return 0


def test_a_preparation_that_never_finishes_is_given_up_after_the_wait(monkeypatch):
    class Never:
        collected = 0

        def ready(self):
            return False

        def collect(self, timeout):
            Never.collected += 1
            return 0

    graph = deferred.DeferredGraph(lambda x: ("first", x), [Never()], lambda inputs, budget: (lambda x: ("decided", x)),
                                   strict=False, inputs=[0])
    assert graph(1) == ("first", 1) and not graph.settled
    monkeypatch.setattr(deferred, "SETTLE_WAIT_S", 0.0)
    # decided without it; it is not collected (a collect would take it for a dead worker pool)
    assert graph(2) == ("decided", 2) and graph.settled and Never.collected == 0


@pytest.mark.parametrize("strict", [False, True])
def test_a_settle_whose_compile_raises_keeps_the_first_code_or_raises_when_strict(strict):
    class Ready:
        def ready(self):
            return True

        def collect(self, timeout):
            return 0

    def decide(inputs, budget):
        raise RuntimeError("out of compile workers")

    graph = deferred.DeferredGraph(lambda x: ("first", x), [Ready()], decide, strict=strict, inputs=[0])
    assert graph(0) == ("first", 0) and not graph.settled  # the first call never settles
    if strict:
        with pytest.raises(RewriteError, match="deferred decision failed: RuntimeError: out of compile workers"):
            graph(1)
        return
    with pytest.warns(UserWarning, match="deferred decision failed.*Inductor's code keeps running"):
        assert graph(1) == ("first", 1)
    assert graph.settled and graph(2) == ("first", 2)


def test_run_settled_checks_the_settled_code_with_gradients_of_one_step(faked):
    """``testing.run_settled``, as ``python -m fusion_backend explain`` and the demo use it: the
    reports are the settled graph's, and the gradients are one step's (not the first call's added)."""
    from fusion_backend.testing import run_settled

    torch.manual_seed(0)
    model, x = ConvLeakyPool(), torch.randn(2, 3, 12, 12)
    want, want_grads = run_and_backward(model, [x.clone().requires_grad_()], True, model)
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model, backend="fusion")
    got, got_grads, reports = run_settled(compiled, [x.clone().requires_grad_()], True, model)
    ((d,),) = [r.decisions for r in reports]
    assert d.fused and not d.pending and len(reports[0].matches) == 1
    torch.testing.assert_close(got, want)
    assert set(got_grads) == set(want_grads)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad)
