"""An estimate counted from a few traced blocks: a deep model's step traced as three shallow copies, the
whole depth written from what one more block (or one more period of a hybrid's layer pattern) adds.

Why it is exact where it is used: a copy with one more period of blocks makes the same allocations and frees
as the shallower one with one period's runs inserted (its forward, backward, optimizer update, state), so the
whole depth's stream is the shallowest one with those runs repeated (`streams`). From it come the peak of
live bytes, each phase's, and, replayed through `allocator`, the CUDA caching allocator's allocated and
reserved peaks, which are not linear in depth (the cached-but-free part moves with the segments' layout). The
other figures (categories at the peak, state, FLOPs, parameters) add up block by block. Nothing is printed
unchecked: the third copy's own trace must be, event for event, the stream written for it from the first two
(where the second reads as the first with runs inserted in more than one way, the reading it bears out), and
every linear figure must lie on the line through the three; else (or where it does not apply) the whole model
is traced as before.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os

import torch

from memfit.config import Config
from memfit.errors import ConfigError, MemfitError, first_line
from memfit.memory import allocator, estimate as traced, streams
from memfit.memory.copies import shallow
from memfit.memory.devices import Device, defaults_for, get_device
from memfit.memory.estimate import CATEGORIES, MODULES, TOP_TENSORS, Estimate
from memfit.memory.isolate import run_isolated_many
from memfit.memory.tracker import Category, Phase
from memfit.strategies.activation_checkpoint import find_blocks
from memfit.workload import Workload

__all__ = ["BLOCKS", "Counted", "Plan", "estimate_blocks", "layer_plan", "probe_blocks"]

BLOCKS = ("auto", "all")  # --blocks: extrapolate where it applies (below), or trace every block
# Extrapolate only where the copies, traced two at a time (the deepest beside the other two: _probes), hold at
# most half of the model's blocks on either core, and all three at most three quarters of them (one core).
MAX_SHARE, MAX_TOTAL = 0.5, 0.75


@dataclasses.dataclass(frozen=True)
class Plan:
    """The copies traced: `depths` blocks each, `period` apart (a hybrid's layer pattern), of `blocks`."""
    blocks: int
    period: int
    depths: tuple[int, int, int]


def _layers(model: torch.nn.Module) -> str | None:
    """The name of the ModuleList the model's repeated blocks are the children of; None for any other
    arrangement."""
    parents = {n.rpartition(".")[0] for n in find_blocks(model)}
    if len(parents) != 1:
        return None
    name = parents.pop()
    return name if isinstance(model.get_submodule(name), torch.nn.ModuleList) else None


def _kinds(model: torch.nn.Module, layers: str) -> list[tuple]:
    """Each layer of that list: its class and its parameters' names, shapes and dtypes."""
    return [(type(b).__name__, tuple((n, tuple(p.shape), p.dtype) for n, p in b.named_parameters()))
            for b in model.get_submodule(layers)]


def layer_plan(workload: Workload, least: int = 0, checkpoint: str | int | tuple = "none") -> Plan | None:
    """The copies to trace for `workload`, or None where extrapolating does not apply: no one list of
    layers, a layer pattern with no period, or copies that would take more than MAX_SHARE / MAX_TOTAL of them.
    The whole model is built on the meta device (no memory) to read its layers; a factory that builds fewer
    (`with_blocks`) must build the same first layers.
    `least`: the fewest blocks the first copy may have; it holds the first three layers that use a parameter
    several layers share (Zamba's attention block), so that a period more adds a use of it like the others
    (autograd keeps the gradient of the last use in backward, adds the next one's out of place, and each
    further one in place).
    `checkpoint` (Config.activation_checkpoint): every k-th block checkpointed is part of the layers' pattern;
    blocks named one by one are none (a copy would not hold them all)."""
    if isinstance(checkpoint, tuple):
        return None
    try:
        with torch.device("meta"):
            model = workload.model()
    except Exception:  # noqa: BLE001 - a factory that needs real tensors (it reads a checkpoint): traced whole
        return None
    layers = _layers(model)
    if layers is None:
        return None
    built = _kinds(model, layers)
    kinds = built if not isinstance(checkpoint, int) else \
        [(kind, i % checkpoint == 0) for i, kind in enumerate(built)]  # blocks 0, k, 2k, ... (chosen_blocks)
    kinds = [k + tuple(each[i] for each in _per_layer(model, len(kinds))) for i, k in enumerate(kinds)]
    n = len(kinds)
    least = max(least, _sharing(model.get_submodule(layers)))
    for period, first, _ in sorted(_starts(kinds, least), key=lambda c: (c[2], 3 * c[1] + 3 * c[0])):
        depths = (first, first + period, first + 2 * period)
        while max(depths[2], depths[0] + depths[1]) <= MAX_SHARE * n and sum(depths) <= MAX_TOTAL * n:
            if _builds(workload, layers, built, depths):
                return Plan(n, period, depths)
            depths = tuple(d + period for d in depths)  # a copy that does not build: the next ones deeper
    return None


def _sharing(layers: torch.nn.ModuleList) -> int:
    """How many layers a copy needs to hold the first three uses of every parameter several layers share: one
    more than the last such third use (0 where the layers share none)."""
    users: dict[int, list[int]] = {}
    for i, layer in enumerate(layers):
        for p in layer.parameters():
            users.setdefault(id(p), []).append(i)
    return max((u[min(2, len(u) - 1)] + 1 for u in users.values() if len(u) > 1), default=0)


def _starts(kinds: list[tuple], least: int) -> list[tuple[int, int, bool]]:
    """[(period, the least depth of a first copy, shallower)]: the layers repeat every `period` from some layer
    on and the rest of the model past the first copy is whole periods. The first copy holds one repeated layer
    (rwkv's first block has one norm more: its first copy holds it and one), or, `shallower`, tried only where
    that costs too much, one period less (jamba's attention every 8 of 32 layers: copies of 0, 8, 16)."""
    n, out = len(kinds), []
    for period in range(1, n // 4 + 1):  # a longer one: copies of 0, 1 and 2 periods hold over half (MAX_SHARE)
        start = next((s for s in range(n - period) if all(kinds[i] == kinds[i + period]
                                                             for i in range(s, n - period))), None)
        if start is not None:
            first = max(start + 1, least)
            first += (n - first) % period
            out.append((period, first, False))
            if period > 1 and first - period >= max(start, least):  # (period 1: copies of 1, 2, 3 fit 8 layers)
                out.append((period, first - period, True))
    return out


def _per_layer(model: torch.nn.Module, n: int) -> list[list]:
    """A transformers config's lists of one entry per layer (Gemma's `layer_types`: sliding or full attention,
    the same parameters): part of the layers' pattern, as `with_blocks` cuts them to a copy's depth. Sub-configs'
    too (T5Gemma 2's `decoder.layer_types` and `encoder.text_config.layer_types`: its copies cut both stacks)."""
    plain = (str, int, float, bool, type(None))
    out: list[list] = []

    def walk(config, depth: int) -> None:
        for v in vars(config).values():
            if isinstance(v, (list, tuple)) and len(v) == n and all(isinstance(x, plain) for x in v):
                out.append(v)
            elif depth < 3 and hasattr(v, "model_type") and hasattr(v, "__dict__"):  # a sub-config
                walk(v, depth + 1)

    config = getattr(model, "config", None)
    if hasattr(config, "__dict__"):
        walk(config, 0)
    return out


def _builds(workload: Workload, layers: str, kinds: list[tuple], depths: tuple[int, ...]) -> bool:
    """Whether the factory's copies (`with_blocks`) build with the whole model's first layers (Zamba's
    does not with one use of its shared attention block: transformers finds no other layer to tie it to)."""
    fewer = getattr(workload.model, "with_blocks", None)
    for d in depths if fewer is not None else ():
        try:
            with torch.device("meta"):
                m = fewer(d)
            if m is not None and _kinds(m, layers) != kinds[:d]:
                return False
        except Exception:  # noqa: BLE001 - a copy that does not build, or has no such list, is no copy
            return False
    return True


def estimate_blocks(workload: Workload, config: Config | None = None, device: str | Device = "cpu",
                    blocks: str = "auto", isolate: bool = True) -> Estimate:
    """`estimate`, counted from three shallow copies where that applies and checks out (`extrapolated_from`
    says so), else traced whole. blocks: "auto" or "all" (trace every block)."""
    if blocks not in BLOCKS:
        raise ConfigError(f"blocks {blocks!r}: one of {', '.join(BLOCKS)}")
    dev = device if isinstance(device, Device) else get_device(device)
    config = config or Config(precision=defaults_for(dev).precision)
    plan = _layer_plan_for(workload, config) if blocks == "auto" else None
    if plan is None:
        return traced.estimate(workload, config, dev, isolate=isolate)
    counted, why, plan = _counted(workload, config, dev, plan, isolate and hasattr(os, "fork"))
    if counted is not None:
        return counted.estimate
    full = traced.estimate(workload, config, dev, isolate=isolate)
    full.notes.append(f"traced whole: its copies of {', '.join(map(str, plan.depths))} blocks did not extend "
                      f"exactly ({why})")
    return full


def _copy(workload: Workload, keep: int) -> Workload:
    """The copy with the first `keep` layers: the factory's own (`with_blocks`, checked by layer_plan),
    else the whole model cut (copies.shallow)."""
    fewer = getattr(workload.model, "with_blocks", None)
    if fewer is None:
        return shallow(workload, keep)
    cut = shallow(workload, keep).model
    return dataclasses.replace(workload, model=lambda: fewer(keep) or cut())


@contextlib.contextmanager
def _keeping_streams():
    traced.KEEP_STREAMS = True
    try:
        yield
    finally:
        traced.KEEP_STREAMS = False


_LINEAR = ("flops", "recompute_flops", "parameters", "moved_bytes", "host_peak_bytes")


def _probes(workload: Workload, config: Config, dev: Device, plan: Plan, isolate: bool,
            done: dict | None = None) -> tuple[dict, dict]:
    """({depth: its copy's probe, with its stream}, {depth: what its step raised}) for the plan's copies, those
    in `done` (traced for copies one block shallower) kept. Isolated, each copy is traced in its own forked
    child, the deepest and the shallowest first, as many at a time as there are cores (fake tracing is one
    core's Python): on two cores the three take about as long as the deepest alone."""
    def one(depth: int):
        with _keeping_streams():
            return traced.probe(_copy(workload, depth), config, dev, isolate=False)

    out = {d: done[d] for d in plan.depths if d in (done or {})}
    todo = [d for d in plan.depths if d not in out]
    order = todo[-1:] + todo[:-1]
    raised = {}
    if not isolate:
        for d in order:
            try:
                out[d] = one(d)
            except MemfitError as e:
                raised[d] = e
    else:
        for depth, (kind, value) in zip(order, run_isolated_many([functools.partial(one, d) for d in order])):
            if kind == "error":
                if not isinstance(value, MemfitError):
                    raise value
                raised[depth] = value
            else:
                out[depth] = value
    return {d: out[d] for d in plan.depths if d in out}, raised


@dataclasses.dataclass
class Counted:
    """A counted estimate and what the planner prices it by: the first two copies' op traces, and how many
    periods the whole depth adds to the first (on one rank a step's time adds up op by op, so it is the first
    copy's and `steps` times what one period more adds, as the linear figures are); `ops`: the deepest copy's."""
    estimate: Estimate
    copies: list
    steps: int
    ops: object


def _from_copies(workload: Workload, config: Config, dev: Device, plan: Plan, isolate: bool,
                 done: dict) -> tuple[Counted | None, str, dict]:
    """(the whole depth counted, "", the copies' probes by depth) from the three copies (those in `done` not
    traced again), or (None, why not, the probes traced)."""
    by_depth, raised = _probes(workload, config, dev, plan, isolate, done)
    if raised:  # a copy the model's code refuses (a division by its depth less 1), or a step that raises anyway
        return None, f"a copy's step raised: {first_line(raised[min(raised)])}", by_depth
    probes = [by_depth[d] for d in plan.depths]
    try:
        est, why = _extended(plan, probes, config, dev)
    except Exception as e:  # noqa: BLE001 - a stream this code cannot write: the whole model is traced instead
        return None, f"its streams could not be written: {first_line(e)}", by_depth
    if est is None:
        return None, why, by_depth
    steps = (plan.blocks - plan.depths[0]) // plan.period
    return Counted(est, [p.ops for p in probes[:2]], steps, probes[2].ops), "", by_depth


def _layer_plan_for(workload: Workload, config: Config) -> Plan | None:
    """`layer_plan` for one rank's `config`: with checkpointing from copies of 2 blocks (a copy of one has no
    repeated blocks to checkpoint)."""
    ck = config.activation_checkpoint
    return layer_plan(workload, 0 if ck in (None, "none") else 2, ck) if config.world == 1 else None


def _counted(workload: Workload, config: Config, dev: Device, plan: Plan,
             isolate: bool) -> tuple[Counted | None, str, Plan]:
    """`_from_copies`, and once more with copies one block deeper where a copy's own code refused it (dividing
    by its depth less 1; checkpointing a copy of one block) or the copies did not extend, the copies already
    traced kept (BERT-style encoders, BEiT: the embeddings' output lives until the last block ends, so a middle
    block first shows in a copy of 3: copies of 2, 3, 4); not where the deepest copy's step raised (deeper
    ones would too: yoso's own dtype error). (the count or None, why not, the copies' plan). The
    copies trace a long accumulation as two micro-steps (`traced.traced_steps`), and the count adds the rest."""
    steps = traced.traced_steps(config)
    counted, why, done = _from_copies(workload, steps, dev, plan, isolate, {})
    deeper = None if counted is not None or plan.depths[-1] not in done else \
        layer_plan(workload, plan.depths[0] + 1, config.activation_checkpoint)  # (the deepest raised: so would these)
    if deeper is not None:
        plan, tried = deeper, why
        counted, why, _ = _from_copies(workload, steps, dev, plan, isolate, done)
        if counted is not None:
            counted.estimate.notes.append(f"copies one block shallower were tried first: {tried}")
    if counted is not None and steps != config:  # the second micro-step at the whole depth, as the rest are
        (f1, m1), (f2, m2) = (traced.micro_step(ops) for ops in counted.copies)
        traced.accumulated(counted.estimate, config, dev, f1 + (f2 - f1) * counted.steps,
                           m1 + (m2 - m1) * counted.steps)
    return counted, why, plan


def probe_blocks(workload: Workload, config: Config, dev: Device, least_blocks: int = 1) -> Counted | None:
    """The planner's counted estimate of `config` where extrapolating applies to a model of at least
    `least_blocks` blocks and checks out; else None (the planner traces the whole model, as its step time
    needs every op). Runs the copies in forked children."""
    plan = _layer_plan_for(workload, config)
    if plan is None or plan.blocks < least_blocks:
        return None
    return _counted(workload, config, dev, plan, hasattr(os, "fork"))[0]


def _extended(plan: Plan, probes: list, config: Config, dev: Device) -> tuple[Estimate | None, str]:
    """The whole depth's estimate from the copies' probes, checked against the third; or (None, why not)."""
    ests = [p.estimate for p in probes]
    if any(e.method != "fake" for e in ests):
        return None, "fake tensors could not follow a copy"
    if any(e.stages or (e.routing and e.routing.get("assumption") != "invariant") for e in ests):
        return None, "a pipeline or routing bound"
    first, second, third = streams.written([p.stream for p in probes])
    last: dict = {}

    def bears_out(runs, exactly: bool) -> bool:
        """Whether the runs inserted twice are the third copy's trace, event for event (or, not `exactly`, but
        for the setup order); what they write is kept."""
        last["written"] = streams.repeat(first, runs, 2)
        last["differs"] = streams.differs(last["written"], third)
        return last["differs"] is None if exactly else last["differs"] != "other"

    # of the ways to read it, the first the third bears out event for event, else but for the setup order: a
    # reading may put a period's buffers beside its parameters where the copies list every buffer after every
    # parameter (GPT-Neo's attention masks: the same figures in the third copy, 36 MiB more reserved in the
    # whole depth; the exact reading is found within 64)
    runs = streams.insertions(first, second, lambda r: bears_out(r, True), tries=64) or \
        streams.insertions(first, second, lambda r: bears_out(r, False))
    if runs is None:
        if streams.insertions(first, second) is None:
            return None, f"the copy of {plan.depths[1]} blocks is not the first with blocks inserted"
        return None, f"the copy of {plan.depths[2]} blocks is not the first with the runs inserted twice"
    cuda = dev.kind == "cuda"
    deepest = ests[2]  # the third copy's estimate (`third` is its stream)
    phases = {str(p): p for p in deepest.phase_peaks}

    def figures(stream):  # what the stream gives: the live peak, each phase's, the categories and phase at the
        # peak (where it lies moves with the depth: a deeper copy may peak in a later micro-step or phase), on a
        # GPU the allocator's two peaks
        pre = [("cublas-workspace", dev.cublas_workspace_bytes)] if cuda else []
        return (streams.peak(stream), streams.phase_peaks(stream, str(Phase.SETUP)),
                *streams.at_peak(stream, str(Phase.SETUP))) + \
            (allocator.simulate(pre + streams.events(stream)) if cuda else ())

    written, differs = last["written"], last["differs"]  # event for event, which storage each free frees
    got = figures(written)
    want = (deepest.peak_bytes, {str(p): v for p, v in deepest.phase_peaks.items()},
            {str(c): v for c, v in deepest.breakdown.items() if v}, str(deepest.peak_phase)) + \
        ((deepest.peak_allocated_bytes, deepest.peak_reserved_bytes) if cuda else ())
    if got != want:
        return None, f"the third copy's figures {want} were written as {got}"
    steps = (plan.blocks - plan.depths[0]) // plan.period
    if plan.depths[0] + steps * plan.period != plan.blocks:
        return None, f"{plan.blocks} blocks are not {plan.depths[0]} + whole periods of {plan.period}"
    whole_stream = streams.repeat(first, runs, steps)
    whole = figures(whole_stream)
    out = dataclasses.replace(deepest, notes=list(deepest.notes))
    out.peak_bytes, out.peak_phase = whole[0], phases[whole[3]]
    out.breakdown = {c: whole[2].get(str(c), 0) for c in deepest.breakdown}

    def line(values: list, what: str):
        a, b, c = values
        if b - a != c - b:
            raise _NotLinear(what)
        return a + (b - a) * steps

    try:
        for name in _LINEAR:
            values = [getattr(e, name) for e in ests]
            if values[0] is not None:
                setattr(out, name, line(values, name))
        # what is at rest after the step; the peak, its phase and categories, and each phase's peak are the
        # stream's (where the peak lies moves with depth; a copy of no layers peaks lower in backward than the
        # line through the others: jamba's copies of 0, 8, 16)
        out.model_state_bytes = {k: line([e.model_state_bytes.get(k, 0) for e in ests], f"model_state_bytes[{k}]")
                                 for k in deepest.model_state_bytes}
    except _NotLinear as e:
        return None, f"{e.args[0]} is not linear in the blocks"
    out.phase_peaks = {phases[p]: v for p, v in whole[1].items()}
    if cuda:
        out.peak_allocated_bytes, out.peak_reserved_bytes = whole[4:]
        out.device_peak_bytes = deepest.device_peak_bytes - deepest.peak_reserved_bytes + out.peak_reserved_bytes
    if out.routing:
        out.routing = dict(out.routing, bound_peak_bytes=out.peak_bytes, bound_device_peak_bytes=out.device_peak_bytes)
    out.extrapolated_from = (plan.depths[2], plan.blocks)
    out.config = config.to_dict()
    out.top_tensors, out.modules = _at_peak_lists(whole_stream)
    # what lists points of the step or FLOPs by module is the copy's: not printed as the whole model's
    out.module_flops = {}
    out.timeline, out.module_timeline = {"index": [], "phase": [], **{c: [] for c in CATEGORIES}}, {}
    out.blocks = []
    out.notes.insert(0, f"extrapolated from {plan.depths[2]} of {plan.blocks} blocks: copies of "
                        f"{', '.join(map(str, plan.depths))} blocks traced"
                        + (f" (the layers repeat every {plan.period})" if plan.period > 1 else "")
                        + f", the whole depth written as the first with {steps} x what {plan.period} more "
                        "add(s), checked event for event against the third copy's own trace"
                        + ("" if differs is None else " (but for the order the tensors alive before the step were "
                                                      "laid out in, sizes tied: the figures the same)")
                        + "; no timeline, and a '#' in a listed module stands for any block's index (a module's "
                        "bytes are its blocks' together)")
    return out, ""


def _at_peak_lists(stream: list[tuple]) -> tuple[list[dict], list[tuple[str, int]]]:
    """The largest tensors alive at the written stream's peak, and its activations and temporaries by module,
    as a traced estimate lists them; a module in a block reads with '#' for the block's index, and its bytes
    are those of every block's."""
    live = sorted(streams.live_at_peak(stream), key=lambda t: -t[0])  # stable: ties in the order made
    tensors = [dict(bytes=n, category=Category(c[0]), shape=list(c[4]), dtype=c[3], op=c[2], module=c[5],
                    phase=Phase(c[1]), source=c[6]) for n, c in live[:TOP_TENSORS]]
    by_module: dict[str, int] = {}
    for n, c in live:
        if c[0] in (Category.ACTIVATIONS, Category.TEMPORARIES):
            by_module[c[5]] = by_module.get(c[5], 0) + n
    return tensors, sorted(by_module.items(), key=lambda kv: -kv[1])[:MODULES]


class _NotLinear(MemfitError):
    """A figure off the line through the copies: caught here, the whole model is traced instead."""
