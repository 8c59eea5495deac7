"""Checks that need a process of their own, one that never had Triton's interpreter, run in two such
processes (``conftest.fresh_process_checks``): each process costs seconds of start-up (Python, torch,
Dynamo, Inductor, Triton, the package) before it checks anything.  Each process prints one JSON
object; a check that fails prints its error under its own key and the others still run.

Both processes start with ``FUSION_CPU_KERNELS=triton``, without ``TRITON_INTERPRET``, and with the
same fresh Inductor and decision caches (``TORCHINDUCTOR_CACHE_DIR``, ``FUSION_CACHE_DIR``).

``python tests/fresh_process_checks.py --first`` (the first process) checks only

* ``entry_point``: ``backend="fusion"`` is found through the package's entry point, the package not
  imported before; a graph with a fused op compiled through Inductor (``direct=False``) with its
  backward: its gradients, and AOTAutograd's cache counters (it is saved there)
  (``tests/e2e/test_backend.py``).

``python tests/fresh_process_checks.py [-- COMPILE_CHECK_ARGS]`` (the second process, after the
first) checks, in this order:

* ``swap_pass``, first (before anything else imports a fused op): how many autograd-free ops a
  process that imported only ``ops.autograd_free`` has registered, and the swap pass's cache key
  there (``tests/ops/test_autograd_free_ops.py``).
* ``cpu_kernels``: ``explain`` on a conv + ReLU: what the report says ran (the CPU reference, and why),
  and whether the output is eager's (``tests/e2e/test_backend.py``).
* ``entry_point``: the first process's graph again, found in AOTAutograd's cache this time.
* ``compile_check``: with arguments after ``--``, what ``tools/compile_check.py`` with those arguments
  printed and returned (the sm_90 compile checks: ``conftest.SM90_COMPILE_CASES``).
"""

import contextlib
import io
import json
import sys
import traceback
from pathlib import Path


def _check(results: dict, name: str, check) -> None:
    try:
        results[name] = check()
    except Exception:  # noqa: BLE001 - reported to the test that reads it
        results[name] = {"error": traceback.format_exc()}


def swap_pass() -> dict:
    from fusion_backend.ops.autograd_free import _AUTOGRAD_FREE, SwapInAutogradFreeOps

    return {"registered": len(_AUTOGRAD_FREE), "uuid": SwapInAutogradFreeOps().uuid().hex()}


def cpu_kernels() -> dict:
    import torch

    import fusion_backend

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
    x = torch.randn(2, 3, 8, 8)
    report = fusion_backend.explain(model, x, options={"decide": "fuse"})
    torch.testing.assert_close(report.output, model(x))
    return {"kernel": report.reports[0].matches[0].kernel}


def entry_point() -> dict:
    """The same graph in both processes; AOTAutograd's and Inductor's counters are this check's own."""
    imported_before = "fusion_backend" in sys.modules
    import torch
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    before = {kind: dict(counters[kind]) for kind in ("aot_autograd", "inductor")}
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3)

    def m(x):
        return F.relu(conv(x)) * 2 + 1

    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    out = torch.compile(m, backend="fusion", options={"decide": "fuse", "direct": False})(x)
    imported_after = "fusion_backend" in sys.modules
    out.sum().backward()
    got = [x.grad.clone(), conv.weight.grad.clone()]
    x.grad = conv.weight.grad = conv.bias.grad = None
    m(x).sum().backward()
    ok = all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(got, [x.grad, conv.weight.grad], strict=True))
    counted = {kind: {k: v - before[kind].get(k, 0) for k, v in counters[kind].items() if v != before[kind].get(k, 0)}
               for kind in before}  # fmt: skip
    return {"imported_before": imported_before, "imported_after": imported_after, "ok": ok,
            "aot": counted["aot_autograd"], "inductor": counted["inductor"]}  # fmt: skip


def compile_check(argv: list[str]) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import compile_check as tool

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = tool.main(argv)
    return {"returncode": status, "stdout": printed.getvalue()}


def main(argv: list[str]) -> None:
    results: dict = {}
    if argv[:1] == ["--first"]:
        _check(results, "entry_point", entry_point)
    else:
        _check(results, "swap_pass", swap_pass)
        _check(results, "cpu_kernels", cpu_kernels)
        _check(results, "entry_point", entry_point)
        if "--" in argv:
            _check(results, "compile_check", lambda: compile_check(argv[argv.index("--") + 1:]))
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
