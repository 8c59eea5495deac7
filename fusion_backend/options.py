"""Options of the backend: ``torch.compile(model, backend="fusion", options={...})``.

Our keys are stripped; every other key must be an Inductor config key and is forwarded to Inductor
(as Inductor itself accepts ``options``).  An unknown key raises ``UnknownOptionError`` (a
``ValueError``) naming the closest valid key.  A pattern name is checked by
:func:`check_pattern_names` wherever one is accepted (here, the test helpers, the explain command).

======================  ===========================================================================
key                     meaning
======================  ===========================================================================
``patterns``            names of the pattern families to run (iterable of str), or ``"all"``: every
                        registered family; default: every registered family but the opt-in ones
                        (``Pattern.opt_in``), or those the ``FUSION_PATTERNS`` environment variable
                        names (comma-separated)
``disable_patterns``    names to leave out of the above
``strict``              bool; a failure to rewrite/compile a region, or a kernel that cannot run,
                        raises instead of falling back to Inductor / the reference (for tests)
``dump_dir``            directory for per-graph dumps (before/after code, report, DOT); the
                        ``FUSION_DUMP_DIR`` environment variable sets it too
``direct``              bool, default True: a rewritten graph that holds only fused ops and glue
                        (casts, views) runs as plain FX code with eager autograd instead of through
                        AOTAutograd and Inductor, which would fuse nothing there but cost host time
                        per call (``fusion_backend/runtime/direct.py``); False sends it to Inductor too.
                        Inductor options, or a mode with CUDA graphs, also send it to Inductor
``decide``              ``"measure"`` (default; the ``FUSION_DECIDE`` environment variable sets
                        it too): keep a rewrite only where the fused op is faster than Inductor's
                        code for the region, timed on the first compile of each input signature
                        and cached (``runtime/decision.py``); ``"fuse"``: always rewrite; ``"inductor"``:
                        never rewrite (matches are still reported)
``decide_margin``       float >= 0, default 0.03: how much faster the fused op must be to be kept
                        (ties go to Inductor)
``defer``               bool, default True: a region whose decision must be measured runs Inductor's
                        code while the fused op's kernels compile in Inductor's worker processes,
                        and is decided at the next call after they have compiled (never the
                        first call itself) or at ``fusion_backend.settle()``, so that the first
                        call costs what Inductor's does (``runtime/deferred.py``); False decides
                        during the first call
``decide_budget``       float >= 0 or None; default 0.2, and 3.0 under CUDA graphs: what a graph's
                        decisions may take.  Deferred (the default mode): a fraction of the graph's
                        first call for sending the fused ops' kernels to the compile workers during
                        that call, then at the settle waiting for them, measuring regions,
                        recompiling and timing the whole graph; a region not measured in time stays
                        with Inductor (a later process measures it); the first region of a settle
                        is always measured; a settle that measured the regions it keeps compiles
                        the graph again with them only where that compile fits the rest of the
                        budget, else a later process, finding them in the cache, does
                        (``backend._postponed``).  Under CUDA graphs, where the regions are decided
                        during the compile: a multiple of Inductor's compile of the graph, estimated
                        from earlier graphs (``runtime/compile_estimate.py``), for compiling the
                        fused kernels of every region to be measured (all at once, in the worker
                        processes) and measuring the regions whose kernels are ready; the graph
                        then compiles once, with what they keep.  None: no limit (under CUDA graphs
                        every region is measured, its kernels waited for)
======================  ===========================================================================

Environment variables that set defaults here (``fusion_backend.environment`` lists them all):
``FUSION_DUMP_DIR``, ``FUSION_DECIDE`` and ``FUSION_CACHE_DIR`` (where measured decisions are kept;
default ``~/.cache/fusion_backend``).
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from . import environment
from .errors import InvalidOptionError, UnknownOptionError, UnknownPatternError
from .runtime.decision import DEFAULT_MARGIN, POLICIES

OUR_KEYS = ("patterns", "disable_patterns", "strict", "dump_dir", "direct", "decide", "decide_margin", "defer",
            "decide_budget")
#: The default of ``decide_budget`` where decisions are deferred: a fraction of the graph's first call.
DEFAULT_DECIDE_BUDGET = 0.2
# NOTE: under CUDA graphs a graph's decisions are made once per machine, during its compile, and kept in
# the cache.  Measuring every region made the first call 1.8x Inductor's on ResNet-50's training graph
# (65.4 s against 36.6 s), 3.2x on its inference graph (37.3 against 11.5 s) and 3.5x on EfficientNet-B0's
# (62.0 against 17.6 s; bf16, H200, the fused kernels compiled all at once first: ``python -m
# fusion_backend bench --log --suite demos/realnets/resnet50.py --dtype bf16 --mode infer --backends
# inductor,fusion-decide-all --compile-mode reduce-overhead``): a budget of three times Inductor's
# compile decides such networks in their first process, where with a fifth of it (measuring only
# regions whose kernels had compiled, and sending the kernels of two decision keys per kind of region
# per process) they ran Inductor's code in their first two processes.
#: The default of ``decide_budget`` under CUDA graphs: a multiple of Inductor's compile of the graph.
CUDA_GRAPHS_DECIDE_BUDGET = 3.0
DECIDE_ENV = environment.DECIDE
CACHE_DIR_ENV = environment.CACHE_DIR
cache_dir = environment.cache_dir


@dataclass(frozen=True)
class FusionOptions:
    """Validated options.  ``inductor`` holds the keys forwarded to Inductor as config patches."""

    patterns: tuple[str, ...]
    strict: bool = False
    dump_dir: Optional[Path] = None
    inductor: dict[str, Any] = field(default_factory=dict)
    direct: bool = True
    decide: str = "measure"
    decide_margin: float = DEFAULT_MARGIN
    cache_dir: Path = field(default_factory=cache_dir)
    defer: bool = True
    decide_budget: Optional[float] = None
    """As given (``math.inf`` where the option is None), or None where not given: see :meth:`budget_fraction`."""

    def budget_fraction(self, cuda_graphs: bool) -> float:
        """``decide_budget`` as given, else its default for where the decisions are made: deferred
        (a fraction of the graph's first call) or, under CUDA graphs, during the compile (a
        multiple of Inductor's compile of the graph)."""
        if self.decide_budget is not None:
            return self.decide_budget
        return CUDA_GRAPHS_DECIDE_BUDGET if cuda_graphs else DEFAULT_DECIDE_BUDGET

    @staticmethod
    def parse(options: Optional[Mapping[str, Any]], registered: tuple[str, ...],
              default: Optional[tuple[str, ...]] = None) -> FusionOptions:  # fmt: skip
        """Validate ``options`` against our keys and Inductor's config; see the module docstring.
        ``registered``: every family's name; ``default``: the families that run where neither the
        option nor ``FUSION_PATTERNS`` names any (None: all of them)."""
        options = dict(options or {})
        if not all(isinstance(k, str) for k in options):
            raise InvalidOptionError(f"option keys must be strings, got {sorted(map(repr, options))}")
        ours = {k: options.pop(k) for k in list(options) if k in OUR_KEYS}
        inductor_keys = _inductor_keys()
        unknown = sorted(k for k in options if k.replace("-", "_") not in inductor_keys)
        if unknown:
            raise UnknownOptionError(_unknown_keys_message(unknown, inductor_keys))
        inductor = {k.replace("-", "_"): v for k, v in options.items()}
        for key, value in inductor.items():
            _check_inductor_value(key, value, inductor_keys[key])

        wanted = ours.get("patterns") or environment.patterns()
        if wanted is None:
            names = tuple(registered if default is None else default)
        elif wanted == "all":
            names = tuple(registered)
        elif isinstance(wanted, str):
            names = (wanted,)
        else:
            try:
                names = tuple(wanted)
            except TypeError:
                raise InvalidOptionError(f"option 'patterns' must be 'all' or names of patterns, got {wanted!r}") from None
        disabled = ours.get("disable_patterns") or ()
        disabled = (disabled,) if isinstance(disabled, str) else tuple(disabled)
        check_pattern_names((*names, *disabled), registered)
        names = tuple(n for n in names if n not in disabled)

        strict = ours.get("strict", False)
        if not isinstance(strict, bool):
            raise InvalidOptionError(f"option 'strict' must be a bool, got {strict!r}")
        dump = ours.get("dump_dir") or environment.dump_dir()
        if dump is not None and not isinstance(dump, (str, os.PathLike)):
            raise InvalidOptionError(f"option 'dump_dir' must be a path, got {dump!r}")
        direct = ours.get("direct", True)
        if not isinstance(direct, bool):
            raise InvalidOptionError(f"option 'direct' must be a bool, got {direct!r}")
        environment.check()  # a bad switch fails here, not inside a fused op's first call
        decide = ours.get("decide") or environment.decide() or "measure"
        if decide not in POLICIES:
            where = "option 'decide'" if "decide" in ours else f"{DECIDE_ENV}"
            raise InvalidOptionError(f"{where} must be one of {list(POLICIES)}, got {decide!r}")
        margin = ours.get("decide_margin", DEFAULT_MARGIN)
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 0:
            raise InvalidOptionError(f"option 'decide_margin' must be a number >= 0, got {margin!r}")
        defer = ours.get("defer", True)
        if not isinstance(defer, bool):
            raise InvalidOptionError(f"option 'defer' must be a bool, got {defer!r}")
        budget = None  # not given: the default of where the decisions are made (``budget_fraction``)
        if "decide_budget" in ours:
            budget = math.inf if ours["decide_budget"] is None else ours["decide_budget"]
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget >= 0):
            raise InvalidOptionError(f"option 'decide_budget' must be a number >= 0 (a fraction of the graph's first "
                                     f"call) or None (no limit), got {budget!r}")
        return FusionOptions(names, strict, Path(dump) if dump else None, inductor, direct, decide, float(margin),
                             defer=defer, decide_budget=None if budget is None else float(budget))


def check_pattern_names(names: Any, registered: Any, what: str = "pattern") -> None:
    """Raise ``UnknownPatternError`` where one of ``names`` is not a registered pattern family,
    naming it, the closest registered name and every registered one.  ``what`` says where the name
    was given (e.g. ``"assert_not_fused's pattern"``)."""
    registered = sorted(registered)
    bad = [n for n in names if n not in registered]
    if not bad:
        return
    first = bad[0]
    guess = difflib.get_close_matches(first, registered, n=1) if isinstance(first, str) else []
    hint = f" (did you mean {guess[0]!r}?)" if guess else ""
    listing = f"unknown {what}s {bad}" if len(bad) > 1 else f"unknown {what} {first!r}"
    raise UnknownPatternError(f"{listing}{hint}; registered patterns: {registered}")


def _unknown_keys_message(unknown: list[str], inductor_keys: Mapping[str, Any]) -> str:
    """One line: the unknown keys, the closest valid key to the first, where the valid keys are."""
    first = unknown[0]
    guess = (difflib.get_close_matches(first, OUR_KEYS, n=1)
             or difflib.get_close_matches(first.replace("-", "_"), list(inductor_keys), n=1))
    hint = f" (did you mean {guess[0]!r}?)" if guess else ""
    keys = f"options {unknown}" if len(unknown) > 1 else f"option {first!r}"
    return (f"unknown {keys} for backend 'fusion'{hint}; valid keys: ours {list(OUR_KEYS)}, "
            f"or any Inductor config key (torch._inductor.list_options())")


def _inductor_keys() -> dict[str, Any]:
    """Inductor's config keys with their current values (whose types the values given must match)."""
    from torch._inductor import config

    return config.get_config_copy()


def _check_inductor_value(key: str, value: Any, current: Any) -> None:
    """An Inductor option's value must have the type of Inductor's own setting where that type is a
    plain bool, int, float or str (a setting that is ``None`` or a container is not checked)."""
    if isinstance(current, bool):
        ok = isinstance(value, bool)
    elif isinstance(current, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(current, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif isinstance(current, str):
        ok = isinstance(value, str)
    else:
        return
    if not ok:
        raise InvalidOptionError(
            f"Inductor option {key!r} takes a {type(current).__name__} (it is {current!r} now), got {value!r}")
