"""``python -m fusion_backend bench``: a benchmark harness that checks before it times.

For every workload (a model file in the benchmark layout) x dtype x mode x backend, the harness
compiles, checks the first call's output and gradients against eager, and only then times the step
(warm and cold L2), measures its memory, and relates it to the workload's roofline floor.  Results are
frozen dataclasses (:mod:`.results`) written as a table, JSON and a chart (:mod:`.output`).

Modules, one responsibility each:

- :mod:`.suite`        named suites, model files and folders -> :class:`Workload`
- :mod:`.backends`     backend names -> how a module is compiled
- :mod:`.config`       precisions, modes, tolerances, measurement settings
- :mod:`.correctness`  the gate: norm-wise relative error per output and gradient
- :mod:`.measure`      CUDA-event timer, memory probe, device rates (injectable :class:`Instruments`)
- :mod:`.roofline`     minimal bytes and flops -> the floor
- :mod:`.runner`       orchestration
- :mod:`.results`      result dataclasses and their JSON round-trip
- :mod:`.output`       tables, Markdown, JSON and PNG files
- :mod:`.cli`          argument parsing and everything printed

Programmatic use (e.g. with your own backend)::

    from fusion_backend.bench import BenchBackend, BenchConfig, Runner, resolve_suite, cuda_instruments
"""

from .backends import BUILTIN_BACKENDS, BenchBackend, resolve_backends
from .config import BenchConfig, MeasureConfig
from .errors import BackendSpecError, BenchError, ConfigError, SuiteError
from .measure import Instruments, MemoryStats, TimingStats, cuda_instruments, measure_device_rates
from .results import BenchReport, CaseResult, ItemResult, Status
from .roofline import DeviceRates, Roofline
from .runner import ProgressEvent, Runner, run_benchmark
from .suite import Workload, load_workload, resolve_suite

__all__ = [
    "BUILTIN_BACKENDS", "BackendSpecError", "BenchBackend", "BenchConfig", "BenchError", "BenchReport",
    "CaseResult", "ConfigError", "DeviceRates", "Instruments", "ItemResult", "MeasureConfig", "MemoryStats",
    "ProgressEvent", "Roofline", "Runner", "Status", "SuiteError", "TimingStats", "Workload",
    "cuda_instruments", "load_workload", "measure_device_rates", "resolve_backends", "resolve_suite",
    "run_benchmark",
]
