"""What kernels allocate that a dispatch-level trace gets wrong or does not see, each with its evidence.

Outputs sized wrong. The fake trace runs meta kernels. Where a meta kernel returns an output of a different
size than the CPU kernel does, the estimate is wrong by the difference for as long as that output lives.
`fix_fake_outputs` replaces such an output with a fake tensor of the size the CPU kernel really returns, so
lifetime (saved for backward, freed after it) is followed exactly like any other tensor. Real tensors are
never touched.

Workspaces. A kernel may hold memory while it runs beyond the outputs it returns; a dispatch mode sees only
outputs. `CpuWorkspaces` measures what CPU convolutions hold (below), `CudnnWorkspaces` states what a CUDA
target's cuDNN convolutions are assumed to; the tracker counts either at its op and frees it at once.

Entries
-------
aten.mkldnn_rnn_layer (nn.LSTM on CPU: PyTorch runs one oneDNN LSTM primitive per layer and direction)
    The CPU kernel returns the oneDNN training workspace as a uint8 tensor, saved for backward; the meta
    kernel returns an empty one (torch 2.13, torch/_meta_registrations.py). Size: oneDNN's
    `rnn_utils::set_workspace_sizes` + `set_offsets` (src/cpu/rnn/rnn_utils.{hpp,cpp}), for one layer and
    one direction (L = D = 1), T steps, batch mb, input size slc, hidden size dhc, G = 4 gates: seven
    regions, each starting on a 4096-byte page, the total rounded up to a page:
        gates          T * mb * ld(G*dhc)                   * elem     (gates kept in the input dtype)
        ht             T * mb * ld(dhc)                     * elem
        states         2 * (T+1) * mb * ld(max(slc, dhc))   * elem     (layer and iter states share it)
        c states       2 * (T+1) * mb * dhc                 * c_elem   (dtype of cx)
        diff layer     2 * (T+1) * mb * ld(max(slc, dhc))   * 4        (fp32 accumulators)
        diff iter      2 * (T+1) * mb * ld(max(slc, dhc))   * 4
        diff c         2 * (T+1) * mb * dhc                 * 4
    where ld(n) rounds n up to 64 bytes and adds another 64 bytes when the result is a multiple of 256
    elements (oneDNN's `get_good_ld`, against 4K aliasing). Checked against the real kernel's output size
    on 162 shapes (T in 1/7/32, mb in 1/4/5, slc in 16/64/100, dhc in 32/64/96, fp32 and bf16 autocast):
    all exact (tests/test_kernels.py checks a few of them and two whole LSTM training steps against the
    profiler). LSTM is the only RNN PyTorch sends to oneDNN; GRU/RNN run native kernels that fake tensors
    follow exactly.

aten.native_layer_norm, native_group_norm, native_batch_norm (a bf16 / fp16 input with fp32 parameters, as CPU
    autocast leaves norms): the CPU kernel's "mixed type" path saves mean and inverse std in fp32, the meta
    kernel in the input's dtype. Fixed for CPU targets only (CUDA's kernels are not checked here). BiT in bf16
    (group norms over bf16 activations with fp32 weights): 10,240 B low before, exact after.

Convolutions on the CPU (aten.convolution, aten.convolution_backward: oneDNN, or PyTorch's own kernel for
some 1x1 convolutions on one thread), measured, not modelled by a formula. Profiled with torch 2.13 /
oneDNN 3.12 on an AVX-512 CPU: the forward computes into a channel-blocked copy of the output (channels
padded up to 16) and reorders it into the plain output, after reordering the weights (and, for 16 or more
input channels, the input) into blocked copies; the backward does the same for the gradients, and a
depthwise convolution's weight gradient is computed as a grouped convolution's, padded to 16 x 16 channels
per group (256 times the weight's size in fp32), with per-thread reduction buffers on top. Which of
oneDNN's implementations runs (jit, brgemm, gemm, depthwise; nChw16c or nhwc; first-layer kernels for few
input channels) follows the shape, dtype, memory format, ISA and thread count, so each call signature is
run once on this machine instead (`CpuWorkspaces`). Uncounted, the estimate was 14% low on a U-Net and 28%
(fp32) to 54% (bf16) low on a ConvNeXt; counted, both are the profiler's peak to the byte in fp32, the
U-Net within 0.03% and the ConvNeXt within 0.6% in bf16.

Batch norm on the CPU (aten.native_batch_norm and its backward), measured the same way: the backward holds a
buffer the size of its input (contiguous or channels-last; a strided input runs another path without it), the
forward a few bytes per channel. Uncounted, the held-out BiT (whose weight-standardised convolutions batch-norm
every weight) was 1.05% low in bf16; counted, 0.002%.

Matmuls in bf16 / fp16 on the CPU (aten.mm, addmm, bmm, baddbmm: oneDNN's matmul), measured the same way:
an fp32 accumulator and per-thread packing buffers, e.g. ViT in bf16 +128768 B at the peak (the weight
gradient's mm 64x260 @ 260x256), GPT-2 with selective checkpointing in bf16 +175 KB (3.6%). Counted, ViT,
custom_function and gpt_sdpa in bf16 and ViT in bf16-pure are the profiler's peak to the byte. fp32
matmuls run in MKL, whose buffers do not come from PyTorch's allocator (the profiler does not see them
either).

Elementwise binary ops on the CPU (TensorIterator: add, sub, mul, div, maximum, minimum, atan2, pow, comparisons,
where) compute in their inputs' common dtype: an input of another dtype is first copied into it (numel x the
common dtype's size: bf16 beside fp32 in autocast's residual adds, a boolean or integer mask, a 0-d tensor of
another dtype), and an in-place op on a tensor of another dtype computes into a temporary of the common dtype;
all freed on return (`PROMOTING_BINARY`). CUDA kernels cast as they read, with no copy. Profiled on 21 cases:
exact. Counted, nn.TransformerEncoder in bf16 with checkpointing is the profiler's peak to the byte (0.63% low
before: the recompute's residual add holds a promoted copy at the peak).

Layer norm's CPU backward sums the weight's and bias's gradients per thread into two threads x normalized-size
buffers of the input's dtype (only when either gradient is asked for), and group norm's into two batch x
channels fp32 ones (`LAYER_NORM_BACKWARD`, `GROUP_NORM_BACKWARD`): 1 KB for a 64-wide layer norm on 2
threads, 64 KB for a 4096-wide one. Profiled for 1 and 2 threads, fp32, bf16 and mixed weights: exact.

CTC loss (aten._ctc_loss_backward, the native kernel on the CPU and on CUDA): the backward fills a log-beta
table shaped as the forward's log-alpha (batch x input length x (2 x longest target + 1)) beside the gradient
it returns, and frees it on return. Profiled on the CPU (one empty_like of log-alpha inside every call):
exact on a CTC head whose backward is the step's peak (tests/test_kernels.py). cuDNN's CTC (CUDA, fp32, int32
targets, cuDNN enabled) is not modelled; transformers' speech models turn cuDNN off for their CTC loss.

Reductions that accumulate in another dtype on the CPU (sum, prod, cumsum, cumprod of a bool or integer
tensor into int64, or with `dtype=`): the kernel first copies the whole input into the output's dtype
(numel x output element bytes) and frees it on return, e.g. `mask.sum()` of a bool mask holds 8 bytes per
element. Profiled for bool, uint8, int32, bf16->fp32 and fp32->fp64, full and per-dimension: exact
(`CASTING_REDUCTIONS`, tests/test_kernels.py). Softmax and log-softmax, forward and backward, first copy each
non-contiguous tensor input into a contiguous one for the call (`CONTIGUOUS_FIRST`), and the mean of a whole
bf16 or fp16 tensor holds an fp32 copy of it (`UPCASTING_MEANS`): measured equal. SDPA's math path (where its
CPU flash kernel does not apply) normalises with `_safe_softmax`, whose -inf mask and row flags are its own
temporaries (`SAFE_SOFTMAX`): measured equal; the held-out doge (dynamic masks) in bf16 was 0.9% low without.

Data parallelism on CPU ranks (gloo): FSDP2's `fsdp.chunk_cat` (a unit's gradients into the reduce-scatter
input) pads and copies into temporaries on the CPU: measured per call signature like the convolutions.
gloo's reduce-scatter clones its input, and its all-gather holds an output-sized block, on the calling thread
for the duration of the call: counted there. gloo's all-gather also gathers into an output-sized buffer on
its own thread, racing the step: not counted (the estimate says so). Per-rank estimates against real gloo
ranks: BENCHMARKS.md.

Not modelled (allocations inside CPU kernels; a dispatch mode sees only op outputs, so both the fake and the
real-mode trace miss them; the profiler sees them):
    aten._scaled_dot_product_flash_attention_for_cpu and its backward (every CPU SDPA call without a mask, or
        with one the flash kernel takes): per-thread blocks of scores and accumulators, and for bf16 packed
        copies of the keys and values, following the block sizes, head size, dtype, thread count and ISA:
        37 KB for 2 x 4 heads of 128 tokens x 16 in fp32, 1.6 MB for 2 x 4 heads of 512 x 64 in bf16, 36 MB
        for 32 heads of 2,048 x 128 in bf16; the backward 131 KB for the first. Measuring them per call
        signature, as convolutions are, worked, but needs the measuring helper for every fp32 step too (a
        new process per `memfit train` run or rank: the test suite took 1,179 s of CPU instead of 996 s), and
        no held-out model peaks inside one; not counted yet.
    aten.mkldnn_rnn_layer_backward: a contiguous copy of a non-contiguous grad_output (T*mb*H*elem), zeros for
        an undefined grad_hy / grad_cy, the summed bias, the diff weights in oneDNN's layout (4H*in and 4H*H
        elements, fp32) and oneDNN's scratchpad (scratch gates T*mb*ld(4H)*4 plus ~7-8 KB not derived):
        about +436 KB at the peak for lstm_lm(dim=96, vocab=800, seq=16).
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from memfit.memory.fake import is_fake
from memfit.memory.isolate import available_host_bytes
from memfit.torch_internals import WAIT_TENSOR, held_by, profiler_call_allocations

aten = torch.ops.aten

PAGE = 4096


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _good_ld(n: int, elem: int) -> int:
    """oneDNN rnn_utils::get_good_ld: leading dimension padded to 64 bytes, avoiding multiples of 256."""
    ld = _round_up(n, 64 // elem)
    return ld + 64 // elem if ld % 256 == 0 else ld


def lstm_workspace_bytes(seq: int, batch: int, input_size: int, hidden: int, elem: int, c_elem: int) -> int:
    """Bytes of the workspace oneDNN's LSTM forward_training primitive returns for one layer, one direction."""
    states = 2 * (seq + 1) * batch
    regions = (
        seq * batch * _good_ld(4 * hidden, elem) * elem,
        seq * batch * _good_ld(hidden, elem) * elem,
        states * _good_ld(max(input_size, hidden), elem) * elem,
        states * hidden * c_elem,
        states * _good_ld(max(input_size, hidden), 4) * 4,
        states * _good_ld(max(input_size, hidden), 4) * 4,
        states * hidden * 4,
    )
    offset = 0
    for size in regions:
        offset = _round_up(offset, PAGE) + size
    return _round_up(offset, PAGE)


def _mkldnn_rnn_layer(args, kwargs, out):
    (input, w0, w1, w2, w3, hx, cx, reverse, batch_sizes, mode, hidden_size, num_layers, has_biases,
     bidirectional, batch_first, train) = args
    workspace = out[3]
    if not train or workspace.numel() != 0:
        return out
    # Always time-major here: mkldnn_rnn transposes a batch-first input before the per-layer call (the
    # batch_first flag is passed on, but the primitive reads dims as (T, mb, C)).
    seq, batch = input.shape[0], input.shape[1]
    nbytes = lstm_workspace_bytes(seq, batch, input.shape[-1], hidden_size, input.element_size(),
                                  cx.element_size() if cx is not None else 4)
    return (*out[:3], torch.empty(nbytes, dtype=torch.uint8, device=workspace.device))


def _norm_statistics(params):
    """A norm's saved mean and inverse std: the CPU kernel keeps them in fp32 for a bf16 / fp16 input whose
    parameters (weight, bias; batch norm's running statistics) are fp32 (its "mixed type" path: autocast on
    a CPU leaves norms in the input's dtype with fp32 weights); the meta kernel gives the input's dtype."""
    def fix(args, kwargs, out):
        x = args[0]
        mixed = x.dtype in (torch.bfloat16, torch.float16) and any(
            isinstance(p, torch.Tensor) and p.dtype == torch.float32 for p in (args[i] for i in params))
        if not mixed or out[1].dtype == torch.float32:
            return out
        return (out[0], *(torch.empty_like(t, dtype=torch.float32) for t in out[1:3]), *out[3:])
    return fix


# Outputs whose layout (strides) the meta kernel gives otherwise than the kernels, found by comparing the
# outputs and input gradients of ~130 ops fed transposed inputs and transposed incoming gradients, real against
# fake (tests/test_kernels.py checks those that differed). The bytes are the same; what reads the tensor next
# is not: a Linear copies a non-contiguous 3-D input before its matmul and folds a contiguous one as a view, a
# reshape copies or does not (PatchTST 8.3% low, Swin 1.0% high).
def _suggested_format(x: torch.Tensor) -> torch.memory_format:
    """The input's suggested memory format, as ATen picks it: channels-last where the input is, else contiguous."""
    last = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    return last if last is not None and not x.is_contiguous() and x.is_contiguous(memory_format=last) \
        else torch.contiguous_format


def _laid_out(out, i: int, layout: torch.memory_format | torch.Tensor):
    """`out` with output `i` in `layout` (a memory format, or a tensor whose strides to take)."""
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    y = outs[i]
    if y is None:
        return out
    if isinstance(layout, torch.Tensor):
        if y.stride() == layout.stride() or layout.shape != y.shape:
            return out
        outs[i] = torch.empty_like(layout, dtype=y.dtype)  # its strides, where it is dense
    elif y.is_contiguous(memory_format=layout):
        return out
    else:
        outs[i] = torch.empty_like(y, memory_format=layout)
    return tuple(outs) if isinstance(out, (tuple, list)) else outs[0]


def _batch_norm_output(args, kwargs, out):
    """Batch norm's CPU kernel lays its output out in the input's suggested memory format; the meta kernel
    keeps the input's strides (PatchTST's BatchNorm1d over a transposed (batch, length, channels) input)."""
    return _laid_out(_norm_statistics((1, 2, 3, 4))(args, kwargs, out), 0, _suggested_format(args[0]))


def _contiguous(args, kwargs, out):
    """The gradient contiguous, as the kernels make it (`LEGACY_CONTIGUOUS_MEMORY_FORMAT`, or a structured
    kernel's output without strides); the meta kernel follows the incoming gradient's strides."""
    return _laid_out(out, 0, torch.contiguous_format)


def _like_gradient(args, kwargs, out):
    """Laid out as the incoming gradient, its first operand, as TensorIterator lays an elementwise kernel's
    output out; the meta kernel (a decomposition) makes it contiguous."""
    return _laid_out(out, 0, args[0])


def _batch_norm_gradient(args, kwargs, out):
    """Batch norm's CPU backward makes the input's gradient in the input's suggested memory format."""
    return _laid_out(out, 0, _suggested_format(args[1]))


_OUTPUT_FIXES = {
    aten.mkldnn_rnn_layer.default: _mkldnn_rnn_layer,
    aten.native_layer_norm_backward.default: _contiguous,
    aten._log_softmax_backward_data.default: _contiguous,
    **dict.fromkeys((aten.hardswish_backward.default, aten.elu_backward.default, aten.softplus_backward.default,
                     aten.hardsigmoid_backward.default, aten.hardtanh_backward.default), _like_gradient),
}
_CPU_OUTPUT_FIXES = {  # where a CUDA kernel's outputs may differ: for a CPU target only
    aten.native_layer_norm.default: _norm_statistics((2, 3)),
    aten.native_group_norm.default: _norm_statistics((1, 2)),
    aten.native_batch_norm.default: _batch_norm_output,
    aten.native_batch_norm_backward.default: _batch_norm_gradient,
    aten.binary_cross_entropy_backward.default: _contiguous,
}


def fix_fake_outputs(func, args, kwargs, out, cpu: bool = True):
    """`out` with every fake output the meta kernel sizes or lays out differently from the kernel made again
    as the kernel makes it (`cpu`: the target runs CPU kernels; a GPU target gets only the fixes that hold for
    its kernels too). Call from a dispatch mode sitting above the fake mode, so that new tensors are fake ones."""
    if str(func) == WAIT_TENSOR and isinstance(args[0], torch.Tensor):  # the tensor waited on, not a second one
        return args[0]
    fix = _OUTPUT_FIXES.get(func) or (_CPU_OUTPUT_FIXES.get(func) if cpu else None)
    if fix is None or not any(isinstance(t, torch.Tensor) and is_fake(t)
                              for t in (out if isinstance(out, (tuple, list)) else (out,))):
        return out
    return fix(args, kwargs or {}, out)


# ------------------------------------------------------------------------------ kernel workspaces, measured

# Ops whose CPU kernels hold more memory while they run than they return: oneDNN reorders activations and
# weights into blocked layouts, computes weight gradients in a padded blocked layout, and takes per-thread
# scratchpads, by amounts that follow its choice of implementation for the shape, dtype, memory format, ISA
# and thread count. Measured, once per call signature, on this machine.
MEASURED_OPS = frozenset({aten.convolution.default, aten.convolution_backward.default,
                          # batch norm's backward holds an input-sized buffer on the CPU (a contiguous or channels-last
                          # input; a strided one runs another path), its forward per-channel accumulators
                          aten.native_batch_norm.default, aten.native_batch_norm_backward.default,
                          # the CPU flash attention kernels' per-thread blocks (scores, running max and sum, the
                          # output's accumulator; in backward the gradients' accumulators too)
                          aten._scaled_dot_product_flash_attention_for_cpu.default,
                          aten._scaled_dot_product_flash_attention_for_cpu_backward.default})
# FSDP2's copy of a unit's gradients into the reduce-scatter input (`fsdp.chunk_cat`, by name: the op exists
# once torch.distributed.fsdp is imported): on the CPU it pads, and copies inputs of another dtype, into
# temporaries by amounts that follow the shapes, dtypes and chunk count. Measured the same way.
MEASURED_OP_NAMES = frozenset({"fsdp.chunk_cat.default"})
# gloo's reduce-scatter (FSDP2's gradient reduction on CPU ranks) clones its input on the calling thread
# and frees the clone when the collective is done (profiled: one input-sized aten::clone inside every
# c10d::_reduce_scatter_base_ call, freed before FSDP2 issues anything else). Its all-gather (FSDP2's
# parameter gather) likewise holds an output-sized block on the calling thread for the call (one aten::empty
# inside every c10d::_allgather_base_, freed before it returns), beside the buffer on gloo's own thread.
# NCCL reduces in place and gathers into the output.
GLOO_REDUCE_SCATTER = "c10d._reduce_scatter_base_.default"
GLOO_ALL_GATHER = "c10d._allgather_base_.default"
# Matmuls in bf16 / fp16 go to oneDNN too, which takes an fp32 accumulator and per-thread packing buffers
# from the same allocator; fp32 matmuls go to MKL, whose buffers PyTorch's allocator never sees.
LOW_PRECISION_MATMULS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default})
# Reductions whose CPU kernels copy their input into the accumulation dtype first (module docstring).
CASTING_REDUCTIONS = frozenset({aten.sum.default, aten.sum.dim_IntList, aten.prod.default, aten.prod.dim_int,
                                aten.cumsum.default, aten.cumprod.default})
# The mean of a whole bf16 / fp16 tensor: the CPU kernel accumulates in fp32 over an fp32 copy of the input,
# freed on return (profiled: numel x 4 bytes, and a few bytes of scalars; the sum of one does not).
UPCASTING_MEANS = frozenset({aten.mean.default})
# CPU softmax kernels work on contiguous copies of their tensor inputs (forward: the input; backward: the
# gradient and the output), made inside the kernel and freed before it returns: each non-contiguous one costs
# its own bytes for the call (profiled: a permuted (2, 512, 4, 513) fp32 input, 8.4 MB, in Longformer's
# sliding-window attention; contiguous inputs cost nothing).
CONTIGUOUS_FIRST = frozenset({aten._softmax.default, aten._log_softmax.default, aten._softmax_backward_data.default,
                              aten._log_softmax_backward_data.default})
# SDPA's math path normalises with `_safe_softmax` (rows all -inf give zeros, not NaN), a composite whose own
# temporaries the dispatcher does not show: the input's -inf mask (bool, numel bytes), the rows where it is all
# set (bool, numel / size(dim)) and a 0-d zero of the output's dtype, freed on return; with `dtype=` another
# than the input's, first the input converted to it, freed before the mask is made (profiled: exact on fp32,
# bf16 and fp16 inputs, any dim). CUDA runs the same composite (not measured here: not counted there).
SAFE_SOFTMAX = aten._safe_softmax.default
# Elementwise binary ops (TensorIterator) on the CPU compute in their inputs' common dtype: each input of another
# dtype (bf16 beside fp32 under autocast, an integer or boolean mask) is first copied into it, the copy freed
# on return, and an in-place op whose tensor has another dtype computes into a temporary of the common dtype.
# CUDA kernels cast as they read. Profiled: add / sub / mul / div (and in place), maximum, minimum, atan2, pow,
# comparisons and where, broadcast and 0-d inputs included (tests/test_kernels.py).
PROMOTING_BINARY = frozenset({aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.maximum.default,
                              aten.minimum.default, aten.atan2.default, aten.pow.Tensor_Tensor, aten.eq.Tensor,
                              aten.ne.Tensor, aten.lt.Tensor, aten.le.Tensor, aten.gt.Tensor, aten.ge.Tensor,
                              aten.where.self})
PROMOTING_IN_PLACE = frozenset({aten.add_.Tensor, aten.sub_.Tensor, aten.mul_.Tensor, aten.div_.Tensor})


_COMPARISONS = frozenset({aten.eq.Tensor, aten.ne.Tensor, aten.lt.Tensor, aten.le.Tensor, aten.gt.Tensor,
                          aten.ge.Tensor})


def _promotion_copies(func, args, out) -> int:
    values = args[1:3] if func is aten.where.self else args[:2]
    if len(values) < 2 or not all(isinstance(t, torch.Tensor) for t in values):
        return 0
    # an op's output has its common dtype (true division of integers: a float), but for comparisons (bool) and
    # in-place ops (self's dtype), which take it from their inputs
    computed = func in _COMPARISONS or func in PROMOTING_IN_PLACE or not isinstance(out, torch.Tensor)
    common = torch.result_type(*values) if computed else out.dtype
    nbytes = sum(t.numel() * common.itemsize for t in values if t.dtype != common)
    if func in PROMOTING_IN_PLACE and values[0].dtype != common:
        nbytes += values[0].numel() * common.itemsize
    return nbytes


# The CPU sum of two sparse COO tensors (accumulated sparse gradients: Embedding(sparse=True)) concatenates
# their indices and values into the result's, which the dispatcher shows, after scaling a copy of the second's
# values by alpha, held until it returns (profiled: one micro-batch's gradient values at each accumulation).
SPARSE_SUMS = frozenset({aten.add.Tensor, aten.add_.Tensor})


def _both_sparse(args) -> bool:
    return len(args) >= 2 and all(isinstance(t, torch.Tensor) and t.layout is torch.sparse_coo for t in args[:2])


# Layer norm's CPU backward, when it computes the weight's or the bias's gradient, sums them per thread first:
# two (threads, normalized size) buffers in the input's dtype. Group norm's keeps two (batch, channels) fp32
# buffers of per-channel sums. Profiled for 1 and 2 threads, fp32 and bf16, mixed weights, every mask.
LAYER_NORM_BACKWARD = aten.native_layer_norm_backward.default
GROUP_NORM_BACKWARD = aten.native_group_norm_backward.default


# CTC loss's backward (the native kernel, CPU and CUDA alike) fills a log-beta table shaped as the forward's
# log-alpha, which it receives (argument 6), and frees it on return (profiled on the CPU: one empty_like of it
# inside every aten::_ctc_loss_backward, beside the gradient it returns).
CTC_BACKWARD = frozenset({aten._ctc_loss_backward.default, aten._ctc_loss_backward.Tensor})


def _ctc_log_beta(args) -> int:
    return args[6].numel() * args[6].element_size()


# A measurement runs the op on real tensors of the traced shapes: their bytes, times this, must fit in the
# memory the host has available (the outputs and the workspace come on top of the inputs).
HEADROOM = 8


def _spec(a):
    """A JSON description of an op argument: a tensor by shape, strides and dtype, anything else as is."""
    if isinstance(a, torch.Tensor):
        return {"shape": list(a.shape), "stride": list(a.stride()), "dtype": str(a.dtype).removeprefix("torch.")}
    if isinstance(a, (list, tuple)):
        return [_spec(x) for x in a]
    if isinstance(a, dict):
        return {k: _spec(v) for k, v in a.items()}
    return a


def _tensor_bytes(spec) -> int:
    if isinstance(spec, dict) and "dtype" in spec:
        extent = 1 + sum((n - 1) * st for n, st in zip(spec["shape"], spec["stride"]) if n)
        return extent * torch.empty((), dtype=getattr(torch, spec["dtype"])).element_size()
    if isinstance(spec, dict):
        return sum(_tensor_bytes(x) for x in spec.values())
    return sum(_tensor_bytes(x) for x in spec) if isinstance(spec, list) else 0


_parent_threads: int | None = None
_in_forked_child = False


def _before_fork() -> None:
    global _parent_threads
    if not _in_forked_child:
        _parent_threads = torch.get_num_threads()


def _after_fork_in_child() -> None:
    global _in_forked_child
    _in_forked_child = True


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def host_threads() -> int:
    """Intra-op threads the steps run with: a forked tracing child runs on one thread (OpenMP does not
    survive a fork), but the step it stands for runs with its parent's."""
    return _parent_threads if _in_forked_child and _parent_threads else torch.get_num_threads()


def rank_threads() -> int:
    """Intra-op threads of each CPU rank: `memfit train --gpus N` starts the ranks with OMP_NUM_THREADS
    (1 unless the environment sets it), so that N ranks do not oversubscribe the cores; oneDNN's
    per-thread buffers follow it."""
    return int(os.environ.get("OMP_NUM_THREADS") or 1)


def _cache_file(threads: int) -> Path:
    """Measurements hold for one machine, PyTorch build (oneDNN version) and thread count."""
    cpu = next((line.split(":", 1)[1].strip() for line in _read_lines("/proc/cpuinfo") if line.startswith("model name")),
               "")
    machine = f"{torch.__version__}|{torch.backends.cpu.get_cpu_capability()}|{cpu}|{threads}"
    root = Path(os.environ.get("MEMFIT_CACHE", Path.home() / ".cache" / "memfit"))
    return root / f"kernels-{hashlib.sha1(machine.encode()).hexdigest()[:16]}.json"


def _read_lines(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.readlines()
    except OSError:
        return []


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


class CpuWorkspaces:
    """What each MEASURED_OPS (and low-precision matmul) call's CPU kernel holds while it runs beyond the
    outputs it returns, in bytes:
    the tracker counts it at that op and frees it at once. Each new call signature is run on real tensors
    in a helper process at the steps' thread count (under the profiler, whose allocation events inside the
    call give it: the highest running total minus what survives the call) and cached on disk."""

    def __init__(self, threads: int | None = None):
        self.threads = threads or host_threads()
        self.path = _cache_file(self.threads)
        self.table = _load(self.path)
        self.counted = 0     # calls whose workspace was counted
        self.too_large = 0   # calls too large to run here, not counted
        self.failed = 0      # calls the helper could not measure, not counted
        self.unmeasured: set[str] = set()  # their signatures, not tried again

    def __call__(self, func, args, kwargs, out) -> int:
        if func in CASTING_REDUCTIONS:
            x = args[0]
            return x.numel() * out.element_size() if isinstance(out, torch.Tensor) and out.dtype != x.dtype else 0
        if func in UPCASTING_MEANS:
            x = args[0]
            return x.numel() * 4 if x.dtype in (torch.bfloat16, torch.float16) else 0
        if func in CONTIGUOUS_FIRST:
            return sum(t.numel() * t.element_size() for t in args[:2]
                       if isinstance(t, torch.Tensor) and not t.is_contiguous())
        if func in CTC_BACKWARD:
            return _ctc_log_beta(args)
        if func is SAFE_SOFTMAX:
            x, dim = args[0], args[1]
            converted = x.numel() * out.element_size() if out.dtype != x.dtype else 0
            return max(converted, x.numel() + x.numel() // max(x.shape[dim], 1) + out.element_size()) if x.dim() else 0
        if func is LAYER_NORM_BACKWARD:
            x, normalized, mask = args[1], args[2], args[7]
            return 2 * self.threads * math.prod(normalized) * x.element_size() if mask[1] or mask[2] else 0
        if func is GROUP_NORM_BACKWARD:
            return 2 * args[5] * args[6] * max(4, args[1].element_size())
        if func in SPARSE_SUMS and _both_sparse(args):
            return held_by(args[1])[-1].untyped_storage().nbytes()
        if func in PROMOTING_BINARY or func in PROMOTING_IN_PLACE:
            return _promotion_copies(func, args, out)
        if str(func) == GLOO_REDUCE_SCATTER:
            return args[1].untyped_storage().nbytes()
        if str(func) == GLOO_ALL_GATHER:
            return args[0].numel() * args[0].element_size()
        if func not in MEASURED_OPS and str(func) not in MEASURED_OP_NAMES and not (func in LOW_PRECISION_MATMULS and out.dtype in (torch.bfloat16,
                                                                                         torch.float16)):
            return 0
        request = {"op": str(func), "args": _spec(list(args)), "kwargs": _spec(dict(kwargs or {}))}
        key = json.dumps(request, sort_keys=True)
        if key in self.unmeasured:
            return 0
        if key not in self.table:
            if HEADROOM * _tensor_bytes(request["args"]) > available_host_bytes():
                self.too_large += 1
                self.unmeasured.add(key)
                return 0
            measured = self._measure(request)
            if measured is None:
                self.failed += 1
                self.unmeasured.add(key)
                return 0
            self.table[key] = measured
            self._save(key, measured)
        self.counted += 1
        return self.table[key]

    def _measure(self, request: dict) -> int | None:
        return _ask(self.threads, request).get("bytes")

    def _save(self, key: str, value: int) -> None:
        """Merged into what is on disk (tracing children run side by side), written atomically."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            table = {**_load(self.path), key: value}
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(table))
            os.replace(tmp, self.path)
        except OSError:
            pass  # an unwritable cache only means measuring again next time

    def notes(self) -> list[str]:
        out = []
        if self.counted:
            out.append(f"CPU kernels' workspaces (oneDNN reorders and scratchpads of convolutions and bf16/fp16 "
                       f"matmuls, flash attention's per-thread blocks) counted at each call: "
                       f"measured on this machine at {self.threads} threads, cached in {self.path}")
        if self.too_large or self.failed:
            out.append(f"the kernel workspace of {self.too_large + self.failed} call signature(s) is not "
                       f"counted ({self.too_large} too large to run here, {self.failed} failed to run)")
        return out


_dead: set[tuple[int, int]] = set()  # (process id, threads) whose helper could not be reached


def _ask(threads: int, request: dict) -> dict:
    """The measuring helper's answer to `request` ({} if there is none). The helper is a fresh Python (OpenMP
    cannot run more than one thread in a forked child, which is where tracing runs) serving one Unix socket
    for a top-level process and thread count: the first tracing child that needs it starts it, and every
    later child of the same process asks the same one, instead of paying a start (~2 s) each. It ends
    within a second of that process, or when idle for HELPER_IDLE_SECONDS. One that cannot be reached is
    not tried again by this process: each start costs seconds, and whatever stopped it would again."""
    key = (os.getpid(), threads)
    if key in _dead:
        return {}
    try:
        path = _socket_path(threads)
        conn = _connect(path) or _start(path, threads)
        if conn is not None:
            with conn:
                conn.sendall((json.dumps(request) + "\n").encode())
                with conn.makefile("r") as answer:
                    return json.loads(answer.readline() or "{}")
    except (OSError, ValueError):
        pass
    _dead.add(key)
    return {}


def _root() -> int:
    """The process whose tracing children share a helper: the parent of a forked child, else this one."""
    return os.getppid() if _in_forked_child else os.getpid()


def _socket_path(threads: int) -> Path:
    folder = Path(tempfile.gettempdir()) / f"memfit-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder / f"kernels-{_root()}-{threads}.sock"


def _connect(path: Path) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
        return conn
    except OSError:
        conn.close()
        return None


def _start(path: Path, threads: int) -> socket.socket | None:
    """Start the helper for `path` (one process at a time, under a lock; another may have started it
    meanwhile) and connect to it once it listens; None if it ends first or does not listen within a minute."""
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        conn = _connect(path)
        if conn is not None:
            return conn
        path.unlink(missing_ok=True)  # left by a helper of an earlier process with the same id
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        code = f"from memfit.memory.kernels import serve; serve({threads}, {str(path)!r}, {_root()})"
        helper = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
            start_new_session=True)  # outlives the child that starts it
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and helper.poll() is None:
            conn = _connect(path)
            if conn is not None:
                return conn
            time.sleep(0.02)
        helper.kill()
        return None


# ------------------------------------------------------------------------------ cuDNN workspace, assumed


class CudnnWorkspaces:
    """The workspace a cuDNN convolution takes from PyTorch's caching allocator while it runs, for a CUDA
    target traced on the CPU. PyTorch asks cuDNN's heuristics for an engine (torch.backends.cudnn.benchmark
    is off by default), allocates the engine's workspace from the caching allocator for the call and frees it
    after; the size is the engine's, which cannot be known without the GPU. Assumed: the unfolded input of a
    GEMM engine (batch x input channels x kernel area x output positions, in the input's dtype; for a
    transposed convolution the output channels and input positions), capped at CUDNN_CONV_WSCAP_DBG MiB when
    that is set (cuDNN's own cap on the workspace of the engines it offers). Backward data and backward
    weights run one after the other, each with its own workspace, so the larger of the two is held at once:
    the same size. Depthwise convolutions run PyTorch's own kernel, without one. An engine with implicit GEMM
    needs less: the assumption errs on the side of more memory."""

    def __init__(self):
        cap = os.environ.get("CUDNN_CONV_WSCAP_DBG", "").strip()
        self.cap = int(cap) * 2**20 if cap.isdigit() else None
        self.calls = 0

    def __call__(self, func, args, kwargs, out) -> int:
        if func in CTC_BACKWARD:
            return _ctc_log_beta(args)
        if func is aten.convolution.default:
            x, weight, positions = args[0], args[1], out.shape[2:]
        elif func is aten.convolution_backward.default:
            x, weight, positions = args[1], args[2], args[0].shape[2:]
        else:
            return 0
        transposed, groups = (args[6], args[8]) if func is aten.convolution.default else (args[7], args[9])
        if groups > 1 and groups == x.shape[1]:
            return 0
        if transposed:
            positions = x.shape[2:]
        area = 1
        for n in (*weight.shape[2:], *positions):
            area *= n
        nbytes = x.shape[0] * weight.shape[1] * groups * area * x.element_size()
        self.calls += 1
        return min(nbytes, self.cap) if self.cap is not None else nbytes

    def notes(self) -> list[str]:
        if not self.calls:
            return []
        cap = f"capped at CUDNN_CONV_WSCAP_DBG={self.cap // 2**20} MiB" if self.cap is not None else \
            "uncapped (CUDNN_CONV_WSCAP_DBG is not set)"
        return [f"cuDNN convolution workspace assumed: each call holds the unfolded input of a GEMM engine while "
                f"it runs, {cap}; the engine cuDNN's heuristics pick may need less (an upper side)"]


def _make(spec):
    if isinstance(spec, dict) and "dtype" in spec:
        t = torch.empty_strided(spec["shape"], spec["stride"], dtype=getattr(torch, spec["dtype"]))
        return t.normal_() if t.is_floating_point() else t.zero_()
    if isinstance(spec, list):
        return [_make(x) for x in spec]
    if isinstance(spec, dict):
        return {k: _make(v) for k, v in spec.items()}
    return spec


def workspace_of(func, args, kwargs) -> int:
    """Run `func` (warmed up: oneDNN creates its primitive on the first call) under the profiler and return
    the bytes its kernel held beyond its outputs: the highest running total of the allocations made inside
    the call, minus what was still allocated when it returned."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        func(*args, **kwargs)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        func(*args, **kwargs)
    [sizes] = profiler_call_allocations(prof, func.name().split(".")[0])  # the profiler names no overload
    running = peak = 0
    for size in sizes:
        running += size
        peak = max(peak, running)
    return peak - running


HELPER_IDLE_SECONDS = 600  # a long-lived process (a notebook) does not keep an idle helper's memory


def serve(threads: int, path: str, root: int) -> None:
    """The measuring helper: one connection at a time on the Unix socket `path`, one JSON request in and one
    answer out on each, until process `root` has ended or nothing has asked for HELPER_IDLE_SECONDS."""
    torch.set_num_threads(threads)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    listener.settimeout(1.0)
    last = time.monotonic()
    try:
        while _alive(root) and time.monotonic() - last < HELPER_IDLE_SECONDS:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            last = time.monotonic()
            with conn, conn.makefile("rw") as stream:
                conn.settimeout(None)
                line = stream.readline()
                if line:
                    stream.write(json.dumps(_answer(json.loads(line))) + "\n")
                    stream.flush()
    finally:
        listener.close()
        for done in (Path(path), Path(path).with_suffix(".lock")):
            done.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or the id now belongs to another user's process
        return False
    try:  # an ended process that its parent has not reaped (a zombie) still answers kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # no /proc: kill's answer
        return True


def _answer(request: dict) -> dict:
    namespace, name, overload = request["op"].split(".")
    if namespace == "fsdp":
        importlib.import_module("torch.distributed.fsdp")  # registers the fsdp ops
    func = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    try:
        return {"bytes": workspace_of(func, _make(request["args"]), _make(request["kwargs"]))}
    except Exception as e:  # noqa: BLE001 - the tracer is told, and counts nothing for this call
        return {"error": f"{type(e).__name__}: {e}"}
