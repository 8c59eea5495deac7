"""The suite's shortcuts in Triton's interpreter (``tests/conftest.py``) give what Triton's own functions give.

``_matching_operands_taken_as_they_are`` replaces ``TritonSemantic.binary_op_type_checking_impl``,
``computation_type_impl`` and ``broadcast_impl_value``: each shortcut may hand back its operands only
where Triton's function hands back those same objects (one dtype that is its own computation type,
one block shape, no pointer), and must otherwise give the same types or the same error.  Every pair of
a grid of operands (dtypes, pointers, scalars, block shapes that match, broadcast or clash, Python
numbers) goes through both, under each set of flags that Triton's ops pass.
"""

import itertools

import numpy as np
import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
TritonSemantic = pytest.importorskip("triton.language.semantic").TritonSemantic

NAMES = ("binary_op_type_checking_impl", "computation_type_impl", "broadcast_impl_value")
SHORTCUTS = {name: getattr(TritonSemantic, name) for name in NAMES}
ORIGINALS = {name: getattr(fn, "__wrapped__", None) for name, fn in SHORTCUTS.items()}

pytestmark = pytest.mark.skipif(
    any(fn is None for fn in ORIGINALS.values()),
    reason="the shortcuts are installed only under Triton's interpreter (TRITON_INTERPRET=1)",
)

DTYPES = (tl.int1, tl.int8, tl.uint8, tl.int32, tl.uint32, tl.int64, tl.float8e5, tl.float16, tl.bfloat16,
          tl.float32, tl.float64)
POINTERS = (tl.pointer_type(tl.float32), tl.pointer_type(tl.float16))
SHAPES = (None, (4,), (1, 4), (2, 4), (8,))
NUMBERS = (1, -1, 2.5, True, 2**40)
#: (allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod): the defaults, ``+``, ``-``, ``/`` and
#: ``%``, and no arithmetic check.
FLAGS = ((False, False, True, False), (True, True, True, False), (True, False, True, False),
         (False, False, True, True), (False, False, False, False))


def _semantic():
    from triton.runtime.interpreter import interpreter_semantic

    return interpreter_semantic


def _operand(dtype, shape):
    from triton.runtime.interpreter import TensorHandle

    np_dtype = np.uint64 if dtype.is_ptr() else np.dtype(_np_name(dtype))
    data = np.zeros(shape or (), dtype=np_dtype)
    ty = dtype if shape is None else tl.block_type(dtype, list(shape))
    return tl.tensor(TensorHandle(data, dtype), ty)


def _np_name(dtype) -> str:
    if dtype.is_int1():
        return "bool"
    if dtype.is_fp8():
        return "uint8"
    if dtype.is_bf16():
        return "uint16"
    return {"fp16": "float16", "fp32": "float32", "fp64": "float64"}.get(dtype.name, dtype.name)


def _operand_grids():
    """Two grids, each compared pair by pair: every dtype as a scalar and at one block shape, with the
    Python numbers (where the dtypes decide), and a few dtypes at every block shape (where the shapes
    decide)."""
    by_dtype = [_operand(dtype, shape) for dtype in DTYPES + POINTERS for shape in SHAPES[:2]] + list(NUMBERS)
    by_shape = [_operand(dtype, shape) for dtype in (tl.int32, tl.float32, POINTERS[0]) for shape in SHAPES]
    # A second tensor of each block shape, of its own block type: the shortcut finds a shape by identity.
    by_shape += [_operand(tl.float32, shape) for shape in SHAPES if shape is not None]
    return by_dtype, by_shape


def _pairs(tensors_only=False):
    for grid in _operand_grids():
        yield from itertools.product([op for op in grid if isinstance(op, tl.tensor) or not tensors_only], repeat=2)


def _outcome(fn, operands, *args):
    """What ``fn`` gives: the error's type, or for each result its type and whether it is the operand."""
    try:
        results = fn(_semantic(), *operands, *args)
    except Exception as e:  # noqa: BLE001 (the same error is what is compared)
        return type(e).__name__
    if not isinstance(results, tuple):
        return str(results)
    return tuple((str(r.type), r is op) for r, op in zip(results, operands, strict=True))


def _by_triton(monkeypatch, fn_name, operands, *args):
    with monkeypatch.context() as m:
        for name, fn in ORIGINALS.items():
            m.setattr(TritonSemantic, name, fn)
        return _outcome(getattr(TritonSemantic, fn_name), operands, *args)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's, casting a number out of a dtype's range
def test_binary_op_type_checking_matches_triton(monkeypatch):
    taken = 0
    for lhs, rhs in _pairs():
        for flags in FLAGS:
            ours = _outcome(SHORTCUTS["binary_op_type_checking_impl"], (lhs, rhs), *flags)
            theirs = _by_triton(monkeypatch, "binary_op_type_checking_impl", (lhs, rhs), *flags)
            assert ours == theirs, (lhs, rhs, flags)
            taken += isinstance(ours, tuple) and all(same for _, same in ours)
    assert taken  # the grid holds pairs that Triton, too, hands back as they are


def test_broadcast_matches_triton(monkeypatch):
    for lhs, rhs in _pairs(tensors_only=True):
        ours = _outcome(SHORTCUTS["broadcast_impl_value"], (lhs, rhs))
        assert ours == _by_triton(monkeypatch, "broadcast_impl_value", (lhs, rhs)), (lhs, rhs)


def test_computation_type_matches_triton(monkeypatch):
    for a, b in itertools.product(DTYPES + POINTERS, repeat=2):
        for a_scalar, b_scalar, div_or_mod in itertools.product((False, True), repeat=3):
            for _ in range(2):  # the second time from the shortcut's table
                ours = _outcome(SHORTCUTS["computation_type_impl"], (a, a_scalar, b, b_scalar, div_or_mod))
                theirs = _by_triton(monkeypatch, "computation_type_impl", (a, a_scalar, b, b_scalar, div_or_mod))
                assert ours == theirs, (a, a_scalar, b, b_scalar, div_or_mod)
