"""The backend entry: options, mode forwarding, fallback on failure, strict mode, dumps, entry point."""

import json
import warnings

import pytest
import torch
import torch.nn as nn

import fusion_backend
from fusion_backend import InvalidOptionError, RewriteError, UnknownOptionError, collect_reports
from fusion_backend.match.engine import registered_patterns


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.LeakyReLU(0.2), nn.MaxPool2d(2))


X = torch.rand(2, 3, 10, 10)


def test_unknown_option_raises_value_error_listing_valid_keys():
    # Dynamo wraps what a backend raises in BackendCompilerFailed; a configuration error passes as itself.
    with pytest.raises(UnknownOptionError) as info:
        torch.compile(small_model(), backend="fusion", options={"stricct": True})(X)
    assert isinstance(info.value, ValueError)
    assert not isinstance(info.value, torch._dynamo.exc.BackendCompilerFailed)
    message = str(info.value)
    assert "stricct" in message and "strict" in message and "dump_dir" in message and "patterns" in message


def test_unknown_option_is_our_error_type_when_called_directly():
    with pytest.raises(UnknownOptionError):
        fusion_backend.fusion(torch.fx.symbolic_trace(small_model()), [X], options={"nope": 1})


@pytest.mark.parametrize(
    "options,fragment",
    [({"patterns": ["conv_epilog"]}, "conv_epilog"), ({"strict": "yes"}, "strict"), ({"dump_dir": 3}, "dump_dir")],
)
def test_invalid_values_of_our_options_name_the_problem(options, fragment):
    with pytest.raises(InvalidOptionError, match=fragment):
        fusion_backend.fusion(torch.fx.symbolic_trace(small_model()), [X], options=options)


def test_inductor_options_and_mode_are_forwarded():
    out = torch.compile(small_model(), backend="fusion", options={"max_autotune": False, "epilogue_fusion": True})(X)
    torch._dynamo.reset()
    out2 = torch.compile(small_model(), backend="fusion", mode="max-autotune-no-cudagraphs")(X)
    torch.testing.assert_close(out, out2)


def test_disabled_pattern_leaves_the_graph_to_inductor():
    with collect_reports() as reports:
        torch.compile(small_model(), backend="fusion", options={"disable_patterns": ["conv_epilogue"]})(X)
    assert reports[0].matches == () and "conv_epilogue" not in reports[0].enabled_patterns


def test_nested_report_collection_gives_each_block_its_reports():
    """An inner block (e.g. ``assert_fused`` inside a test using ``fusion_rewrites``) whose bucket
    equals the outer one must leave the outer block's bucket in place (was removed by ``==``)."""
    with collect_reports() as outer:
        with collect_reports() as inner:
            torch.compile(small_model(), backend="fusion")(X)
        assert inner == outer and len(inner) == 1
        torch._dynamo.reset()
        torch.compile(small_model(), backend="fusion")(X)
    assert len(outer) == 2 and len(inner) == 1


class Boom(RuntimeError):
    pass


def _break_rewrite(monkeypatch):
    pattern = registered_patterns()["conv_epilogue"]

    def fail(ctx, candidate):
        raise Boom("synthetic rewrite failure")

    monkeypatch.setattr(pattern, "rewrite", fail)


def test_a_failing_rewrite_falls_back_to_inductor_with_one_warning_and_eager_results(monkeypatch):
    _break_rewrite(monkeypatch)
    model = small_model()
    with warnings.catch_warnings(record=True) as caught, collect_reports() as reports:
        warnings.simplefilter("always")
        out = torch.compile(model, backend="fusion")(X)
    torch.testing.assert_close(out, model(X))
    ours = [w for w in caught if "fusion:" in str(w.message)]
    assert len(ours) == 1 and "conv_epilogue" in str(ours[0].message) and "synthetic rewrite failure" in str(ours[0].message)
    (fallback,) = reports[0].fallbacks
    assert fallback.stage == "rewrite" and fallback.pattern == "conv_epilogue" and "Boom" in fallback.error
    assert reports[0].matches == ()


def test_strict_turns_the_fallback_into_an_error(monkeypatch):
    _break_rewrite(monkeypatch)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        torch.compile(small_model(), backend="fusion", options={"strict": True})(X)
    inner = info.value.inner_exception
    assert isinstance(inner, RewriteError)
    assert "conv_epilogue" in str(inner) and "synthetic rewrite failure" in str(inner)


def test_a_failing_compile_of_the_rewritten_graph_falls_back_to_the_original(monkeypatch):
    import fusion_backend.backend as backend

    real = backend._compile_inductor
    calls = []

    def flaky(gm, example_inputs, patches):
        calls.append(gm)
        if len(calls) == 1:
            raise Boom("inductor choked")
        return real(gm, example_inputs, patches)

    monkeypatch.setattr(backend, "_compile_inductor", flaky)
    model = small_model()
    with pytest.warns(UserWarning, match="inductor choked"), collect_reports() as reports:
        # direct=False: a graph of only fused ops would otherwise skip Inductor (direct.py)
        out = torch.compile(model, backend="fusion", options={"direct": False})(X)
    torch.testing.assert_close(out, model(X))
    assert reports[0].fallbacks[0].stage == "compile"
    # The fallback compiled the untouched graph: no fused op in it.
    assert "conv_epilogue" not in calls[1].code and "conv2d" in calls[1].code


def _break_rewritten_backward(monkeypatch):
    """Inductor fails on the backward of a graph that holds a fused op (as its CPU code generator did
    on a DeepLab-style block), wherever AOTAutograd compiles that backward."""
    import torch._inductor.compile_fx as compile_fx

    real = compile_fx.compile_fx_backward

    def failing(gm, *args, **kwargs):
        if "torch.ops.fusion." in gm.code:
            raise Boom("backward lowering failed")
        return real(gm, *args, **kwargs)

    monkeypatch.setattr(compile_fx, "compile_fx_backward", failing)


def test_a_failing_compile_of_the_rewritten_backward_falls_back_before_the_first_step(monkeypatch):
    """AOTAutograd compiles a training graph's backward at its first backward call; the rewritten
    graph's is compiled with its forward, so an Inductor failure there falls back to the graph as
    given during the compile (one warning, the report says so), and the step's output and every
    gradient are eager's, not an exception out of ``backward()``."""
    _break_rewritten_backward(monkeypatch)
    model, eager = small_model(), small_model()
    x = X.clone().requires_grad_(True)
    x_eager = X.clone().requires_grad_(True)
    with pytest.warns(UserWarning, match="backward lowering failed"), collect_reports() as reports:
        out = torch.compile(model, backend="fusion", options={"direct": False})(x)
    (fallback,) = reports[0].fallbacks
    assert fallback.stage == "compile" and "Boom" in fallback.error and reports[0].matches == ()
    want = eager(x_eager)
    torch.testing.assert_close(out, want)
    out.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(x.grad, x_eager.grad)
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_strict_raises_a_failing_backward_compile_at_the_compile(monkeypatch):
    _break_rewritten_backward(monkeypatch)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        torch.compile(small_model(), backend="fusion", options={"strict": True, "direct": False})(X)
    assert isinstance(info.value.inner_exception, RewriteError) and "backward lowering failed" in str(info.value)


def test_placeholders_are_kept_in_order_with_dynamic_shapes():
    model = small_model()
    with collect_reports() as reports:
        compiled = torch.compile(model, backend="fusion", dynamic=True)
        for n in (10, 13):
            x = torch.rand(3, 3, n, n + 1)
            torch.testing.assert_close(compiled(x), model(x))
    assert all(r.counts() == {"conv_epilogue": 1} for r in reports)


def test_dump_dir_writes_stable_files(tmp_path):
    with collect_reports():
        torch.compile(small_model(), backend="fusion", options={"dump_dir": str(tmp_path)})(X)
    folder = tmp_path / "graph_000"
    names = sorted(p.name for p in folder.iterdir())
    assert {"before.py", "after.py", "report.md", "report.json", "graph.dot"} <= set(names)
    assert "conv_epilogue" in (folder / "after.py").read_text()
    assert "conv2d" in (folder / "before.py").read_text()
    report = fusion_backend.GraphReport.from_dict(json.loads((folder / "report.json").read_text()))
    assert report.counts() == {"conv_epilogue": 1}
    dot = (folder / "graph.dot").read_text()
    assert "subgraph cluster_0" in dot and "conv_epilogue" in dot


def test_dump_dir_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSION_DUMP_DIR", str(tmp_path))
    torch.compile(small_model(), backend="fusion")(X)
    assert (tmp_path / "graph_000" / "report.json").exists()


def test_an_unknown_option_surfaces_at_the_first_call_as_documented():
    """The README: an unknown key surfaces at the first call as our ``UnknownOptionError`` (a
    ``ValueError``), one line naming the key."""
    from fusion_backend.errors import UnknownOptionError

    compiled = torch.compile(small_model(), backend="fusion", options={"bogus_key": 1})
    with pytest.raises(UnknownOptionError) as info:
        compiled(X)
    assert isinstance(info.value, ValueError)
    assert str(info.value).startswith("unknown option 'bogus_key' for backend 'fusion'")
    assert "\n" not in str(info.value)


@pytest.mark.heavy
def test_cpu_kernels_without_the_interpreter_run_the_reference_and_say_why_once(fresh_process_checks):
    """``FUSION_CPU_KERNELS=triton`` without ``TRITON_INTERPRET=1``: no Triton driver traceback, the
    CPU reference runs, the report says what to set, and the output is eager's (in the suite's second fresh
    process: ``tests/fresh_process_checks.py``, ``cpu_kernels``)."""
    proc = fresh_process_checks["second"]
    assert proc["returncode"] == 0, proc["stderr"][-3000:]
    checked = proc["results"].get("cpu_kernels", {})
    assert "error" not in checked and "kernel" in checked, (checked, proc["stderr"][-3000:])
    assert checked["kernel"] == (
        "reference: ran the CPU reference: FUSION_CPU_KERNELS=triton needs TRITON_INTERPRET=1 in the environment "
        "before the process starts (Triton kernels run on CPU tensors only under its interpreter)")
    assert "Traceback" not in proc["stderr"] and "active drivers" not in proc["stderr"]


@pytest.mark.parametrize("options, message", [
    ({"max_autotune": "nope"}, "Inductor option 'max_autotune' takes a bool (it is False now), got 'nope'"),
    ({"triton.cudagraphs": 1}, "Inductor option 'triton.cudagraphs' takes a bool (it is False now), got 1"),
])
def test_inductor_option_values_are_checked_against_inductor_s_types(options, message):
    from fusion_backend.errors import InvalidOptionError
    from fusion_backend.options import FusionOptions

    with pytest.raises(InvalidOptionError) as info:
        FusionOptions.parse(options, ("conv_epilogue",))
    assert str(info.value) == message


def test_well_typed_inductor_options_pass_through():
    from fusion_backend.options import FusionOptions

    opts = FusionOptions.parse({"max_autotune": True, "triton.cudagraphs": False}, ("conv_epilogue",))
    assert opts.inductor == {"max_autotune": True, "triton.cudagraphs": False}


def test_two_threads_compiling_different_models_at_once_get_eager_s_results():
    import threading

    torch.manual_seed(0)
    models = [nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()), nn.Sequential(nn.Conv2d(3, 6, 3, stride=2), nn.GELU())]
    inputs = [torch.randn(2, 3, 9, 9), torch.randn(1, 3, 11, 7)]
    results: list = [None, None]
    errors: list = []

    # torch.compile() itself looks the backend up; two threads doing the first lookup of an entry-point
    # backend at once race inside Dynamo's registry ("duplicate name"), so the wrappers are made here
    # and both graphs compile, through the backend, in the threads.
    compiled = [torch.compile(m, backend="fusion", options={"decide": "fuse"}) for m in models]

    def run(i):
        try:
            results[i] = compiled[i](inputs[i])
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for i in range(2):
        torch.testing.assert_close(results[i], models[i](inputs[i]))


def test_compiling_under_set_stance_and_at_the_recompile_limit():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    compiled = torch.compile(model, backend="fusion", options={"decide": "fuse"}, dynamic=False)
    with torch.compiler.set_stance("force_eager"):
        x = torch.randn(1, 3, 6, 6)
        torch.testing.assert_close(compiled(x), model(x))
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    with torch._dynamo.config.patch(**{limit: 1}):
        for size in (6, 7, 8):  # the second and third shapes are past the limit: eager runs them
            x = torch.randn(1, 3, size, size)
            torch.testing.assert_close(compiled(x), model(x))


@pytest.mark.parametrize("decide", ["fuse", "inductor"])
def test_the_graphs_inductor_compiles_keep_dynamo_s_marks_of_the_parameters(monkeypatch, decide):
    """AOTAutograd marks a Dynamo graph's parameters static inputs only where the graph module keeps
    Dynamo's attributes (its ``meta``, ``_param_name_to_source``, the placeholders' ``_dynamo_source``):
    without them CUDA graphs copy every parameter at each replay.  Both the rewritten graph (a fused op
    kept) and the untouched one (nothing fused) must keep them."""
    import fusion_backend.backend as backend

    real, seen = backend._compile_inductor, []

    def recording(gm, example_inputs, patches):
        seen.append(gm)
        return real(gm, example_inputs, patches)

    monkeypatch.setattr(backend, "_compile_inductor", recording)
    torch._dynamo.reset()
    model = small_model()
    with torch.no_grad():
        out = torch.compile(model, backend="fusion", options={"direct": False, "decide": decide})(X)
    torch.testing.assert_close(out, model(X))
    (gm,) = seen
    assert ("conv_epilogue" in gm.code) == (decide == "fuse")
    assert "dynamo_compile_id" in gm.meta and gm._param_name_to_source
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    assert placeholders and all(getattr(n, "_dynamo_source", None) is not None for n in placeholders)


@pytest.mark.heavy
def test_fresh_processes_find_the_backend_by_its_entry_point_and_a_rewritten_graph_in_aotautograds_cache(
        fresh_process_checks):
    """Two fresh processes with the same caches (the suite's: ``tests/fresh_process_checks.py``,
    ``entry_point``): ``backend="fusion"`` is found through the package's entry point without
    importing it first; a graph with a fused op compiled through Inductor (``direct=False``), with a
    backward, is saved to AOTAutograd's cache by the first process and found there by the second (the
    fused-op calls carry a cache hash, ``match.rewrite.mark_cacheable``), and its gradients are eager's."""
    first, second = fresh_process_checks["first"], fresh_process_checks["second"]
    assert first["returncode"] == 0 and second["returncode"] == 0, (first["stderr"][-3000:], second["stderr"][-3000:])
    first, second = first["results"].get("entry_point", {}), second["results"].get("entry_point", {})
    assert "error" not in first and "error" not in second, (first, second)
    assert not first["imported_before"] and first["imported_after"], first
    assert first["ok"] and second["ok"]
    assert first["aot"].get("autograd_cache_saved") == 1 and "autograd_cache_bypass" not in first["aot"], first
    assert second["aot"].get("autograd_cache_hit") == 1, second


@pytest.mark.parametrize("dump", [False, True], ids=["no-dump", "dump"])
def test_a_graph_left_whole_to_inductor_goes_to_it_as_dynamo_gave_it(monkeypatch, tmp_path, dump):
    """Copying a graph costs host time at every compile (milliseconds for a small graph, more for a
    network's), so only the rewrite works on a copy: where nothing is rewritten, Dynamo's graph itself
    goes to Inductor; with a dump folder a copy does (the dump draws the graph after the compile)."""
    import torch.fx as fx

    from fusion_backend import backend

    compiled_graphs = []
    monkeypatch.setattr(backend, "_compile_inductor", lambda gm, inputs, patches: compiled_graphs.append(gm) or gm)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU())
    gm = fx.symbolic_trace(model)
    x = torch.randn(2, 3, 8, 8)
    options = {"decide": "inductor", **({"dump_dir": str(tmp_path)} if dump else {})}
    with collect_reports() as reports:
        compiled = backend.fusion(gm, [x], options=options)
    assert [len(r.matches) for r in reports] == [0] and len(reports[0].decisions) == 1  # matched, left to Inductor
    assert compiled_graphs == [compiled] and (compiled is not gm) == dump
    torch.testing.assert_close(compiled(x), model(x))
