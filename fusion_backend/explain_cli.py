"""``python -m fusion_backend explain FILE.py``: compile a model file with ``fusion``, print the report,
and check the compiled result against eager.

The file uses the benchmark layout (``Model``, ``get_inputs()``, ``get_init_inputs()``).  Exit status:
0 when everything matches eager; 1 on a mismatch (or when the compiled model raises); 2 on a usage
error or bad input: bad ``--options`` / ``--decide`` (checked as the backend checks its options), a bad file, an unknown or unavailable device, a model that fails to build or to
run in eager.  Every error is one line on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Optional, TextIO

import torch

from .errors import FusionError
from .runtime.decision import POLICIES
from .testing import TOLERANCES, compare, reference_run, run_and_backward, run_settled

DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "fp16": torch.float16, "bf16": torch.bfloat16}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fusion_backend explain", description=__doc__.split("\n\n")[0])
    p.add_argument("file", help="model file with Model, get_inputs() and get_init_inputs()")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="convert model and inputs to this dtype")
    p.add_argument("--autocast", choices=["bf16", "fp16"], default=None, help="run the forward under autocast")
    p.add_argument("--dump", metavar="DIR", default=None, help="write graph dumps (before/after code, report, DOT) here")
    p.add_argument("--train", action="store_true", help="also run backward and check every gradient")
    p.add_argument("--dynamic", action="store_true", help="compile with dynamic=True")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--options", metavar="JSON", default=None,
                   help="the backend's options as a JSON object, e.g. '{\"decide\": \"fuse\", \"patterns\": [\"conv_epilogue\"]}'")
    p.add_argument("--decide", metavar="{" + ",".join(POLICIES) + "}", default=None,
                   help="the decide option (overrides --options'); on CPU, where the default leaves every region "
                        "to Inductor, 'fuse' shows what would be fused")
    return p


def backend_options(args: argparse.Namespace) -> dict:
    """``--options``, ``--decide`` and ``--dump`` as the backend's options, validated as the backend
    validates them (``FusionOptions.parse``); a bad one is a ``FusionError`` with a one-line message."""
    options: dict = {}
    if args.options is not None:
        try:
            options = json.loads(args.options)
        except json.JSONDecodeError as exc:
            raise FusionError(f"--options is not JSON: {exc}") from None
        if not isinstance(options, dict):
            raise FusionError(f"--options must be a JSON object of option keys and values, got {args.options!r}")
    if args.decide is not None:
        if args.decide not in POLICIES:
            raise FusionError(f"--decide must be one of {', '.join(POLICIES)}, got {args.decide!r}")
        options["decide"] = args.decide
    if args.dump:
        options["dump_dir"] = args.dump
    from .match.engine import default_patterns, registered_patterns
    from .options import FusionOptions

    FusionOptions.parse(options, tuple(registered_patterns()), default_patterns())
    return options


def main(argv: Optional[list[str]] = None, out: TextIO = sys.stdout) -> int:
    args = build_parser().parse_args(argv)
    from .bench.suite import load_workload

    try:
        options = backend_options(args)
        workload = load_workload(args.file)
        device = _device(args.device)
    except (FusionError, ValueError, OSError) as exc:
        return _usage_error(str(exc))
    try:
        model, inputs = workload.build(args.seed)
    except Exception as exc:  # noqa: BLE001 - whatever the user's file raises is bad input
        return _usage_error(f"{args.file}: building the model or its inputs failed: {type(exc).__name__}: {exc}")

    dtype = DTYPES[args.dtype]
    model = model.to(device=device, dtype=dtype)
    inputs = [t.to(device=device, dtype=dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs]
    # Compare like for like: TF32 would make eager and the fused kernels round differently.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False

    autocast = (torch.autocast(device.type, dtype=DTYPES[args.autocast])
                if args.autocast else contextlib.nullcontext())
    tol = TOLERANCES[DTYPES[args.autocast]] if args.autocast else None

    def leaves():
        return [t.detach().clone().requires_grad_(args.train and t.is_floating_point()) if isinstance(t, torch.Tensor) else t
                for t in inputs]

    try:
        want, want_grads = run_and_backward(model, leaves(), args.train, model, autocast)
    except Exception as exc:  # noqa: BLE001 - a model that fails in eager is bad input, not a mismatch
        return _usage_error(f"{args.file}: the model fails in eager on {device}: {type(exc).__name__}: {exc}")
    model.zero_grad(set_to_none=True)
    reference = reference_run(model, leaves(), args.train)  # eager where the model cannot run in float64

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusion", options=options, dynamic=args.dynamic or None)
    try:  # on the code the backend settles on (decisions deferred past the first call included)
        got, got_grads, reports = run_settled(compiled, leaves(), args.train, model, autocast)
    except Exception as exc:  # noqa: BLE001 - eager ran, the compiled model did not: a mismatch
        print(f"reference: {reference.describe()}", file=out)
        print(f"MISMATCH vs eager: the compiled model raised {type(exc).__name__}: "
              f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}", file=out)
        return 1
    result = "\n".join(str(r) for r in reports) or "fusion: no graph was compiled"

    print(result, file=out)
    print(f"\nreference: {reference.describe()}", file=out)
    problems = []
    outs_got = got if isinstance(got, (tuple, list)) else (got,)
    outs_want = want if isinstance(want, (tuple, list)) else (want,)
    outs_ref = reference.outputs(len(outs_want))
    for i, (g, w, r) in enumerate(zip(outs_got, outs_want, outs_ref, strict=False)):
        problems.append(compare(f"output[{i}]", g, w, tol, reference=r))
    for name, w in want_grads.items():
        if w is not None:
            problems.append(compare(f"grad of {name}", got_grads[name], w, tol, reference=reference.grads.get(name))
                            if got_grads.get(name) is not None else f"grad of {name}: missing")
    problems = [p for p in problems if p]
    checked = 1 + len(want_grads)
    if problems:
        print("MISMATCH vs eager:\n  " + "\n  ".join(problems), file=out)
        return 1
    print(f"OK: output{' and ' + str(len(want_grads)) + ' gradients' if args.train else ''} match eager "
          f"({checked} tensors, device {args.device}, dtype {args.dtype}{', autocast ' + args.autocast if args.autocast else ''})", file=out)
    return 0


def _device(name: str) -> torch.device:
    """``--device`` checked: ``cpu`` or an available ``cuda[:N]``; anything else is a ``FusionError``."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise FusionError(f"--device {name!r} is not a device: use cpu or cuda[:N]") from None
    if device.type not in ("cpu", "cuda"):
        raise FusionError(f"--device {name!r}: the fusion backend runs on cpu or cuda[:N]")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FusionError(f"--device {name} was asked for but CUDA is not available")
    return device


def _usage_error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2
