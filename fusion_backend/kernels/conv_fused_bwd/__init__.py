"""Triton implicit-GEMM backward of a convolution whose output gradient is never materialised.

WHY: ``conv_epilogue``'s backward used to write the FULL-SIZE gradient ``g`` of the conv output and
hand it to ``aten.convolution_backward``.  Behind a 2x2x2 max pool (the ConvT3d pipeline) 7/8 of that
tensor are zeros, and writing + re-reading it costs more than the GEMMs.  The kernels here read ``g``
through a loader that computes it on the fly from one of two implicit forms:

* **dense** (form a): ``g`` is a tensor of the conv-output shape (no pool; any strides);
* **max-pooled** (form b): ``PooledGrad(g_win, winner, pool geometry)``: ``g_win`` (pooled shape) is
  the gradient at each window's winner (``grad_out * chain'(y0_winner)``), ``winner`` the winner's
  row-major index inside its window (int8/int32, the format ``epilogue_forward`` saves).  Then
  ``g[n, c, o] = sum over windows j containing o with winner[n, c, j] == offset of o in j of
  g_win[n, c, j]`` (overlapping windows are summed, exactly like ``ops/conv_epilogue/reference.scatter_to_windows``).
* An avg pool (form c) is NOT offered: ``g`` at ``o`` is ``sum_j grad[j] / div_j * chain'(y0[o])``,
  so the loader would need the full-size saved ``y0`` and the whole pointwise-chain derivative
  template (op codes, operand matrix) of ``kernels/epilogue.py`` inside the GEMM loops.  Use the
  dense form after the epilogue's backward kernel there.

Public launchers (they know only tensors; see each docstring for the exact contract):

* ``convolution_backward(grad, x, weight, stride, padding, dilation, transposed, output_padding,
  groups, output_mask) -> (grad_x | None, grad_w | None, grad_b | None)``: the drop-in for
  ``aten.convolution_backward`` (same argument order, minus ``bias_sizes``).
* ``conv_input_grad(...)``, ``conv_weight_grad(...)``, ``conv_bias_grad(grad)``: the three parts.
* ``unsupported_reason(grad, x, weight, ...) -> str | None``: None when the kernels take the case.

How ``conv_epilogue`` uses them (``ops/conv_epilogue/backward.py``, ``TritonBackward``): with a max
pool, ``g_win`` (pooled shape) is the chain's backward evaluated at the winners only (``y0 =
saved_y0 + bias``) and the gradient goes in as ``PooledGrad(g_win, saved_winner, kernel_size, stride,
padding, ceil_mode=...)`` (the winner index as saved, int8 or int32, any strides); without a pool the
dense conv-output gradient goes in as it is.  The bias gradient comes out of the implicit form
(``sum g == sum g_win``), and nothing of the conv-output size is allocated on this path.

Algorithms (1d/2d/3d all lifted to 3d with singleton leading dims; ``k`` a tap, ``s`` stride, ``p``
padding, ``dl`` dilation; conv: ``x[i]`` feeds ``y0[o]`` when ``i = o*s - p + k*dl``; transposed:
``y0[o]`` gets ``x[i]`` when ``o = i*s - p + k*dl``):

* input grad, transposed conv: ``dx[i] = sum_{co,k} g[i*s - p + k*dl] w[ci, co, k]``: a strided
  gather conv.  Conv: ``dx[i] = sum_{co,k: (i+p-k*dl) % s == 0} g[(i+p-k*dl)/s] w[co, ci, k]``,
  done per phase ``r = i mod s`` (sub-pixel decomposition): a program owns positions of one phase
  and walks only that phase's taps, from a host-built table, so no MAC is wasted on a zero tap.
  GEMM: M = positions, N = x channels (per group), K = (tap, g channel), K = tap-major so that a
  K block of channels-last g is contiguous.
* weight grad: ``dw[a, b, k] = sum_{n,t} A[n, a, t] B[n, b, t*s - p + k*dl]`` with (A, B) = (g, x)
  for a conv and (x, g) for a transposed conv (``a`` always indexes weight dim 0, ``b`` dim 1).
  GEMM per tap: M = a, N = b, K = n x spatial: split into chunks over programs, each writing an fp32
  partial; a second pass sums the partials in a fixed order (``torch.sum`` over a fixed shape): the
  result is bitwise reproducible run to run, no float atomics anywhere.
* bias grad: fp32 ``sum`` of the implicit form over (n, spatial) (``g_win`` for form b).

Tensor cores: ``tl.dot`` with fp32 accumulation; both operands in x's dtype (the gradient is
rounded to it, as aten's conv backward would see a ``grad_y`` of the conv's dtype); fp32 in TF32
iff the caller allows it per gradient (``allow_tf32``: the op layer's answer, where eager's conv
backward computes that gradient in TF32, ``ops/conv_precision.py``; without one,
``torch.backends.cudnn.allow_tf32``), rounded to nearest like cuDNN (``kernels.tf32``), IEEE fp32
under the interpreter.  Any strides
(contiguous or channels-last); grads come back in the layout of ``torch.empty_like`` of their
forward tensor.  Offsets are int32 unless a tensor spans 2**31 elements or more (then int64).

Layout: ``device.py`` holds the Triton kernels, their loader and tiles; ``plan.py`` the host side
(the implicit gradient forms ``PooledGrad`` / ``Grad``, cases served, geometry, tables, launchers).
"""

from .plan import (
    MAX_CANDIDATE_WINDOWS,
    Grad,
    PooledGrad,
    backward_plan,
    conv_bias_grad,
    conv_input_grad,
    conv_output_spatial,
    conv_weight_grad,
    convolution_backward,
    pooled_spatial,
    unsupported_reason,
)

__all__ = [
    "MAX_CANDIDATE_WINDOWS", "Grad", "PooledGrad", "backward_plan", "conv_bias_grad", "conv_input_grad",
    "conv_output_spatial", "conv_weight_grad", "convolution_backward", "pooled_spatial", "unsupported_reason",
]  # fmt: skip
