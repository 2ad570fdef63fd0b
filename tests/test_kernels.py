"""memfit.memory.kernels: each CPU-kernel fix agrees with the real kernel and with the profiler's timeline."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import memfit
from memfit.memory.kernels import lstm_workspace_bytes

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import models  # noqa: E402
from truth import real_step_peak  # noqa: E402


class _Workspaces(TorchDispatchMode):
    """Records (input shape, workspace bytes, predicted bytes) of every real mkldnn_rnn_layer call."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.mkldnn_rnn_layer.default:
            x, cx = args[0], args[6]
            predicted = lstm_workspace_bytes(x.shape[0], x.shape[1], x.shape[2], args[10], x.element_size(),
                                             cx.element_size())
            self.seen.append((tuple(x.shape), out[3].numel(), predicted))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq,batch,inp,hidden,layers,bidir,batch_first", [
    (1, 1, 16, 32, 1, False, True),
    (7, 5, 100, 96, 1, False, True),
    (32, 4, 64, 64, 2, False, True),
    (9, 3, 40, 128, 2, True, False),   # second layer's input is 2 * hidden; reverse direction
    (20, 8, 256, 200, 1, False, False),
])
def test_lstm_workspace_formula_matches_the_cpu_kernel(dtype, seq, batch, inp, hidden, layers, bidir, batch_first):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN: LSTM does not run mkldnn_rnn_layer")
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(inp, hidden, num_layers=layers, bidirectional=bidir, batch_first=batch_first)
    x = torch.randn((batch, seq, inp) if batch_first else (seq, batch, inp), requires_grad=True)
    with _Workspaces() as ws, torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        lstm(x)
    if not ws.seen:
        pytest.skip(f"LSTM did not take the oneDNN path for {dtype}")
    assert len(ws.seen) == layers * (2 if bidir else 1)
    for shape, real, predicted in ws.seen:
        assert real == predicted, f"input {shape}: kernel workspace {real} bytes, formula {predicted}"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("size", [dict(), dict(vocab=300, dim=48, layers=3, seq=20)])
def test_lstm_estimate_equals_profiler(precision, size):
    """The fake trace now carries oneDNN's LSTM workspace: estimate == profiler peak, to the byte."""
    wl = models.lstm_lm(**size)
    cfg = memfit.Config(micro_batch=4, precision=precision)
    est = memfit.estimate(wl, cfg)
    assert est.method == "fake"
    assert est.peak_bytes == real_step_peak(wl, cfg)
