"""Test set-up shared by the whole suite.

Without CUDA, Triton kernels run on CPU tensors under Triton's interpreter.  ``TRITON_INTERPRET`` is
read when ``@triton.jit`` decorates a kernel, so it must be set before any kernel module is imported:
that is why this happens at the top of conftest, before the tests import ``fusion_backend``.
"""

import dataclasses
import os


def _threads_shared_among_workers() -> None:
    """Under pytest-xdist, each worker runs its share of the CPUs' threads, not all of them: set in
    ``OMP_NUM_THREADS`` before torch and numpy are imported, the share sizes ATen's OpenMP pool, MKL and
    numpy's OpenBLAS (on which Triton's interpreter runs ``tl.dot``), and the suite's subprocesses (the
    distributed spawn, the fresh-process and command-line tests) inherit it.  A thread count the caller
    set in ``OMP_NUM_THREADS`` is kept; without xdist nothing changes.

    Each worker otherwise starts one thread per CPU, so two workers on two cores run four: every
    parallel region of one worker then waits for a thread the other worker's threads have pushed off
    a core, and the suite is full of small ops.  NOTE: 2-core CPU box, empty Inductor and Triton
    caches, ``time python -m pytest -q -n 2 -p no:cacheprovider``: 6:08-6:14 with two threads per
    worker, 4:25 with one (``tests/ops/test_conv_global_mean_op.py::test_gradcheck_float64[3]`` once
    took 31.6 s with two, under 0.8 s with one)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if workers < 1 or "OMP_NUM_THREADS" in os.environ:
        return
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ["OMP_NUM_THREADS"] = str(max(1, cpus // workers))


_threads_shared_among_workers()


def _fewer_full_collections() -> None:
    """The garbage collector looks at the whole heap a tenth as often: a full collection waits for 100
    collections of the middle generation, not 10 (the young generations are collected as often as
    before).  With torch, Dynamo and Inductor loaded the heap holds millions of objects, and a full
    collection costs a few tenths of a second.  NOTE: 2-core CPU box, full suite under xdist (``gc.callbacks``
    timing every collection): 30 and 41 full collections in the two workers, 14.2 and 17.0 s, before;
    11 and 22, 8.7 and 12.1 s, after.  A threshold the caller set is kept."""
    import gc

    if gc.get_threshold() == (700, 10, 10):
        gc.set_threshold(700, 10, 100)


_fewer_full_collections()


def _heap_top_kept_mapped() -> None:
    """glibc's ``malloc`` keeps 256 MB of free memory at the top of each heap (``M_TOP_PAD``) instead of
    128 KB: the compiles and kernel runs of a test allocate and free their temporaries by the megabyte,
    and each time a heap shrank past its top and grew again the kernel zero-filled its pages anew (a
    minor page fault per 4 KB page).  Pages never touched stay unmapped, so the process's resident
    memory does not grow.  The suite's subprocesses inherit it through ``MALLOC_TOP_PAD_``; a pad the
    caller set there is kept (glibc read it at start-up).  Without glibc's ``mallopt`` nothing changes.
    NOTE: 2-core CPU box, ``/usr/bin/time python -m pytest -q -p no:cacheprovider
    tests/frontend/test_spellings.py tests/match/test_corpus.py tests/e2e/test_empty_batch.py``: 1.57
    million minor page faults, 4.4 s of system time before; 178 thousand, 1.3 s after; 561 and 564 MB
    resident at most."""
    if "MALLOC_TOP_PAD_" in os.environ:
        return
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    pad = 256 << 20
    m_top_pad = -2  # glibc's malloc.h
    if mallopt(m_top_pad, pad) == 1:
        os.environ["MALLOC_TOP_PAD_"] = str(pad)


_heap_top_kept_mapped()

def _kernel_device() -> str:
    """``"cuda"`` where ``torch.cuda.is_available()``, else ``"cpu"``.  A torch built without CUDA or ROCm
    says so in its ``version.py`` (``cuda`` and ``hip`` are ``None``), read here without importing torch
    (the xdist controller need not: ``pytest_configure``); any other build is asked."""
    import ast
    import importlib.util
    from pathlib import Path

    try:
        version = Path(importlib.util.find_spec("torch").origin).with_name("version.py")
        names = {}
        for node in ast.parse(version.read_text()).body:
            if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Constant):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Name):
                        names[target.id] = node.value.value
        if names.get("cuda", "") is None and names.get("hip", "") is None:
            return "cpu"
    except (AttributeError, OSError, SyntaxError, ValueError):
        pass
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


#: Device on which Triton kernels run in this session: CUDA, or CPU under the interpreter.
KERNEL_DEVICE = _kernel_device()

if KERNEL_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
# No tile search and no fused-vs-library timing in tests (each new shape would cost seconds of
# autotuning on a GPU; the whole suite timed out on the H100 with it on).  Tests that exercise
# those paths set the variable themselves.
os.environ.setdefault("FUSION_CONV_AUTOTUNE", "0")
# Every matched region is rewritten (no timing against Inductor, which on CPU would keep every region
# with Inductor): the suite tests the rewrites.  The decision's own tests set the policy themselves.
os.environ.setdefault("FUSION_DECIDE", "fuse")

import pytest  # noqa: E402

torch = None  # the module, imported by ``_set_up_torch`` (not in the xdist controller, which runs no test)


def _inductor_set_up_for_the_cpu() -> None:
    """Inductor's configuration for a suite without CUDA."""
    # Inductor's CPU code without SIMD vectorization: the suite checks what the backend hands Inductor
    # and what comes back, not the speed of Inductor's CPU kernels, and scalar C++ compiles faster (the
    # CPU suite compiles hundreds of graphs with cold caches on a fresh machine).  NOTE: 2-core CPU box,
    # empty Inductor cache, ``pytest -n 2 tests/e2e/test_e2e_conv_epilogue.py
    # tests/e2e/test_e2e_conv_global_mean.py``: 62 s with vectorization, 53 s without.
    import torch._inductor.config as _inductor_config

    _inductor_config.cpp.simdlen = 1
    # Nor a probe of the CPU's vector instruction sets: without vectorization it is not needed, and
    # with cold caches each process pays it (a C++ test program compiled per instruction set).
    # NOTE: 2-core CPU box, empty Inductor cache, ``pytest -n 2 tests/e2e/test_e2e_conv_epilogue.py
    # tests/e2e/test_e2e_conv_batch_norm.py``: 52-55 s with the probe, 50 s without.  The environment
    # variable reaches the suite's subprocesses too.
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
    _inductor_config.cpp.vec_isa_ok = os.environ["TORCHINDUCTOR_VEC_ISA_OK"] == "1"
    # Nor a pool of compile worker processes per test process: the suite's two xdist workers keep both
    # cores busy already, and each pool's workers import torch before compiling anything.  NOTE: 2-core
    # CPU box, empty Inductor cache, ``pytest -n 2 tests/e2e/test_e2e_conv_epilogue.py
    # tests/e2e/test_e2e_conv_batch_norm.py tests/e2e/test_decision.py``: 78.6 s with Inductor's
    # default (two compile threads), 73.0 s with one.  Tests of the worker pool set up their own.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    _inductor_config.compile_threads = int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])


def _cpu_kernels_compiled_at_o0() -> None:
    """Inductor's C++ kernels (and their precompiled header) are compiled with ``-O0``, not ``-O3``:
    scalar code (``simdlen = 1`` above), no fast-math and ``-ffp-contract=off`` at either level, so the
    operations run as written, the same results, from a shorter compile; the suite's shapes are small,
    so the slower code costs nothing that shows.  NOTE: 2-core CPU box, one of the suite's kernels with
    the precompiled header: 1.3 s of CPU at ``-O3``, 1.1 s at ``-O1``, some hundred kernels a run; empty
    Inductor and Triton caches, ``pytest -n 2 tests/e2e/test_network_blocks.py -k block_of_a_network``:
    79.1 s at ``-O1``, 65.5 s at ``-O0``.  An Inductor without ``cpp_builder._get_optimization_cflags``
    keeps its own flags."""
    try:
        from torch._inductor import cpp_builder
    except ImportError:
        return
    optimization_cflags = getattr(cpp_builder, "_get_optimization_cflags", None)
    if optimization_cflags is None:
        return

    def at_o0(*args, **kwargs):
        cflags, ldflags = optimization_cflags(*args, **kwargs)
        return ["O0" if flag == "O3" else flag for flag in cflags], ldflags

    cpp_builder._get_optimization_cflags = at_o0


def _language_patched_once_per_launch() -> None:
    """Under Triton's interpreter, ``triton.language`` is patched once per kernel launch, not again at
    every ``@triton.jit`` helper the kernel calls.

    The interpreter swaps ``triton.language``'s builtins for its own at each launch and restores them
    after; a device-function call patches them again (``inspect.getmembers`` over the language
    modules) and never restores that patch.  Where the launch's patch is in place the second one
    changes nothing, so ``_patch_lang`` then returns a scope with nothing to restore.  NOTE: it was
    half of the interpreter's time in
    ``tests/e2e/test_direct.py::test_convt3d_pipeline_runs_directly_and_matches_eager`` (26.4 of
    53.3 s: ``python -m cProfile -m pytest ...``, Triton 3.9).  A Triton whose interpreter is laid
    out otherwise keeps its own behaviour."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_lang = getattr(interpreter, "_patch_lang", None)
    if patch_lang is None:
        return

    def patched(lang) -> bool:  # a launch's patch replaces every builtin, ``load`` among them
        load = getattr(lang, "load", None)
        return load is not None and not tl.core.is_builtin(load)

    class Unchanged:
        def restore(self) -> None:
            pass

    langs_of: dict = {}  # the function -> the language modules its globals see (what the patch covers)

    def patch_unless_patched(fn):
        langs = langs_of.get(fn)
        if langs is None:
            langs = langs_of[fn] = [v for v in fn.__globals__.values() if v is tl or v is tl.core]
        if langs and all(patched(lang) for lang in langs):
            return Unchanged()
        return patch_lang(fn)

    interpreter._patch_lang = patch_unless_patched


def _builtins_called_without_their_check() -> None:
    """Under Triton's interpreter, a ``triton.language`` builtin patched for a launch calls the builtin's
    own function, not the wrapper that checks it was given ``_semantic``: the patch always gives it.

    Every ``tl.*`` call and tensor operator of every program instance went through the patch's lambda
    (a dict comprehension that drops any ``_semantic``, then the interpreter's semantic added) and the
    ``@builtin`` wrapper (the check, then the function).  Only a member whose code is that wrapper's is
    unwrapped; any other member is called as before.  NOTE: the six
    ``test_max_pooled_gradient_matches_aten_fp32`` cases of ``tests/kernels/test_conv_fused_bwd.py``
    called six times over in one process, each way in turn (process time, Triton 3.9): best 1.39 s
    through the wrapper, 1.32 s without.  A Triton whose interpreter is laid out otherwise keeps its own."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_attr = getattr(interpreter, "_patch_attr", None)
    semantic = getattr(interpreter, "interpreter_semantic", None)
    make_builtin = getattr(tl.core, "builtin", None)
    if patch_attr is None or semantic is None or make_builtin is None:
        return
    checking = make_builtin(lambda: None).__code__  # the code of every builtin's wrapper

    def patch_without_the_check(obj, name, member, builder, scope):
        function = getattr(member, "__wrapped__", None)
        if getattr(member, "__code__", None) is not checking or function is None:
            return patch_attr(obj, name, member, builder, scope)

        def patched(*args, **kwargs):
            kwargs["_semantic"] = semantic
            return function(*args, **kwargs)

        scope.set_attr(obj, name, patched)

    interpreter._patch_attr = patch_without_the_check


def _integer_ops_unchecked() -> None:
    """Under Triton's interpreter, integer ``+``, ``-`` and ``*`` are not checked for int32 overflow.

    The interpreter checks every one (its options' ``sanitize_overflow``: each op done again in int64
    and compared with the int32 bounds, an assert); a GPU build compiles no such check.  NOTE: without
    the check ``tests/kernels/test_conv_fused_bwd.py::test_max_pooled_gradient_matches_aten_fp32[convT3d_s2]``
    runs 3.3 s instead of 6.7 (``pytest --durations=1 ...``, Triton 3.9).  The sizes that need int64
    offsets are tested by forcing the int64 path (``_needs_int64``)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is not None and getattr(options, "sanitize_overflow", False):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


def _numpy_dtypes_looked_up_once() -> None:
    """Under Triton's interpreter, the numpy dtype that stores a Triton type is worked out once per type.

    ``interpreter._get_np_dtype`` builds its table of every Triton type at each call, and the
    interpreter calls it for every value it creates (each load, splat, constant and cast of every
    program instance).  The answer depends on the type alone, which its ``name`` spells out in full
    (a block type's names its shape and element type, a pointer's its pointee).  NOTE: it was 6.9 of
    104 s of ``python -m cProfile -m pytest tests/kernels/test_conv_phase_aligned_bwd.py`` (Triton 3.9)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    work_out = getattr(interpreter, "_get_np_dtype", None)
    if work_out is None:
        return
    known: dict = {}

    def looked_up(tt_dtype):
        name = getattr(tt_dtype, "name", None)
        if not isinstance(name, str):
            return work_out(tt_dtype)
        np_dtype = known.get(name)
        if np_dtype is None:
            np_dtype = known[name] = work_out(tt_dtype)
        return np_dtype

    interpreter._get_np_dtype = looked_up


def _block_shapes_built_once() -> None:
    """Under Triton's interpreter, a block type's shape and a ``tl.tensor``'s shape are built once per
    block shape, not again for every value.

    The interpreter makes a ``tl.tensor`` and a ``block_type`` for every value of every program
    instance.  The block type's constructor unwraps, checks and copies its shape into a ``tl.tuple``
    each time, and the tensor's builds a ``constexpr`` and its type per dim and a ``tl.tuple`` of them
    with the tuple's type.  Those depend on the shape alone (ints), and nothing changes them once made,
    so types and tensors of one shape share them; a shape seen for the first time goes through
    Triton's own checks.  NOTE: the two constructors were 38 of the interpreter's 100 s in ``python -m
    cProfile -m pytest tests/kernels/test_conv_fused_bwd.py -k max_pooled_gradient_matches_aten_fp32``
    (Triton 3.9); ``time python -m pytest -q -p no:cacheprovider`` over the same tests on the 2-core
    CPU box: user 22.4 s before, 15.0-15.4 s after (the process's start-up included).  A shape made
    here is found again by identity before its ints are read (``with_element_ty`` and every tensor of a
    block type pass one on): see ``_matching_operands_taken_as_they_are`` for what the two save
    together.  A Triton whose types are laid out otherwise keeps its own constructors."""
    try:
        import triton.language.core as core
    except ImportError:
        return
    block_type, tensor, tl_tuple = (getattr(core, name, None) for name in ("block_type", "tensor", "tuple"))
    if block_type is None or tensor is None or tl_tuple is None:
        return
    if not {"element_ty", "shape", "numel", "name"} <= set(block_type.__init__.__code__.co_names):
        return
    if not {"handle", "shape", "numel", "type", "dtype"} <= set(tensor.__init__.__code__.co_names):
        return
    import math

    block_init = block_type.__init__
    blocks: dict = {}  # shape (ints) -> the block type's shape, numel and the start of its name
    made: dict = {}  # id of a shape made here -> the same entry (``with_element_ty`` passes one on)

    def int_shape(shape) -> tuple | None:
        values = shape.values if isinstance(shape, tl_tuple) else shape
        if not isinstance(values, list | tuple) or not all(type(d) is int for d in values):
            return None
        return tuple(values)

    def init_block(self, element_ty, shape) -> None:
        known = made.get(id(shape))
        if known is None or known[0] is not shape:  # the shapes made here live as long as ``blocks``
            key = int_shape(shape)
            if key is None:
                block_init(self, element_ty, shape)
                return
            known = blocks.get(key)
            if known is None:
                block_init(self, element_ty, list(key))  # raises where Triton rejects the shape
                known = blocks[key] = made[id(self.shape)] = (self.shape, self.numel, f"<{self.shape}, ")
        self.element_ty = element_ty
        self.shape, self.numel, name = known
        self.name = f"{name}{element_ty}>"

    tensors: dict = {}  # shape (ints) -> a tensor's numel and shape (constexprs)
    tensors_of: dict = {}  # id of a block type's shape made here -> (that shape, the tensor's entry)
    scalar = (core.constexpr(1), tl_tuple([]))

    def init_tensor(self, handle, type) -> None:  # noqa: A002 (Triton's name)
        self.handle = handle
        self.type = type
        self.dtype = type.scalar
        if not type.is_block():
            self.numel, self.shape = scalar
            return
        shape = type.shape
        of = tensors_of.get(id(shape))
        if of is not None and of[0] is shape:
            self.numel, self.shape = of[1]
            return
        key = tuple(shape)
        known = tensors.get(key)
        if known is None:
            known = tensors[key] = (core.constexpr(math.prod(key)), tl_tuple([core.constexpr(d) for d in key]))
        if made.get(id(shape), (None,))[0] is shape:
            tensors_of[id(shape)] = (shape, known)
        self.numel, self.shape = known

    block_type.__init__ = init_block
    tensor.__init__ = init_tensor



def _matching_operands_taken_as_they_are() -> None:
    """Under Triton's interpreter, a binary op whose operands already agree (one dtype that is its own
    computation type, one block shape or none) takes them as they are without Triton's type checks,
    and the computation type of two types is worked out once per pair.

    ``binary_op_type_checking_impl`` works out the operands' computation type, casts each to it and
    broadcasts them to one shape; where the dtypes already agree and the shapes are one (the block
    shapes ``_block_shapes_built_once`` shares) each of those steps gives back its operand, and the
    function returns them unchanged, at some 50 us an op for every op of every program instance.  Two
    such operands of two shapes (a block and a scalar, or blocks that broadcast) skip the casts, which would
    give them back, and are only broadcast; a tensor and a Python int or float whose computation type
    is the tensor's dtype skip the tensor's cast, and the number becomes a constant of that dtype
    through Triton's own ``_cast_to_computation_type`` (its range checks included).  Any other pair (a
    pointer, two dtypes, a bool) goes through Triton's checks.  A scalar broadcast against a block of
    its own dtype is splat to that block's type as it is, not to a new one made for it (twice: the
    block type, then its IR type, which under the interpreter is a block type again).
    ``tests/kernels/test_interpreter_shortcuts.py`` compares every pair of a grid with Triton's
    functions.  NOTE: ``OMP_NUM_THREADS=1 time python -m pytest -q -p
    no:cacheprovider tests/kernels/test_conv_fused_bwd.py tests/kernels/test_conv_family_backward.py``
    on the 2-core CPU box (Triton 3.9), 3-4 runs each: user 48-54 s before, 42-47 s with this alone,
    36-38 s with this and the identity lookups of ``_block_shapes_built_once``.  The two-shape and
    Python-number pairs: the six ``test_max_pooled_gradient_matches_aten_fp32`` cases of
    ``tests/kernels/test_conv_fused_bwd.py`` called six times over in one process, each way in turn
    (process time): best 1.54 s through Triton's checks, 1.44 s without; the splat, the same way: 1.27 s
    with the new types, 1.18 s without.  A Triton whose semantic layer is laid out otherwise keeps its
    own."""
    try:
        from triton.language.semantic import TritonSemantic
    except ImportError:
        return
    checked = getattr(TritonSemantic, "binary_op_type_checking_impl", None)
    work_out = getattr(TritonSemantic, "computation_type_impl", None)
    broadcast = getattr(TritonSemantic, "broadcast_impl_value", None)
    if checked is None or work_out is None or broadcast is None:
        return
    if not {"computation_type_impl", "_cast_to_computation_type", "broadcast_impl_value"} <= set(
            checked.__code__.co_names):
        return
    from triton.language.core import tensor

    try:
        from triton.runtime.interpreter import interpreter_builder
    except ImportError:
        interpreter_builder = object()  # never a semantic's builder: every splat is Triton's

    types: dict = {}  # (type names, which is a number, div or mod) -> the computation type

    def computation_type(self, a_ty, a_is_scalar, b_ty, b_is_scalar, div_or_mod):
        key = (a_ty.name, a_is_scalar, b_ty.name, b_is_scalar, div_or_mod)
        found = types.get(key)
        if found is None:  # raises where Triton refuses the pair
            found = types[key] = work_out(self, a_ty, a_is_scalar, b_ty, b_is_scalar, div_or_mod)
        return found

    def type_checked(self, lhs, rhs, allow_lhs_ptr=False, allow_rhs_ptr=False, arithmetic_check=True,
                     div_or_mod=False):
        lhs_tensor, rhs_tensor = isinstance(lhs, tensor), isinstance(rhs, tensor)
        if lhs_tensor and rhs_tensor:  # no Python number among them
            dtype = lhs.dtype
            if dtype.name == rhs.dtype.name and not dtype.is_ptr() and (
                    not arithmetic_check
                    or computation_type(self, dtype, False, dtype, False, div_or_mod).name == dtype.name):
                if getattr(lhs.type, "shape", None) is getattr(rhs.type, "shape", None):
                    return lhs, rhs
                return self.broadcast_impl_value(lhs, rhs)  # Triton's casts would hand both back
        elif arithmetic_check and (lhs_tensor or rhs_tensor):
            value, number = (lhs, rhs) if lhs_tensor else (rhs, lhs)
            dtype = value.dtype
            if type(number) in (int, float) and not dtype.is_ptr():
                number_ty = self.to_tensor_type(number)
                ret = (computation_type(self, dtype, False, number_ty, True, div_or_mod) if lhs_tensor
                       else computation_type(self, number_ty, True, dtype, False, div_or_mod))
                if ret.name == dtype.name:  # the tensor's cast hands it back
                    number = self._cast_to_computation_type(number, ret)
                    return self.broadcast_impl_value(*((value, number) if lhs_tensor else (number, value)))
        return checked(self, lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)

    def broadcast_value(self, lhs, rhs):
        lhs_ty, rhs_ty = lhs.type, rhs.type
        lhs_shape, rhs_shape = getattr(lhs_ty, "shape", None), getattr(rhs_ty, "shape", None)
        if lhs_shape is rhs_shape:
            return lhs, rhs  # one block shape, or two scalars
        if self.builder is interpreter_builder:  # a scalar of a block's dtype: splat to that block's type
            if rhs_shape is None and rhs_ty.name == lhs_ty.scalar.name:
                return lhs, self.make_tensor(self.builder.create_splat(lhs_ty, rhs.handle), lhs_ty)
            if lhs_shape is None and lhs_ty.name == rhs_ty.scalar.name:
                return self.make_tensor(self.builder.create_splat(rhs_ty, lhs.handle), rhs_ty), rhs
        return broadcast(self, lhs, rhs)

    # Triton's own functions stay reachable: ``tests/kernels/test_interpreter_shortcuts.py`` compares them.
    computation_type.__wrapped__ = work_out
    type_checked.__wrapped__ = checked
    broadcast_value.__wrapped__ = broadcast
    TritonSemantic.computation_type_impl = computation_type
    TritonSemantic.binary_op_type_checking_impl = type_checked
    TritonSemantic.broadcast_impl_value = broadcast_value


def _set_up_torch() -> None:
    """Imports torch (the module's ``torch``) and sets up Inductor and Triton's interpreter for the tests."""
    global torch
    import torch

    if KERNEL_DEVICE == "cpu":
        _inductor_set_up_for_the_cpu()
        _cpu_kernels_compiled_at_o0()
    if os.environ.get("TRITON_INTERPRET") == "1":
        _language_patched_once_per_launch()
        _builtins_called_without_their_check()
        _integer_ops_unchecked()
        _numpy_dtypes_looked_up_once()
        _block_shapes_built_once()
        _matching_operands_taken_as_they_are()


@pytest.hookimpl(trylast=True)  # after xdist's own hook has made this process its controller, or not
def pytest_configure(config):
    """Torch and what the tests need of it are set up in every process that collects tests: not in the
    xdist controller (``dsession``), which only hands them out.  NOTE: it spent 6.1 s importing torch,
    Dynamo and Inductor before it started the workers; it starts them 2.6 s after its own start without
    (2-core CPU box, ``pytest -n 2``, the time to ``pytest_configure``)."""
    if not config.pluginmanager.hasplugin("dsession"):
        _set_up_torch()
    _one_last_collection(config)


def _one_last_collection(config) -> None:
    """At the end of the session pytest collects the garbage once, not five times, before it reports
    the exceptions raised in finalizers (its ``unraisableexception`` plugin; those are warnings, not
    failures).  NOTE: each full collection of a test process's heap takes about 0.5 s at the end of
    the suite (2-core CPU box), in both xdist workers just before the session ends."""
    try:
        from _pytest.unraisableexception import gc_collect_iterations_key
    except ImportError:
        return
    config.stash[gc_collect_iterations_key] = 1


def pytest_collection_finish(session) -> None:
    """Once the tests are collected, the objects made so far (the modules of torch, Dynamo, Inductor,
    Triton, the package and the tests: some 300 thousand) are moved out of the garbage collector's
    sight (``gc.freeze``): they live as long as the process, and every full collection of the session
    would otherwise go over them again.  Only what exists at this point is frozen, not what a test
    makes; at the end of the session it is unfrozen, so that the interpreter's last collections free
    it (left frozen, Triton's nanobind bindings report their functions and types as leaked at exit).
    NOTE: 2-core CPU box, full suite under xdist (``gc.callbacks`` timing every collection): the full
    collections of the two workers (21 and 10) took 8.0 and 5.4 s before, 2.9 and 2.8 s after."""
    import gc

    if hasattr(gc, "freeze"):
        gc.freeze()
        session.config.add_cleanup(gc.unfreeze)


@pytest.fixture
def kernel_device() -> str:
    """Device on which Triton kernels run in this session: CUDA, or CPU under the interpreter."""
    return KERNEL_DEVICE


@pytest.fixture
def triton_kernels(monkeypatch) -> None:
    """A kernel module's own test: its Triton kernel runs, on CUDA, or on CPU tensors under the
    interpreter (``FUSION_CPU_KERNELS=triton``; skipped where ``TRITON_INTERPRET=1`` is not set)."""
    if KERNEL_DEVICE == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton kernel on CPU tensors needs TRITON_INTERPRET=1")
        monkeypatch.setenv("FUSION_CPU_KERNELS", "triton")


@pytest.fixture(params=["reference", "triton"] if KERNEL_DEVICE == "cpu" else ["cuda"])
def kernels(request, monkeypatch) -> str:
    """Which implementation of a fused op runs: the CPU reference, the Triton kernels on CPU under
    the interpreter (``FUSION_CPU_KERNELS=triton``), or, with CUDA, the Triton kernels on the GPU."""
    if request.param == "triton":
        monkeypatch.setenv("FUSION_CPU_KERNELS", "triton")
    return request.param


@pytest.fixture
def failing_kernels(monkeypatch, kernel_device):
    """A fused op's failure-policy test: its Triton path even on CPU (under the interpreter), and a
    function ``(module, *names)`` that makes those launchers of a kernels module raise
    ``RuntimeError("simulated launch failure")``."""
    if kernel_device == "cpu":
        monkeypatch.setenv("FUSION_CPU_KERNELS", "triton")

    def broken(*args, **kwargs):
        raise RuntimeError("simulated launch failure")

    def fail(module, *names: str) -> None:
        for name in names:
            monkeypatch.setattr(module, name, broken)

    return fail


@pytest.fixture
def exact_fp32():
    """TF32 off for the test (fp32 parity at 1e-5 needs it; the fused kernels follow the same flags)."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture
def family_launches(monkeypatch, exact_fp32, fresh_plans):
    """The Triton paths on CPU under the interpreter (``FUSION_CPU_KERNELS=triton``), TF32 off and no
    call plan kept; the list of the keyword arguments of every conv-family launch plan made
    (``kernels.conv.fprop_plan``): what a test asserts the family's forward ran with."""
    import fusion_backend.kernels.conv as conv_family

    monkeypatch.setenv("FUSION_CPU_KERNELS", "triton")
    calls = []
    real = conv_family.fprop_plan

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(conv_family, "fprop_plan", recording)
    return calls


@pytest.fixture
def fake_impl_timer(monkeypatch, tmp_path):
    """``impl_choice.choose`` measuring under ``FUSION_CONV_IMPL=auto`` (answers kept under ``tmp_path``,
    none kept in memory past the test) with a fake timer; yields ``(times, timed)``: the time each
    candidate reports, by name, and the names timed, per ``choose`` call.  A candidate's probe is
    named ``"<name> (probe)"`` and reports the candidate's time unless ``times`` names it."""
    from fusion_backend import environment, impl_choice

    monkeypatch.setenv(impl_choice.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(impl_choice.MEASURE_ENV, "1")
    monkeypatch.setenv(environment.CONV_IMPL, "auto")
    impl_choice.forget_in_memory()
    times: dict[str, float] = {}
    timed: list[list[str]] = []
    real_choose = impl_choice.choose

    def choose(key, candidates, default, **kwargs):
        names = {id(fn): name for name, fn in candidates.items()}
        names.update({id(fn): f"{name} (probe)" for name, fn in (kwargs.get("probes") or {}).items()})
        timed.append([])

        def timer(fn):
            fn()
            name = names[id(fn)]
            timed[-1].append(name)
            return times.get(name, times.get(name.removesuffix(" (probe)")))

        return real_choose(key, candidates, default, timer=timer, **kwargs)

    monkeypatch.setattr(impl_choice, "choose", choose)
    yield times, timed
    impl_choice.forget_in_memory()  # answers given by the fake timer stay with this test


@pytest.fixture
def family_forward(monkeypatch, family_launches):
    """``family_launches`` with the conv family's forward forced (``FUSION_CONV_IMPL=family``)."""
    from fusion_backend import environment

    monkeypatch.setenv(environment.CONV_IMPL, "family")
    return family_launches


@pytest.fixture
def fresh_plans():
    """No fused-op call plan kept from another test, and none left behind: a test that sets an
    environment switch makes its calls plan again (``fusion_backend.testing.forget_call_plans``)."""
    from fusion_backend.testing import forget_call_plans

    forget_call_plans()
    yield
    forget_call_plans()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _seeded_per_test(request):
    """Torch's generator seeded from the test's own id: its random inputs are the same whichever tests
    ran before it in its worker (under ``pytest -n`` that order changes from run to run), so a failure
    reproduces with the test alone."""
    from fusion_backend.testing import stable_seed

    torch.manual_seed(stable_seed(request.node.nodeid))



#: The suite's sm_90 compile checks, ``tools/compile_check.py`` job -> its cases (each test that reads
#: a job says why those cases): ``tests/kernels/test_conv_family_sm90.py``,
#: ``tests/kernels/test_epilogue_kernels.py`` and ``tests/ops/test_conv_global_mean_op.py``.
SM90_COMPILE_CASES = {
    "conv_family": ("resnet_3x3-bf16-hooked", "resnet_stem-fp32-hooked", "resnet_3x3-bf16-hooked-box"),
    "conv_halo": ("resnet_3x3-bf16-hooked", "depthwise_s1-bf16-hooked"),
    "conv_tma": ("resnet_1x1-bf16", "resnet_1x1-bf16-hooked", "resnet_1x1_s2-bf16-hooked"),
    "conv_tma_wgrad": ("resnet_1x1-bf16-hooked", "resnet_3x3-bf16", "resnet_3x3-bf16-hooked"),
    "epilogue": ("none-fp32", "max-bf16", "avg-fp32"),
    "global_mean": ("convt2d-fp32", "convt2d-bf16-cl", "conv2d_padded-fp32-cl"),
}


def _once_per_session(tmp_path_factory, name: str, produce) -> dict:
    """``produce()``'s JSON-able result, computed once per session: the first process to ask computes it
    under a lock in the session's temporary folder, which every xdist worker shares; the others read
    what it wrote."""
    import json

    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the session's, not older ones'
    output = shared / f"{name}.json"
    with FileLock(str(output) + ".lock"):
        if not output.exists():
            output.write_text(json.dumps(produce()))
    return json.loads(output.read_text())


def _run_python(args: list[str], env: dict, timeout: float) -> dict:
    """A fresh Python process in the repository's root: its exit status, stdout and stderr."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=root,
                          timeout=timeout)  # fmt: skip
    return {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}


@pytest.fixture(scope="session")
def sm90_compile_check(fresh_process_checks):
    """``sm90_compile_check(job)`` -> what ``tools/compile_check.py`` printed for that job of
    ``SM90_COMPILE_CASES`` (its summary line says ``JOB: all kernels compiled without spills`` where
    every compile of the job passed); where it does not say so, the error or the process's stderr
    follows.

    Every job's cases are compiled once per session, in the suite's second fresh process
    (``fresh_process_checks``: without ``TRITON_INTERPRET``), after its other checks: each process
    costs seconds of start-up (torch, Triton's NVIDIA backend) before it compiles anything.  NOTE:
    2-core CPU box, cold Triton cache: the three jobs as three processes 59 s of CPU, as one 40 s
    (``time python tools/compile_check.py conv_family epilogue global_mean --cases conv_family:...``)."""
    second = fresh_process_checks["second"]
    run = second["results"].get("compile_check", {})

    def job_output(job: str) -> str:
        lines, inside = [], False
        for line in run.get("stdout", "").splitlines():
            if line.startswith("== "):
                inside = line.startswith(f"== {job}: ")
            if inside:
                lines.append(line)
        text = "\n".join(lines)
        if f"\n{job}: all kernels compiled without spills" not in text:
            text += (f"\n(compile_check returned {run.get('returncode')}; {run.get('error', 'no error')}; the "
                     f"process's exit status {second['returncode']}, stderr:)\n{second['stderr'][-4000:]}")
        return text

    return job_output


@pytest.fixture(scope="session")
def fresh_process_checks(tmp_path_factory) -> dict:
    """What ``tests/fresh_process_checks.py`` found in its two fresh processes, run one after the other
    once per session (``_once_per_session``), both started without ``TRITON_INTERPRET``, with
    ``FUSION_CPU_KERNELS=triton`` and with the same fresh Inductor and decision caches: under
    ``"first"`` and ``"second"``, each process's exit status, stderr and, under ``results``, its JSON
    (each check's, or its ``error``).  The second process also runs the sm_90 compile checks
    (``sm90_compile_check``).

    Two processes for the checks that need one of their own (the first must not have imported the
    package; the second finds the first's graph in AOTAutograd's cache): each process costs seconds
    of start-up (Python, torch, Dynamo, Inductor, Triton, the package) before it checks anything.
    NOTE: 2-core CPU box, cold caches (``/usr/bin/time python ...`` of each process): the four
    processes these checks ran in before took 33 s of CPU (the compile checks' 19.1 s, the other fresh
    checks' 3.5 s, the entry point's two 5.2 and 4.8 s), these two 24 s (5.4 and 18.9 s)."""
    import json

    def run_checks() -> dict:
        caches = tmp_path_factory.mktemp("fresh_process_caches")
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(FUSION_CPU_KERNELS="triton", TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
                   FUSION_CACHE_DIR=str(caches / "fusion"))  # fmt: skip
        cases = ",".join(f"{job}:{case}" for job, job_cases in SM90_COMPILE_CASES.items() for case in job_cases)
        compile_check = ["--", *SM90_COMPILE_CASES, "--cases", cases]
        runs = {}
        for name, args, timeout in (("first", ["--first"], 300), ("second", compile_check, 900)):
            proc = _run_python(["tests/fresh_process_checks.py", *args], env, timeout=timeout)
            lines = proc["stdout"].strip().splitlines()
            try:
                proc["results"] = json.loads(lines[-1])
            except (IndexError, ValueError):
                proc["results"] = {}
            runs[name] = proc
        return runs

    return _once_per_session(tmp_path_factory, "fresh_process_checks", run_checks)


def load_demo_module(suite: str, name: str):
    """The module of ``demos/<suite>/<name>.py``, registered in ``sys.modules`` (Dynamo looks classes
    up through their module)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "demos" / suite / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"fusion_test_{suite}.{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def demo_model():
    """``demo_model(suite, name)`` → the model of ``demos/<suite>/<name>.py`` (seeded, on CPU), without
    building its inputs (the ``families`` suite's are full size)."""

    def build(suite: str, name: str):
        module = load_demo_module(suite, name)
        torch.manual_seed(0)
        return module.Model(*module.get_init_inputs())

    return build


@pytest.fixture
def seed_models():
    """``seed_models(name, shrink=False)`` → (model, inputs) of ``demos/seeds/<name>.py``.

    ``shrink=True`` cuts batch and spatial sizes so the model traces and runs quickly on CPU while
    keeping every hyper-parameter (channels, kernel, stride...) as written.
    """
    def load(name: str, shrink: bool = False):
        module = load_demo_module("seeds", name)
        torch.manual_seed(0)
        model = module.Model(*module.get_init_inputs())
        inputs = module.get_inputs()
        if shrink:
            inputs = [t[(slice(0, 2), slice(None), *(slice(0, 6) for _ in t.shape[2:]))].contiguous() for t in inputs]
        return model, inputs

    return load


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups into the node ids
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist with ``--dist loadgroup`` (tools/gpu_session.sh), every ``gpu``-marked
    test (the ``seeds`` suite's full-size models, up to ~30 GB of GPU memory each) runs on one
    worker, one after the other: four at once ran an 80 GB H100 out of memory.  Without xdist the
    marker does nothing."""
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.xdist_group("gpu_full_size"))
    # The ``heavy`` tests first (a stable sort: the rest keep their order): under xdist, a worker that
    # draws one of them near the end would run it alone while the other waits.
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)
