"""`summarize`: a Keras-like per-module table of one forward/backward on fake tensors: output shapes,
own parameters, bytes saved for backward, forward FLOPs."""
from __future__ import annotations

import dataclasses

import torch

from memfit.config import Config
from memfit.errors import ConfigError, MicroBatchError, WorkloadError, first_line
from memfit.memory.estimate import PROBES_WITHOUT_1
from memfit.memory.fake import FakeBuild, new_fake_mode
from memfit.memory.tracker import LiveBytes, ModuleScope, OpRecorder, seeing_saved
from memfit.step import TrainStep
from memfit.strategies import autocast_context
from memfit.workload import Workload, tensors_of


@dataclasses.dataclass
class ModuleRow:
    name: str
    kind: str
    depth: int
    output_shape: str
    parameters: int      # own parameters (not children's); a tied weight counts at its first owner
    saved_bytes: int     # activations saved for backward while this module was innermost
    flops: int           # forward FLOPs, children included (backward ops run outside any module)


def summarize(workload: Workload, config: Config | None = None) -> list[ModuleRow]:
    """Rows in module order. A model that cannot train at micro-batch 1 but does at 2 raises MicroBatchError."""
    config = config or Config()
    try:
        return _summarize(workload, config)
    except (WorkloadError, ConfigError):
        raise
    except Exception as e:
        if config.micro_batch != 1:
            raise
        try:
            _summarize(workload, config.replace(micro_batch=PROBES_WITHOUT_1[0]))
        except Exception:  # noqa: BLE001 - not a matter of size: the first failure is the one to report
            raise e from None
        raise MicroBatchError(workload.name, 1, PROBES_WITHOUT_1[0], first_line(e)) from None


def _summarize(workload: Workload, config: Config) -> list[ModuleRow]:
    with new_fake_mode() as mode:
        with FakeBuild(mode):
            step = TrainStep(workload, config, "cpu")
        model = step.model
        shapes: dict[str, str] = {}
        names = {id(m): (n or type(m).__name__) for n, m in reversed(list(model.named_modules()))}

        def record(module, args, output):  # returns None: a hook's return value would replace the output
            shapes.setdefault(names[id(module)], _shape(output))

        hooks = [m.register_forward_hook(record) for m in model.modules()]
        tracker = LiveBytes("cpu")
        recorder = OpRecorder()
        saved: dict[int, int] = {}

        def pack(t):
            uid = tracker.uid(t)
            if uid is not None:
                saved[uid] = tracker.infos[uid].nbytes

        scope = ModuleScope(model, tracker, recorder)
        try:
            with seeing_saved(pack), tracker.recording(recorder):
                with autocast_context(config, step.device):
                    loss = workload.loss(model, workload.batch(config.micro_batch))
                loss.float().backward()
        finally:
            scope.remove()
            tracker.close()
            for h in hooks:
                h.remove()
    param_keys = {tracker.uid(p) for p in model.parameters()}
    saved_by_module: dict[str, int] = {}
    for key, nbytes in saved.items():
        info = tracker.infos.get(key)
        if info is not None and key not in param_keys:
            saved_by_module[info.module] = saved_by_module.get(info.module, 0) + nbytes
    flop_counts: dict[str, int] = {}  # children included: add each innermost count to all its ancestors
    for module, n in recorder.flops_by_module.items():
        if module.startswith("("):  # run outside any module: backward, optimizer
            continue
        parts = module.split(".")
        for i in range(len(parts) + 1):
            prefix = ".".join(parts[:i])
            flop_counts[prefix] = flop_counts.get(prefix, 0) + n
    rows, seen = [], set()
    for name, mod in model.named_modules():
        label = name or type(mod).__name__
        own = 0
        for p in mod.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                own += p.numel()
        rows.append(ModuleRow(label, type(mod).__name__, name.count(".") + (1 if name else 0),
                              shapes.get(label, "-"), own, saved_by_module.get(label, 0),
                              flop_counts.get(name, 0)))
    return rows


def _shape(out) -> str:
    ts = tensors_of(out) if not isinstance(out, torch.Tensor) else [out]
    if not ts:
        return "-"
    text = ", ".join("×".join(map(str, t.shape)) or "scalar" for t in ts[:3])
    return text + (", …" if len(ts) > 3 else "")
