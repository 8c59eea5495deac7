"""A kernel that ``test_compile_pool.py`` compiles in worker processes (they import it by name), and
the launch's side of those tests, run in a process of its own.

WHY other processes: the CPU suite runs Triton's interpreter, which leaves ``triton.language``
patched for interpretation in the test process; a GPU compile there fails.
"""

from __future__ import annotations

from typing import Any

import triton.language as tl
from triton.runtime.jit import JITFunction


def add_offset(x_ptr, n, offset, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + offset, mask=i < n)


# A compiled-GPU kernel even where TRITON_INTERPRET=1 (``@triton.jit`` would make an interpreted one).
add_offset = JITFunction(add_offset)


try:  # the same kernel in Gluon (its own front end and compile source), where this Triton has it
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

    def gluon_add_offset(x_ptr, n, offset, BLOCK: gl.constexpr):
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        i = gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, layout=layout)
        gl.store(x_ptr + i, gl.load(x_ptr + i, mask=i < n) + offset, mask=i < n)

    gluon_add_offset = GluonJITFunction(gluon_add_offset)
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon_add_offset = GluonASTSource = GluonJITFunction = None


def compile_as_the_launch_would(job: Any) -> bool:
    """Compile ``job``'s specialization the way a launch in this process would (``triton.compile``
    with the source class Triton's launch takes for the kernel, the ``JITFunction.ASTSource`` its
    ``create_binder`` sets: Gluon's for a ``GluonJITFunction``; the same target, options and cache
    folder); True when Triton found it compiled in its cache (it built no IR)."""
    import importlib

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(job.module), job.qualname)
    source = GluonASTSource if GluonJITFunction is not None and isinstance(kernel, GluonJITFunction) else ASTSource
    built = []
    make_ir = source.make_ir

    def counting(self, *args, **kwargs):
        built.append(self)
        return make_ir(self, *args, **kwargs)

    source.make_ir = counting
    try:
        with knobs.cache.scope():
            knobs.cache.dir = job.cache_dir
            triton.compile(source(kernel, job.signature, job.constexprs, job.attrs), target=GPUTarget(*job.target),
                           options=dict(job.options))  # fmt: skip
    finally:
        source.make_ir = make_ir
    return not built
