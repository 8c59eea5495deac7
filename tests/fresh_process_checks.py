"""Checks that need a process of their own, one that never had Triton's interpreter, run in one such
process (``conftest.fresh_process_checks``): each process costs seconds of start-up (Python, torch,
the package) before it checks anything.  It prints one JSON object; a check that fails prints its
error under its own key and the others still run.

The process starts with ``FUSION_CPU_KERNELS=triton`` and without ``TRITON_INTERPRET``.

* ``swap_pass``, first (before anything else imports a fused op): how many autograd-free ops a
  process that imported only ``ops.autograd_free`` has registered, and the swap pass's cache key
  there (``tests/ops/test_autograd_free_ops.py``).
* ``cpu_kernels``: ``explain`` on a conv + ReLU: what the report says ran (the CPU reference, and why),
  and whether the output is eager's (``tests/e2e/test_backend.py``).
"""

import json
import traceback

results: dict = {}

try:
    from fusion_backend.ops.autograd_free import _AUTOGRAD_FREE, SwapInAutogradFreeOps

    results["swap_pass"] = {"registered": len(_AUTOGRAD_FREE), "uuid": SwapInAutogradFreeOps().uuid().hex()}
except Exception:  # noqa: BLE001 - reported to the test that reads it
    results["swap_pass"] = {"error": traceback.format_exc()}

try:
    import torch

    import fusion_backend

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
    x = torch.randn(2, 3, 8, 8)
    report = fusion_backend.explain(model, x, options={"decide": "fuse"})
    torch.testing.assert_close(report.output, model(x))
    results["cpu_kernels"] = {"kernel": report.reports[0].matches[0].kernel}
except Exception:  # noqa: BLE001 - reported to the test that reads it
    results["cpu_kernels"] = {"error": traceback.format_exc()}

print(json.dumps(results))
