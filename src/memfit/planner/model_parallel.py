"""Layouts that split the model, for a plan across ranks, searched when data parallelism alone has nothing
that fits (or, asked with `plan(split_layouts="also")`, beside a data-parallel plan that fits: on a 70B over 512
H100s that took 28 min here and found nothing faster, BENCHMARKS.md).

FSDP shards weights, gradients and optimizer state, but every rank still runs every block on its whole
micro-batch: at a long sequence one rank's activations (each block's checkpointed input, a block's working
set, the logits at the end) outgrow a GPU however many ranks share the state.

- Tensor parallelism (with sequence parallelism, torchtitan's plan) splits every block's matmuls and its
  checkpointed input over t ranks of a node: the activations shrink by about t.
- A pipeline splits the blocks over p stages. Under 1F1B stage s holds min(p - s, n) micro-batches of its
  own blocks, so stage 0 still holds a whole model's worth of one micro-batch's checkpoints; what it moves
  is the logits (the last stage's alone) and the state of the blocks it does not run. Each pipeline is also
  tried under torch's interleaved schedules (v = 2 stages a rank): interleaved 1F1B (a bubble of 1/v of
  1F1B's, more micro-batches in flight on the first ranks) and, with no data-parallel ranks beside it (torch's
  weight pass does not find FSDP2's parameters: Config refuses it), zero bubble; their memory is the trace's,
  which runs the schedule. GPipe is not tried: 1F1B's bubble with every micro-batch held.

Each candidate (the rest of the ranks FSDP2 data parallel) is traced on two shallow copies of the model and
extended along the line through them to the model's depth (the planner's shallow probes' idea: a pipeline's
copies keep PER_STAGE blocks a stage, a tensor-parallel one `depths` blocks); the fastest that fits is then
traced whole. Step time: `costmodel.pipeline_seconds` (the schedule's slots of the slowest rank, each waiting
for its receive) or the step's own, with tensor parallelism's collectives exposed.
"""
from __future__ import annotations

import dataclasses
import functools

from memfit.config import Config
from memfit.errors import ConfigError, WorkloadError
from memfit.memory.devices import links
from memfit.memory.estimate import accumulated, micro_step, probe, traced_steps
from memfit.memory.isolate import run_isolated_many
from memfit.memory.copies import depths, shallow, stack_depth
from memfit.planner.costmodel import comm_for, pipeline_parts, pipeline_seconds, pipeline_slots, send_seconds, step_seconds
from memfit.units import fmt_bytes

STAGES = (2, 4, 8, 16)
SCHEDULES = ("1f1b", "interleaved-1f1b", "zero-bubble")  # (Config refuses the pairings torch does not run)
TENSOR = (2, 4, 8)        # within a node
PER_STAGE = (2, 4)        # blocks a stage keeps in a pipeline's two shallow copies
MAX_IN_FLIGHT = 4         # micro-batches a step, at most this many per stage (their trace grows with them)
CONFIRM = 2               # candidates traced whole, fastest first, until one fits
MAX_SIZES = 3             # micro-batches tried a layout, smallest first, while they fit


@dataclasses.dataclass
class Split:
    """A layout that splits the model, as the plan lists it."""
    config: Config
    peak_bytes: int
    step_seconds: float
    confirmed: bool = False
    estimate: object = None
    predicted: list = dataclasses.field(default_factory=list)  # each pipeline rank's peak, from the copies
    predicted_seconds: float = 0.0                             # the step time from the copies
    forward_share: float = 1 / 3                               # of a pipeline's slot, from the whole trace


def model_parallel(s, why_not: str | None) -> tuple[Split, list[Split], list] | None:
    """The fastest tensor-parallel or pipeline layout of `s.gpus` ranks that fits (traced whole), the others
    predicted to fit, and a verdict for each layout tried; None when none fits (the reasons in `s.notes`).
    `s`: the planner's request (search._Search); `why_not`: why data parallelism alone does not fit (None: it
    does, and these layouts are searched beside it)."""
    depth = _depth(s)
    if depth is None:
        s.notes.append("tensor-parallel and pipeline layouts not searched: the model's repeated blocks are not one "
                       "stack of identical blocks")
        return None
    options = list(_options(s, depth))
    if not options:
        s.notes.append(f"tensor-parallel and pipeline layouts not searched: none of {TENSOR} tensor-parallel ranks "
                       f"or {STAGES} stages divides the {s.gpus} ranks, the {depth} blocks (at least "
                       f"{max(PER_STAGE)} a stage) and the batch (a micro-batch for every stage)")
        return None
    rates, speeds = s.rates(), links(s.dev)
    verdicts = []
    candidates = _rounds(s, [c for c in options if c.pp_schedule == "1f1b"], depth, rates, speeds, verdicts)
    # the interleaved schedules hold no less than 1F1B on the first ranks (more micro-batches in flight; zero
    # bubble's deferred weight halves keep their inputs): traced only at the layouts and micro-batches 1F1B fits
    fits = {_as_1f1b(c.config) for c in candidates if c.config.pp > 1}
    looped = [c for c in options if c.pp_schedule != "1f1b" and _as_1f1b(c) in fits]
    candidates += _rounds(s, looped, depth, rates, speeds, verdicts)
    if not candidates:
        s.notes.append("no tensor-parallel or pipeline layout fits either")
        s.verdicts += verdicts
        return None
    candidates.sort(key=lambda c: c.step_seconds)
    best = _confirm(s, candidates, verdicts, rates, speeds)
    if best is None:
        s.notes.append("no tensor-parallel or pipeline layout fits either: those predicted to fit did not when "
                       "traced whole")
        s.verdicts += verdicts
        return None
    k1, k2 = _copies(best.config)
    why = f"data parallelism alone does not fit ({why_not})" if why_not is not None else "beside data parallelism"
    s.notes.append(f"{why}: tensor-parallel and pipeline layouts searched, each traced on copies of "
                   f"{_kept(best.config, k1)} and {_kept(best.config, k2)} blocks and extended to {depth}; the plan "
                   "then traced whole")
    if best.config.pp > 1:
        s.notes.append(_pipeline_note(best, candidates))
    if best.config.tp > 1:
        s.notes.append(f"tensor parallel over {best.config.tp} ranks of a node: every block's matmuls and its "
                       "checkpointed input split; its collectives priced on NVLink, none overlapped with compute")
    verdicts.insert(0, (_name(best.config), f"chosen at micro-batch {best.config.micro_batch}"))
    others = [c for c in candidates if c is not best]
    for c in others:
        verdicts.append((_name(c.config), f"predicted to fit, {c.step_seconds / best.step_seconds:.2f}x slower "
                                          f"(micro-batch {c.config.micro_batch})"))
    return best, others, verdicts


def _rounds(s, options: list[Config], depth: int, rates, speeds, verdicts: list) -> list[Split]:
    """The candidates among `options` that fit: each layout's micro-batches in rounds, smallest first, every
    layout's next size traced together; a size that does not fit ends its layout."""
    candidates = []
    groups: dict[tuple, list[Config]] = {}
    tried: dict[tuple, int] = {}
    for cfg in options:
        groups.setdefault(_family(cfg), []).append(cfg)
    while groups:
        round_ = [cfgs.pop(0) for cfgs in groups.values()]
        jobs = [functools.partial(_probe_copy, shallow(s.workload, _kept(cfg, k)), traced_steps(cfg), s.dev)
                for cfg in round_ for k in _copies(cfg)]
        results = run_isolated_many(jobs)
        for i, cfg in enumerate(round_):
            key = _family(cfg)
            fitted = _judge(s, cfg, results[2 * i: 2 * i + 2], depth, rates, speeds, verdicts)
            if fitted is not None:
                candidates.append(fitted)
                tried[key] = tried.get(key, 0) + 1
            if fitted is None or not groups[key] or tried[key] >= MAX_SIZES:
                groups.pop(key)
    return candidates


def _as_1f1b(cfg: Config) -> Config:
    return cfg.replace(pp_schedule="1f1b", pp_virtual=None)


def _judge(s, cfg: Config, got: list, depth: int, rates, speeds, verdicts: list) -> Split | None:
    """A candidate from its two copies' traces, or None with the reason in `verdicts`."""
    if any(kind != "ok" for kind, _ in got):
        error = next(value for kind, value in got if kind != "ok")
        if not isinstance(error, (ConfigError, WorkloadError)):
            raise error
        verdict = (_name(cfg), f"cannot apply: {error}")
        if verdict not in verdicts:
            verdicts.append(verdict)
        return None
    (_, a), (_, b) = got
    k1, k2 = _copies(cfg)
    blocks = depth // cfg.pp
    peaks = [round(_extend(x, y, k1, k2, blocks)) for x, y in zip(a["peaks"], b["peaks"])]
    peak = max(peaks)
    if peak > s.usable:
        where = f"stage {peaks.index(peak)} " if cfg.pp > 1 else ""
        verdicts.append((_name(cfg), f"does not fit: {where}over by {fmt_bytes(peak - s.usable)} at micro-batch "
                                     f"{cfg.micro_batch}"))
        return None
    seconds = _extend(_seconds(s, cfg, a, rates, speeds), _seconds(s, cfg, b, rates, speeds), k1, k2, blocks)
    return Split(config=cfg, peak_bytes=peak, step_seconds=seconds, predicted=peaks, predicted_seconds=seconds)


def _copies(cfg: Config) -> tuple[int, int]:
    """Blocks a stage (a pipeline) or the model (tensor parallel) keeps in the two shallow copies."""
    return PER_STAGE if cfg.pp > 1 else depths(cfg.gpus * cfg.tp)


def _kept(cfg: Config, k: int) -> int:
    return k * cfg.pp


def _seconds(s, cfg: Config, traced: dict, rates, speeds) -> float:
    if cfg.pp > 1:
        return pipeline_seconds(rates, traced["ops"], cfg.grad_accum, comm_for(s.dev, cfg),
                                _wait(cfg, traced["handoff_bytes"], speeds), cfg.pp_schedule, cfg.pp_virtual)
    return step_seconds(rates, traced["ops"][0], cfg.grad_accum, comm_for(s.dev, cfg))


def _confirm(s, candidates: list[Split], verdicts: list, rates, speeds) -> Split | None:
    """The fastest candidate that fits when traced whole (every stage), its figures replaced by the trace's;
    at most CONFIRM tried. A candidate that does not is said so in `verdicts`."""
    for c in candidates[:CONFIRM]:
        job = functools.partial(_probe_copy, s.workload, traced_steps(c.config), s.dev)
        (kind, traced), = run_isolated_many([job], workers=1)
        if kind != "ok":
            raise traced
        peak, estimate = max(traced["peaks"]), traced["estimate"]
        if peak > s.usable:
            verdicts.append((_name(c.config), f"predicted to fit, but traced whole needs {fmt_bytes(peak)}"))
            continue
        if traced_steps(c.config) != c.config:
            accumulated(estimate, c.config, s.dev, *micro_step(traced["ops"][0]))
        c.peak_bytes, c.estimate, c.confirmed = peak, estimate, True
        c.step_seconds = _seconds(s, c.config, traced, rates, speeds)
        if c.config.pp > 1:
            c.forward_share = pipeline_parts(rates, traced["ops"], c.config.grad_accum, comm_for(s.dev, c.config))[1]
        return c
    return None


def _wait(cfg: Config, nbytes: int, speeds) -> float:
    """A slot's wait for its activation and its gradient: neighbouring stages' ranks are `gpus` apart."""
    if speeds is None:
        return 0.0
    return 2 * send_seconds(speeds, nbytes, inside_node=cfg.gpus < (cfg.gpus_per_node or 8))


def _family(cfg: Config) -> tuple:
    """A layout whose micro-batch sizes are tried in turn."""
    return cfg.pp, cfg.tp, cfg.activation_checkpoint, cfg.pp_schedule


SCHEDULE_NAMES = {"1f1b": "1F1B", "interleaved-1f1b": "interleaved 1F1B", "zero-bubble": "zero bubble"}


def _pipeline_note(best: Split, candidates: list[Split]) -> str:
    """Why the chosen pipeline's schedule: its bubble beside 1F1B's for the same layout and micro-batches,
    and what that costs on rank 0 (both peaks predicted from the copies, so alike in how they were made)."""
    cfg = best.config
    p, n, v = cfg.pp, cfg.grad_accum, cfg.pp_virtual
    stages = ", ".join(fmt_bytes(st["device_peak_bytes"] or st["peak_bytes"]) for st in best.estimate.stages)
    unit = "rank" if v > 1 else "stage"
    held = f"the {unit}s' peaks traced whole: {stages}"
    if cfg.pp_schedule == "1f1b":
        return (f"1F1B: stage s holds min({p} - s, {n}) micro-batches' activations and only the last stage the "
                f"logits ({held}); the bubble is {p - 1} slots of {n + p - 1}")
    name = SCHEDULE_NAMES[cfg.pp_schedule]
    one = pipeline_slots("1f1b", p, n) - n
    mine = pipeline_slots(cfg.pp_schedule, p, n, v, best.forward_share) - n
    why = f"{name} ({v} stages a rank): a bubble of {mine:.2g} slots, {_fraction(mine / one)} of 1F1B's {one:g}"
    twin = next(c for c in candidates if c.config == _as_1f1b(cfg))  # traced first: the others only where it fits
    more = best.predicted[0] - twin.predicted[0]
    side = f"{fmt_bytes(more)} more" if more >= 0 else f"{fmt_bytes(-more)} less"
    return (f"{why}, {twin.predicted_seconds / best.predicted_seconds:.2f}x 1F1B's speed at the cost of {side} on "
            f"rank 0 (both predicted from the copies); {held}")


def _fraction(x: float) -> str:
    """1/2, 1/4 ... where it is one, else two digits."""
    return f"1/{round(1 / x)}" if x > 0 and abs(1 / x - round(1 / x)) < 1e-9 else f"{x:.2f}"


def _name(cfg: Config) -> str:
    split = f"{cfg.pp} stages" if cfg.pp > 1 else f"tensor parallel {cfg.tp}"
    if cfg.pp > 1 and cfg.pp_schedule != "1f1b":
        split = f"{cfg.pp} ranks x {cfg.pp_virtual} stages {cfg.pp_schedule}"
    return f"{split} x {cfg.gpus} {cfg.data_parallel if cfg.gpus > 1 else 'rank'}, {cfg.precision}, " \
           f"checkpointing {cfg.activation_checkpoint}"


def _extend(short, tall, k1: int, k2: int, blocks: int) -> float:
    """The line through a figure at k1 and k2 blocks (a stage's), at `blocks`."""
    return short + (blocks - k1) * (tall - short) / (k2 - k1)


def _depth(s) -> int | None:
    from memfit.memory.fake import FakeBuild, new_fake_mode

    try:
        with new_fake_mode() as mode, FakeBuild(mode):
            return stack_depth(s.workload.model())
    except Exception:  # noqa: BLE001 - a model a plain fake build cannot make is not split
        return None


def _options(s, depth: int):
    """Every layout to price: tensor-parallel ranks (within a node) and stage counts that divide the ranks and
    the blocks, micro-batches that split each replica's batch (a pipeline: one for every stage, at most
    MAX_IN_FLIGHT a stage), checkpointing as fixed or every block's and none."""
    checkpoints = [s.activation_checkpoint] if s.activation_checkpoint is not None else ["all", "none"]
    layouts = [(1, t) for t in TENSOR if t <= (s.gpus_per_node or 8) and depth >= depths(s.gpus)[1]]
    layouts += [(p, 1) for p in STAGES if depth % p == 0 and depth // p >= max(PER_STAGE)]
    for pp, tp in layouts:
        if s.gpus % (pp * tp):
            continue
        dp = s.gpus // (pp * tp)
        if s.global_batch % dp:
            continue
        replica = s.global_batch // dp
        for m in range(1, replica + 1):
            n = replica // m
            if replica % m or (s.micro_batch and m != s.micro_batch):
                continue
            if pp > 1 and not pp <= n <= MAX_IN_FLIGHT * pp:
                continue
            for ck in checkpoints:
                for schedule in SCHEDULES if pp > 1 else SCHEDULES[:1]:
                    try:
                        yield Config(micro_batch=m, grad_accum=n, precision=s.precisions[0], activation_checkpoint=ck,
                                     gpus=dp, data_parallel="fsdp" if dp > 1 else "none", pp=pp, tp=tp,
                                     pp_schedule=schedule)
                    except ConfigError:  # zero bubble beside FSDP, micro-batches torch's rounds do not divide
                        continue


def _probe_copy(workload, config: Config, dev) -> dict:
    """A trace's device peak (each stage's), ops (each stage's), a pipeline's handoff size and the estimate,
    on fake tensors (in a forked child)."""
    p = probe(workload, config, dev, isolate=False)
    e = p.estimate
    stages = e.stages or [{"device_peak_bytes": e.device_peak_bytes, "peak_bytes": e.peak_bytes}]
    return {"peaks": [st["device_peak_bytes"] or st["peak_bytes"] for st in stages],
            "ops": p.stage_ops or [p.ops], "handoff_bytes": p.handoff_bytes, "estimate": e}
