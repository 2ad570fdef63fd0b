"""What CPU kernels allocate that fake tensors get wrong: a small table, one entry per op, each with its evidence.

The fake trace runs meta kernels. Where a meta kernel returns an output of a different size than the CPU
kernel does, the estimate is wrong by the difference for as long as that output lives. `fix_fake_outputs`
replaces such an output with a fake tensor of the size the CPU kernel really returns, so lifetime (saved
for backward, freed after it) is followed exactly like any other tensor. Real tensors are never touched.

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

Not modelled (allocations inside CPU kernels; a dispatch mode sees only op outputs, so both the fake and the
real-mode trace miss them; the profiler sees them). Measured with torch 2.13 / oneDNN 3.12 on an AVX-512
CPU, micro_batch 4, 2 threads; sizes depend on oneDNN's implementation choice, the ISA and the thread count,
so no formula from op arguments alone reproduces them:
    aten.mkldnn_convolution / convolution_backward (fp32 and bf16, NCHW): oneDNN reorders plain activations
        into channel-blocked copies (nChw16c: channels padded up to 16, so a 4-channel tensor costs 4x),
        weights into blocked copies, computes into a blocked result, reorders it into the plain output,
        and uses a thread-dependent scratchpad. The backward does this twice (data, then weights).
        unet: +481536 B at the peak (final 1x1 conv, 4 output channels) with 2 threads, +142592 B with 1.
    aten.mm / addmm in bf16 (autocast or bf16 weights): oneDNN matmul scratchpad (fp32 accumulator plus
        per-thread packing buffers): vit bf16 +128768 B (weight-grad mm 64x260 @ 260x256), custom_function
        +22272 B with 2 threads (17536 B with 1), 2-layer MLP in bf16-pure +91904 B.
    CPU TensorIterator ops with inputs of mixed dtype (bf16 * fp32): a promoted copy of the narrower input
        (numel x 4 bytes), freed when the op returns.
    aten.mkldnn_rnn_layer_backward: a contiguous copy of a non-contiguous grad_output (T*mb*H*elem), zeros for
        an undefined grad_hy / grad_cy, the summed bias, the diff weights in oneDNN's layout (4H*in and 4H*H
        elements, fp32) and oneDNN's scratchpad (scratch gates T*mb*ld(4H)*4 plus ~7-8 KB not derived):
        about +436 KB at the peak for lstm_lm(dim=96, vocab=800, seq=16).
"""
from __future__ import annotations

import torch

from memfit.memory.fake import is_fake

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


_OUTPUT_FIXES = {
    aten.mkldnn_rnn_layer.default: _mkldnn_rnn_layer,
}


def fix_fake_outputs(func, args, kwargs, out):
    """`out` with every fake output the meta kernel sizes differently from the CPU kernel resized.
    Call from a dispatch mode sitting above the fake mode, so that new tensors are fake ones."""
    fix = _OUTPUT_FIXES.get(func)
    if fix is None or not any(isinstance(t, torch.Tensor) and is_fake(t) for t in out):
        return out
    return fix(args, kwargs or {}, out)
