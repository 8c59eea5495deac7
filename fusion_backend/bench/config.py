"""What a benchmark run does: precisions, modes, backends, tolerances and how hard to measure.

The configuration is plain data (frozen dataclasses of strings and numbers) so that it is written to
the JSON report verbatim and a run can be reproduced from its report.

Precisions are named, not given as ``torch.dtype``: ``bf16`` means *autocast* to bfloat16 around the
forward with fp32 parameters and inputs, which is how users train in bf16, not ``model.to(bfloat16)``.
Each precision carries the default tolerance of the correctness gate and the kind of matmul unit its
convolutions run on, which picks the compute rate of the roofline.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import ConfigError


@dataclass(frozen=True)
class Precision:
    """One ``--dtype`` choice.

    ``autocast`` is the name of the ``torch`` dtype to autocast the forward to (``None``: no autocast).
    ``tolerance`` is the norm-wise relative error against eager the correctness gate accepts (rule 1
    of :mod:`fusion_backend.bench.correctness`): 1e-4 for fp32, 2e-2 for bf16, a few bf16 roundings.
    ``tf32_tolerance`` replaces it while cuDNN may run fp32 convolutions in TF32 (PyTorch's default,
    left alone and recorded): TF32 keeps 10 mantissa bits, so one convolution's result moves by about
    its unit roundoff 2**-11 = 4.9e-4 relative, and two correct paths of which one uses TF32 differ by
    that much (measured on H100: Inductor vs eager on ``conv2d_mul_leaky_gelu_small``, 4.6e-4); 2e-3
    leaves 4x margin.  ``fp64_multiplier`` is rule 2's factor over eager's own error from float64
    (Inductor's: 2 for fp32, 3 for reduced precision).
    """

    name: str
    autocast: str | None
    tolerance: float
    description: str
    tf32_tolerance: float | None = None
    fp64_multiplier: float = 2.0

    def autocast_dtype(self) -> torch.dtype | None:
        """The ``torch.dtype`` to autocast to, or ``None`` for no autocast."""
        return None if self.autocast is None else getattr(torch, self.autocast)


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", None, 1e-4, "fp32 parameters and inputs; TF32 flags at PyTorch defaults",
                      tf32_tolerance=2e-3, fp64_multiplier=2.0),
    "bf16": Precision("bf16", "bfloat16", 2e-2, "torch.autocast(bfloat16) around forward; fp32 params",
                      fp64_multiplier=3.0),
}

MODES: dict[str, str] = {
    "infer": "forward under torch.no_grad()",
    "train": "forward + backward of every floating output with a fixed random upstream gradient; "
    "gradients of every floating input and parameter, set to None before each step",
}

DEFAULT_BACKENDS: tuple[str, ...] = ("eager", "inductor", "fusion")


@dataclass(frozen=True)
class MeasureConfig:
    """How timings are taken (see :class:`fusion_backend.bench.measure.CudaEventTimer`).

    ``warmup`` calls run untimed before every measurement.  Each item is measured in ``rounds``
    rounds, interleaved with the other backends of its case (``runner.py``); while some item's two
    quietest warm rounds differ by more than ``agreement`` (relative), or the verdict's paired round
    ratios have not put the row on one side of the tie (``runner._decided``), every item of the case
    gets another round, at most ``extra_rounds`` more.  Without a fixed ``reps``
    the number of timed repetitions per round is picked from an estimate so that all rounds together
    take about ``target_ms``, clamped to ``[min_reps, max_reps]``: enough samples for a stable median
    on fast workloads without spending minutes on slow ones.  ``cold`` adds a second measurement per
    round with L2 flushed before every repetition.  ``consecutive``: a round's repetitions of one item
    run in blocks of that many before the next item's (1: one repetition each in turn).

    WHY blocks: a training or inference loop calls one compiled model again and again, and on a
    host-bound row the host's cost of a call can depend on what ran just before it.  NOTE: ResNet-50
    bf16 inference on an H200 (``python tools/bench_step_accounting.py`` and a probe before it,
    ``docs/perf/RESULTS.md``, realnets section): Inductor's generated code took 24-100 minor page
    faults per call when the backends alternated call by call, and the fusion copy's step none in
    30 calls in a row; which copy took more decided the row.  The default stays 1 until blocks are measured beside it.

    WHY six rounds: a row's fusion / Inductor ratio is the median of its paired round ratios
    (``results.CaseResult.speedup``), and on host-bound rows a single round's ratio drifts by
    several percent whatever its length.  NOTE: ``python tools/copies_noise.py FILE --mode M
    --rounds 8`` on the H100 (three Inductor copies of one model; ``conv2d_128_k3_silu`` bf16
    forward and ``conv2d_64_k3_relu`` fp32 training, three cache settings each): single rounds
    read 0.85-1.07x between copies of the same code, the medians of eight 0.979-1.000x.  Six
    rounds of half the repetitions take as long as three of all of them (``target_ms`` covers
    every round).
    """

    warmup: int = 3
    target_ms: float = 300.0
    reps: int | None = None
    min_reps: int = 10
    max_reps: int = 1000
    cold: bool = True
    rounds: int = 6
    extra_rounds: int = 6
    agreement: float = 0.03
    consecutive: int = 1

    def __post_init__(self) -> None:
        if self.warmup < 0:
            raise ConfigError(f"warmup must be >= 0, got {self.warmup}")
        if self.reps is not None and self.reps < 1:
            raise ConfigError(f"reps must be >= 1, got {self.reps}")
        if not (1 <= self.min_reps <= self.max_reps):
            raise ConfigError(f"need 1 <= min_reps <= max_reps, got {self.min_reps}, {self.max_reps}")
        if self.target_ms <= 0:
            raise ConfigError(f"target_ms must be > 0, got {self.target_ms}")
        if self.rounds < 1:
            raise ConfigError(f"rounds must be >= 1, got {self.rounds}")
        if self.extra_rounds < 0:
            raise ConfigError(f"extra_rounds must be >= 0, got {self.extra_rounds}")
        if self.agreement < 0:
            raise ConfigError(f"agreement must be >= 0, got {self.agreement}")
        if self.consecutive < 1:
            raise ConfigError(f"consecutive must be >= 1, got {self.consecutive}")

    def choose_reps(self, estimate_ms: float) -> int:
        """Repetitions for one round's measurement given one repetition's estimated time in milliseconds.

        >>> MeasureConfig(target_ms=300, rounds=1).choose_reps(1.5)
        200
        >>> MeasureConfig(target_ms=300, rounds=3).choose_reps(1.5)
        66
        >>> MeasureConfig(target_ms=300).choose_reps(100.0)   # slow: never fewer than min_reps
        10
        """
        if self.reps is not None:
            return self.reps
        if estimate_ms <= 0:
            return self.max_reps
        wanted = int(self.target_ms / self.rounds / estimate_ms)
        return max(self.min_reps, min(self.max_reps, wanted))


@dataclass(frozen=True)
class BenchConfig:
    """The matrix a run covers and the rules it applies.

    Every workload runs under every ``dtypes`` x ``modes`` x ``backends`` combination.  ``seed`` fixes
    parameters, inputs and upstream gradients, identical for every backend.  ``tolerances`` overrides
    the gate's rule-1 tolerance per precision name (otherwise :meth:`tolerance` picks the precision's
    default); ``fp64_check`` enables rule 2 (the float64 comparison).  ``check_only`` runs the gate and
    skips every timing and memory measurement.  ``steady_state_budget``: the most a row's time to
    steady state may take (fusion's first call and settle over Inductor's first call), which the
    verdict's first-call line holds each row to; ``None``: not judged (whole networks are held to 1.25).
    """

    dtypes: tuple[str, ...] = ("fp32", "bf16")
    modes: tuple[str, ...] = ("infer", "train")
    backends: tuple[str, ...] = DEFAULT_BACKENDS
    seed: int = 0
    tolerances: dict[str, float] = field(default_factory=dict)
    fp64_check: bool = True
    check_only: bool = False
    memory: bool = True
    measure: MeasureConfig = field(default_factory=MeasureConfig)
    steady_state_budget: float | None = None

    def __post_init__(self) -> None:
        if self.steady_state_budget is not None and not self.steady_state_budget > 0:
            raise ConfigError(f"steady_state_budget must be > 0, got {self.steady_state_budget}")
        for name in self.dtypes:
            if name not in PRECISIONS:
                raise ConfigError(f"unknown dtype {name!r}; choose from {', '.join(PRECISIONS)}")
        for mode in self.modes:
            if mode not in MODES:
                raise ConfigError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        for name in (self.dtypes, self.modes, self.backends):
            if not name:
                raise ConfigError("dtypes, modes and backends must each name at least one entry")
            if len(set(name)) != len(name):
                raise ConfigError(f"duplicate entry in {list(name)}")
        for dtype, tol in self.tolerances.items():
            if dtype not in PRECISIONS:
                raise ConfigError(f"tolerance given for unknown dtype {dtype!r}")
            if not tol > 0:
                raise ConfigError(f"tolerance for {dtype} must be > 0, got {tol}")

    def tolerance(self, dtype: str, conv_tf32: bool = False) -> float:
        """Rule 1's tolerance for precision ``dtype``: the override, else the TF32 one while cuDNN may use
        TF32 (``conv_tf32``) and the precision has one, else the precision's default."""
        if dtype in self.tolerances:
            return self.tolerances[dtype]
        precision = PRECISIONS[dtype]
        if conv_tf32 and precision.tf32_tolerance is not None:
            return precision.tf32_tolerance
        return precision.tolerance
