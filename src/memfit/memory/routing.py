"""Mixture-of-experts routing on fake tensors: data-dependent shapes traced under a stated assumption.

A top-k router decides how many tokens each expert receives, and MoE code turns that decision into shapes
(`nonzero`, `torch.where(mask)`, `bincount`, `.tolist()` of counts, a boolean mask as an index). Fake
tensors carry no values, so those ops raise. `Routing` is a dispatch mode that sits just above the fake
mode and keeps, beside some fake tensors, a *shadow*: a small real CPU tensor holding the value the tensor
would have. Shadows come from two places only:

- values known without data: integer and boolean tensors made by deterministic factories (`arange`,
  `zeros`, `full`, ... and real constants), and small floating ones (`torch.ones` attention masks, up to
  `FLOAT_FACTORY_LIMIT_BYTES`; of those the build made, only the model's buffers keep theirs: I-BERT's
  running minimum, which its first step branches on; never weights), exact;
- the batch: tensors the workload's `batch()` draws inside `Routing.drawing()` are drawn for real beside
  their fake twins, as a measured step would draw them (token ids are small), so a model that branches on
  its inputs (`if not padding_mask.any()`, `is_global_attn = mask.any().item()`) takes the branch the real
  step takes on a batch like the workload's;
- finiteness checks: `isnan` / `isinf` / `isfinite` / `x == x` of a tensor without a shadow answer that
  every value is finite (`assert not x.isnan().any()` in I-BERT's quantisers, torch.distributions' argument
  validation), the values of a step that trains; counted in `assumed_finite`, for the estimate's note;
- torch.distributions' argument checks (a parameter's constraint in `Distribution.__init__`, a value's
  support in `_validate_sample`: `df > 0` of a Student-T head) answer that they pass, as a step that trains
  does; counted in `assumed_valid`;
- the router's choice, which is data: the indices of a top-k selection (`topk`, `argmax`, `max(dim)`) over
  at most `MAX_CHOICES` entries that are not known get the choices the assumption prescribes.

Every op whose tensor inputs all have shadows is also run on the shadows (outside the fake mode), so
`one_hot`, `permute`, `sum`, `cumsum`, `sort`, comparisons... carry the values along; a floating result
keeps its shadow only up to `FLOAT_FACTORY_LIMIT_BYTES`, as a floating factory's does (rotary cos/sin
tables made from `arange` in every layer were computed for real: a third of a 7B probe's time), integer
and boolean ones (indices, masks, counts: what shapes depend on) up to `SHADOW_LIMIT_BYTES`. An op fake tensors
refuse (`DynamicOutputShapeException`, `DataDependentOutputException`) is answered from the shadows: its
output becomes a fake tensor of the real output's shape, with the real output as shadow, and `.item()`,
`.tolist()`, `bool()` return the real numbers. Ops that mix shadowed indices with ordinary fake data
(`hidden[token_idx]`, `index_add_`) run on fake tensors as always, with shapes now known. A boolean mask
with a shadow used as an index becomes the integer indices it selects. The CTC loss (`F.ctc_loss`, speech
models), whose log-probabilities have no shadow, is sized from its target lengths' shadows alone: its tables
grow with the longest target (`ctc_targets`, for the estimate's note). A branch on a boolean without a
shadow (`if x.min() > eps:` of activations) is traced both ways where `isolate.ValueBranches` allows it.

Assumptions (each router call: T rows (tokens) choose k of E experts; a loop over experts visits them in
index order, its backward in reverse):

- ``balanced``, the estimate: token i chooses experts (i*k + j) mod E, j < k, so every expert receives
  T*k/E choices (rounded up or down).
- the bound, the largest peak of three extreme routings, each traced:
  ``collapsed``: every token chooses experts 0..k-1 (router collapse): the k experts visited first each
  receive the whole micro-batch, the others nothing;
  ``first`` / ``last``: expert 0 / expert E-1 receives every token, each token's other k-1 choices are
  spread round-robin over the other experts (every expert runs).
  The bound is never below the balanced peak (a router with a capacity drops the tokens an extreme
  routing sends past it, and can make balanced the worst).
  Why these: for loop-style experts (a slice of tokens per expert) the bytes saved for backward add up to
  the same T*k rows under any routing, while an expert's temporaries grow with the tokens it receives (at
  most T). The peak is then reached with the largest expert's temporaries on top of the most memory
  another part of the step holds at that moment: everything saved before it in forward (``last``), the
  gradients made after it in backward (``collapsed``, ``first``; ``first`` where experts that receive
  nothing are skipped, so never get gradients). It bounds such code, not arbitrary code; a router with a
  capacity (Switch) caps these routings at its capacity, as the real run would.

Only traces whose shapes depended on a router's choice carry an assumption and pay the bound's traces
(`followed`). Where other ops computed on the router's choices but no size depended on them (transformers'
default grouped_mm experts size everything by tokens*k), the estimate says routing is "invariant": a fake
trace that read no value holds for every value, so its peak is the bound too.

Limits: a shadow is kept only up to `SHADOW_LIMIT_BYTES`; beyond it (or where an input has no shadow) the
op runs on fake tensors alone, and a data-dependent op that needs the missing value fails as it would
without this mode (memfit's fallback then decides). Random ops and uninitialised allocations never get
shadows; an in-place op that cannot be followed drops the shadows of everything sharing its storage.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import weakref

import torch
from torch.overrides import TorchFunctionMode

from memfit.errors import EstimateError
from memfit.memory.fake import is_fake
from memfit.memory.isolate import branch
from memfit.memory.tracker import machinery, source_line
from memfit.torch_internals import DATA_DEPENDENT_ERRORS, DEVICE_QUERY, TorchDispatchMode, answer_device_query, \
    storage_key, tree_leaves, unset_fake_temporarily

__all__ = ["ASSUMPTIONS", "BOUND_ROUTINGS", "FLOAT_FACTORY_LIMIT_BYTES", "MAX_CHOICES", "SHADOW_LIMIT_BYTES", "Routing",
           "add_routing", "assumed_choices"]

aten = torch.ops.aten

BOUND_ROUTINGS = ("collapsed", "first", "last")
ASSUMPTIONS = ("balanced", *BOUND_ROUTINGS)
# A selection over more entries than this is not taken as a router: published MoEs choose among 8 (Mixtral)
# to 512 experts; a top-k over a vocabulary or over tokens is something else and keeps fake behaviour.
MAX_CHOICES = 1024
SHADOW_LIMIT_BYTES = 64 * 2**20
FLOAT_FACTORY_LIMIT_BYTES = 2**20  # masks and small tables; parameters made by `torch.zeros` would cost host memory
_SELECTIONS = {aten.topk.default, aten.argmax.default, aten.max.dim}
_NO_VALUE = {aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default, aten.new_empty.default,
             aten.new_empty_strided.default}  # uninitialised memory: a shadow of it would be a made-up value
_BOOL_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}
_EXACT_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_FINITE_CHECKS = {aten.isnan.default: False, aten.isinf.default: False, aten.isposinf.default: False,
                  aten.isneginf.default: False, aten.isfinite.default: True}
_FROM_DATA = {torch.tensor, torch.as_tensor}
_CTC = {aten._ctc_loss.default, aten._ctc_loss.Tensor}
_CTC_BACKWARD = {aten._ctc_loss_backward.default, aten._ctc_loss_backward.Tensor}


class _Held:
    """A strong reference that reads like a weak one (`ref()`), for shadows made while building."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor):
        self.t = t

    def __call__(self) -> torch.Tensor:
        return self.t


@dataclasses.dataclass
class _Shadow:
    fake: weakref.ref | _Held
    value: torch.Tensor
    routers: frozenset  # (k, choices) of the routers whose assumed choice it derives from; empty: exact


class Routing(TorchDispatchMode):
    """Enter it just above the fake mode (after it, below any counting mode): the fake tensors it makes for
    data-dependent outputs are then seen by the counters like any op's output, its own work is not."""

    def __init__(self, assumption: str = "balanced"):
        super().__init__()
        if assumption not in ASSUMPTIONS:
            raise EstimateError(f"routing assumption must be one of {', '.join(ASSUMPTIONS)}, got {assumption!r}")
        self.assumption = assumption
        self.followed: dict[str, int] = {}  # op -> data-dependent results that read an assumed choice
        self.routers: set[tuple[int, int]] = set()  # (k, choices) of the routers those results read
        self.computed: set[tuple[int, int]] = set()  # routers whose choices other ops computed on (not views)
        self.assumed_finite = 0  # finiteness checks answered as "all finite"
        self.assumed_valid = 0  # torch.distributions' argument checks answered as passing
        self.ctc_targets: list[int] = []  # the longest target of each CTC loss traced
        self._drawing = False  # inside drawing(): random factories draw real values too
        self._building = False  # inside building(): shadows hold their tensors strongly (see there)
        self._priming = False  # inside priming(): no shadows made
        self._shadows: dict[int, _Shadow] = {}  # id(fake) -> its shadow
        self._aliases: dict[int, set[int]] = {}  # storage key -> ids of the shadowed fakes sharing that storage

    def __enter__(self):
        self._format = _ShadowValues(self).__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self._format.__exit__(*exc)

    @contextlib.contextmanager
    def drawing(self):
        """Draw the batch: random factories inside it get real values beside their fake outputs."""
        self._drawing = True
        try:
            yield
        finally:
            self._drawing = False

    @contextlib.contextmanager
    def priming(self):
        """Prime the optimizer: its state needs no values, and shadows of it would be real memory (an 8B's
        8-bit moments are integer zeros, ~14 GiB of them under SHADOW_LIMIT_BYTES each)."""
        self._priming = True
        try:
            yield
        finally:
            self._priming = False

    @contextlib.contextmanager
    def building(self):
        """Build the model. Shadows made here hold their tensors strongly, not by a weak reference:
        `torch.utils.swap_tensors` refuses a tensor that has one, so a parameter made by `torch.ones` (a norm's
        weight) could not be moved or cast (`_apply(): Couldn't swap`). `keep_built_values` ends that."""
        self._building = True
        try:
            yield
        finally:
            self._building = False

    def keep_built_values(self, model: torch.nn.Module) -> None:
        """After the build: keep the exact-dtype shadows it made, and of the float ones those of the model's
        buffers (buffers are reassigned when moved, never swapped; parameters are swapped and hold weights);
        each kept one goes back to a weak reference."""
        built = {k: s for k, s in self._shadows.items() if isinstance(s.fake, _Held)}
        buffers = {id(b) for b in model.buffers()}
        for s in built.values():
            self._forget(s.fake())
        for key, s in built.items():
            t = s.fake()
            if t.dtype in _EXACT_DTYPES or key in buffers:
                self._put(t, s.value, s.routers)

    def shadow(self, t: torch.Tensor) -> _Shadow | None:
        s = self._shadows.get(id(t))
        return s if s is not None and s.fake() is t else None

    # -------------------------------------------------------------------------------- the dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is DEVICE_QUERY:
            return answer_device_query(args, kwargs)
        if func is aten._grouped_mm.default:
            return _grouped_mm(*args, **kwargs)
        if self._priming:
            out = func(*args, **kwargs)
            self._forget_mutated(args, kwargs, out)
            return out
        shadow_args = self._shadow_args(args, kwargs)
        try:
            out = func(*args, **kwargs)
        except DATA_DEPENDENT_ERRORS:
            return self._data_dependent(func, args, kwargs, shadow_args)
        if isinstance(out, torch.Tensor) and out.layout is not torch.strided and not out.is_nested:
            raise EstimateError(f"fake tensors do not size sparse tensors ({func.__name__} made a {out.layout} one: "
                                "how many values it holds depends on the data, and PyTorch's fake kernels give "
                                "some none)")
        if shadow_args is not None and func not in _NO_VALUE and _may_shadow(func, args, kwargs, out, self._drawing):
            self._attach(out, self._real(func, shadow_args), shadow_args[2])
            if not func.is_view:
                self.computed |= shadow_args[2]
        elif shadow_args is None and func in _SELECTIONS:
            self._assume(func, args, kwargs, out)
        elif shadow_args is None and _finite_check(func, args) is not None \
                and out.untyped_storage().nbytes() <= SHADOW_LIMIT_BYTES:
            self.assumed_finite += 1
            with unset_fake_temporarily():
                self._put(out, torch.full(out.shape, _finite_check(func, args)), frozenset())
        else:
            self._forget_mutated(args, kwargs, out)
        return out

    def _shadow_args(self, args, kwargs):
        """(args, kwargs, routers) with each fake tensor replaced by its shadow; None if one has none."""
        if self._unshadowed(args) or self._unshadowed(kwargs.values()):  # most ops: one look at the first
            return None
        routers = frozenset()

        def swap(x):
            nonlocal routers
            if isinstance(x, torch.Tensor) and is_fake(x):
                s = self.shadow(x)
                routers |= s.routers
                return s.value
            if isinstance(x, (list, tuple)):
                return type(x)(swap(v) for v in x)
            return x

        return swap(args), {k: swap(v) for k, v in kwargs.items()}, routers

    def _unshadowed(self, xs) -> bool:
        for x in xs:
            if isinstance(x, torch.Tensor):
                if is_fake(x) and self.shadow(x) is None:
                    return True
            elif isinstance(x, (list, tuple)) and self._unshadowed(x):
                return True
        return False

    def _real(self, func, shadow_args):
        """The op on the shadows, outside the fake mode; None where real kernels refuse the values."""
        real_args, real_kwargs, _ = shadow_args
        with unset_fake_temporarily():
            try:
                return func(*real_args, **real_kwargs)
            except Exception:  # noqa: BLE001 - a value the op refuses: no shadow, as without this mode
                return None

    def _attach(self, out, real, routers: frozenset) -> None:
        fakes, reals = _leaves(out), _leaves(real) if real is not None else []
        if len(fakes) != len(reals):
            for t in fakes:
                self._forget(t)
            return
        for f, r in zip(fakes, reals):
            if isinstance(f, torch.Tensor) and is_fake(f):
                if isinstance(r, torch.Tensor) and r.untyped_storage().nbytes() <= SHADOW_LIMIT_BYTES:
                    self._put(f, r, routers)
                else:
                    self._forget(f)

    def _put(self, fake: torch.Tensor, value: torch.Tensor, routers: frozenset) -> None:
        key, storage = id(fake), storage_key(fake)
        if self._building:
            ref = _Held(fake)
        else:
            if key not in self._shadows:
                weakref.finalize(fake, self._drop, key, storage)
            ref = weakref.ref(fake)
        self._shadows[key] = _Shadow(ref, value, routers)
        self._aliases.setdefault(storage, set()).add(key)

    def _drop(self, key: int, storage: int) -> None:
        self._shadows.pop(key, None)
        aliases = self._aliases.get(storage)
        if aliases is not None:
            aliases.discard(key)
            if not aliases:
                del self._aliases[storage]

    def _forget(self, t) -> None:
        """Drop the shadows of every tensor sharing t's storage (t was changed in a way not followed)."""
        if isinstance(t, torch.Tensor) and is_fake(t):
            for key in self._aliases.pop(storage_key(t), ()):
                self._shadows.pop(key, None)

    def _forget_mutated(self, args, kwargs, out) -> None:
        """In-place and out= ops return the tensor they changed (self, or out=)."""
        if not self._shadows:
            return
        for t in (args[0] if args else None, kwargs.get("out")):
            if isinstance(t, torch.Tensor) and any(t is o for o in _leaves(out)):
                self._forget(t)

    # -------------------------------------------------------------------------------- the router
    def _assume(self, func, args, kwargs, out) -> None:
        """Give a router's indices the assumed choices."""
        x = args[0]
        if func is aten.topk.default:
            k = args[1]
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            indices = out[1]
        else:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if dim is None:
                return  # argmax over everything: an index into a flattened tensor, not a routing
            k, indices = 1, (out if func is aten.argmax.default else out[1])
        if x.dim() == 0:
            return
        dim %= x.dim()
        choices = x.shape[dim]
        if not 1 <= choices <= MAX_CHOICES or k > choices or indices.numel() == 0:
            return
        keep = indices.dim() == x.dim()  # topk and keepdim=True keep the selected dimension
        moved = indices.movedim(dim, -1).shape if keep else (*indices.shape, 1)
        rows = indices.numel() // k
        with unset_fake_temporarily():
            value = assumed_choices(self.assumption, rows, k, choices).reshape(moved)
            value = value.movedim(-1, dim) if keep else value.squeeze(-1)
            value = value.to(indices.dtype).contiguous()
        if value.untyped_storage().nbytes() > SHADOW_LIMIT_BYTES:
            return
        self._put(indices, value, frozenset({(k, choices)}))

    # -------------------------------------------------------------------------------- data-dependent ops
    def _data_dependent(self, func, args, kwargs, shadow_args):
        """Answer an op fake tensors refused from the shadows; re-raise where there are none."""
        indexed = self._bool_mask_as_indices(args, kwargs) if func in _BOOL_INDEXED else None
        if indexed is not None:  # `x[mask] = y` changes x in place: the op itself must run
            out = func(*indexed[0], **indexed[1])
            if shadow_args is not None and _may_shadow(func, args, kwargs, out, self._drawing):
                self._attach(out, self._real(func, shadow_args), shadow_args[2])
            else:
                self._forget_mutated(args, kwargs, out)
            return out
        in_place = func.__name__.split(".")[0].endswith("_") or "out" in kwargs
        real = None if shadow_args is None or in_place else self._real(func, shadow_args)
        if real is None:
            if func is aten._local_scalar_dense.default and args[0].dtype == torch.bool:
                if _checks_distribution_arguments():
                    self.assumed_valid += 1
                    return True
                way = branch(source_line().partition(" in ")[0] or "?")  # traced both ways, where it may be
                if way is not None:
                    return way
            ctc = self._ctc(func, args) if func in _CTC or func in _CTC_BACKWARD else None
            if ctc is None:
                raise
            return ctc
        self._follow(str(func).removeprefix("aten.").removesuffix(".default"), shadow_args[2])
        if not isinstance(real, (torch.Tensor, list, tuple)):
            return real  # .item(), bool(), .tolist(): the number itself
        device = next(t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        out = _map(real, lambda r: torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device=device))
        self._attach(out, real, shadow_args[2])
        return out

    def _ctc(self, func, args):
        """The CTC loss (speech models' `F.ctc_loss`): sized by the longest target, which the labels give
        (their shadows, or the lengths as numbers). Forward: the per-sample loss and log-alpha, (batch, input
        length, 2 * longest target + 1), kept for backward; backward: a gradient shaped as the log-probs (its
        log-beta buffer is a kernel workspace: kernels.py). None where the target lengths are not known."""
        log_probs, lengths = args[0], args[3]
        if isinstance(lengths, torch.Tensor):
            if is_fake(lengths):
                shadow = self.shadow(lengths)
                if shadow is None:
                    return None
                lengths = shadow.value
            with unset_fake_temporarily():
                lengths = lengths.tolist()
        if func in _CTC_BACKWARD:
            return torch.empty_like(log_probs)
        batch, longest = log_probs.shape[1], max(lengths, default=0)  # (input length, batch, classes)
        self.ctc_targets.append(longest)
        return log_probs.new_empty((batch,)), log_probs.new_empty((batch, log_probs.shape[0], 2 * longest + 1))

    def _bool_mask_as_indices(self, args, kwargs):
        """`x[mask]` / `x[mask] = y` with a shadowed boolean mask: the integer indices the mask selects."""
        indices = args[1]
        new, routers = [], frozenset()
        for i in indices:
            s = self.shadow(i) if isinstance(i, torch.Tensor) else None
            if s is not None and i.dtype in (torch.bool, torch.uint8):
                with unset_fake_temporarily():
                    cols = s.value.nonzero().unbind(1)
                for c in cols:
                    f = torch.empty(c.shape, dtype=c.dtype, device=i.device)
                    self._put(f, c, s.routers)
                    new.append(f)
                routers |= s.routers
            else:
                new.append(i)
        if len(new) == len(indices) and all(a is b for a, b in zip(new, indices)):
            return None
        self._follow("boolean mask index", routers)
        return (args[0], new, *args[2:]), kwargs

    def _follow(self, op: str, routers: frozenset) -> None:
        """A data-dependent result was read from shadows; count it if it depends on a router's choice."""
        if routers:
            self.followed[op] = self.followed.get(op, 0) + 1
            self.routers |= routers


class _ShadowValues(TorchFunctionMode):
    """Two reads of values that bypass the dispatcher, answered from shadows:
    - `f"{t}"` of a 0-dim tensor formats its number, but `Tensor.__format__` does that for plain tensors
      only: a fake one formats as its repr. Switch Transformers picks each expert as `self[f"expert_{i}"]`.
    - `torch.tensor([t0, t1])` of a list of tensors copies their values in C++, which a fake tensor has not
      (Qwen2-VL's M-RoPE offsets, one 0-dim tensor per row): the shadows' values are copied instead."""

    def __init__(self, routing: Routing):
        super().__init__()
        self.routing = routing

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__format__ and is_fake(args[0]) and args[0].dim() == 0:
            s = self.routing.shadow(args[0])
            if s is not None:
                self.routing._follow("format", s.routers)
                return s.value.item().__format__(args[1])
        if func in _FROM_DATA and args and isinstance(args[0], (list, tuple)):
            data = self._values(args[0])
            if data is not None:
                args = (data, *args[1:])
        return func(*args, **(kwargs or {}))

    def _values(self, data):
        """`data` with each fake tensor in it replaced by its shadow's value; None where one has none."""
        out = []
        for x in data:
            if isinstance(x, (list, tuple)):
                x = self._values(x)
            elif isinstance(x, torch.Tensor) and is_fake(x):
                s = self.routing.shadow(x)
                if s is not None:
                    self.routing._follow("tensor", s.routers)
                x = s.value if s is not None else None
            if x is None:
                return None
            out.append(x)
        return out


_DISTRIBUTION = os.path.join("torch", "distributions", "distribution.py")
_VALIDATING = frozenset({"__init__", "_validate_sample"})


def _checks_distribution_arguments() -> bool:
    """Whether the boolean asked for is torch.distributions' validation of its arguments: the innermost
    frame outside memfit and torch's own code, or torch's distribution.py on the way to it, is one of its
    checks (`if not torch._is_all_true(valid): raise ValueError(...)`)."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.endswith(_DISTRIBUTION):
            return frame.f_code.co_name in _VALIDATING
        if not machinery(filename):
            return False
        frame = frame.f_back
    return False


def assumed_choices(assumption: str, rows: int, k: int, choices: int) -> torch.Tensor:
    """(rows, k) int64 expert choices under `assumption` (module docstring); each row's k are distinct."""
    i = torch.arange(rows).unsqueeze(1)
    if assumption == "balanced":
        return (i * k + torch.arange(k)) % choices
    if assumption == "collapsed":
        return torch.arange(k).expand(rows, k)
    # first / last: one expert takes every row; the other k-1 choices go round-robin over the rest
    rest = (i * (k - 1) + torch.arange(k - 1)) % max(choices - 1, 1)
    if assumption == "first":
        return torch.cat([torch.zeros(rows, 1, dtype=torch.long), rest + 1], dim=1)
    return torch.cat([torch.full((rows, 1), choices - 1), rest], dim=1)


def _finite_check(func, args) -> bool | None:
    """The answer of a finiteness check when every value is finite; None if `func` is not one. `x == x` and
    `x != x` are NaN checks too (torch.distributions' argument validation spells them so)."""
    if func in _FINITE_CHECKS:
        return _FINITE_CHECKS[func]
    if func in (aten.eq.Tensor, aten.ne.Tensor) and len(args) == 2 and args[0] is args[1] \
            and args[0].dtype.is_floating_point:
        return func is aten.eq.Tensor
    return None


def _may_shadow(func, args, kwargs, out, drawing: bool) -> bool:
    """Shadows are small, made only of values known without data, or of the batch while it is drawn; floating
    ones smaller still (module doc)."""
    fakes = [t for t in _leaves(out) if isinstance(t, torch.Tensor) and is_fake(t)]
    if not fakes or any(t.untyped_storage().nbytes() > SHADOW_LIMIT_BYTES for t in fakes):
        return False
    if drawing:
        return True
    if torch.Tag.nondeterministic_seeded in func.tags:
        return False
    return all(t.dtype in _EXACT_DTYPES or t.untyped_storage().nbytes() <= FLOAT_FACTORY_LIMIT_BYTES for t in fakes)


def _leaves(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _map(x, fn):
    return type(x)(fn(v) for v in x) if isinstance(x, (list, tuple)) else fn(x)


def _grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """aten._grouped_mm (transformers' default experts, `torch.nn.functional.grouped_mm`) for any float dtype.
    torch 2.13's meta kernel copies the CUDA fast path's bf16-only check, but the CPU kernel and the CUDA
    fallback for other dtypes (and GPUs before sm90) compute the same output, one mm per group into it.
    The output's shape follows the meta kernel; its size never depends on `offs`' values."""
    if mat_a.dtype == torch.bfloat16 and mat_b.dtype == torch.bfloat16:
        return aten._grouped_mm.default(mat_a, mat_b, offs, bias, out_dtype)
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if a2 and b2:
        size = (offs.shape[0], mat_a.shape[0], mat_b.shape[1])
    elif a2:
        size = (mat_a.shape[0], mat_b.shape[-1])
    elif b2:
        size = (mat_a.shape[1], mat_b.shape[1])
    else:
        size = (mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1])
    return torch.empty(size, dtype=out_dtype or mat_a.dtype, device=mat_a.device)


def add_routing(est, routing: Routing, trace_again) -> None:
    """Fill `est.routing` (and a note) after a step traced under balanced routing, if a router took part.
    Where the step's shapes followed the router's choices, `trace_again()` (one more traced step, returning
    its Estimate; None: no bound) is run under each of BOUND_ROUTINGS and the largest figures kept."""
    routers = ", ".join(f"top-{k} of {e}" for k, e in sorted(routing.routers or routing.computed))
    if not routing.followed:
        if routing.computed:  # e.g. grouped_mm experts: every tensor sized by tokens x k
            est.routing = {"assumption": "invariant", "routers": routers, "bound_peak_bytes": est.peak_bytes,
                           "bound_device_peak_bytes": est.device_peak_bytes}
            est.notes.append(f"top-k choices made from values ({routers}: MoE routing, or any top-k over few "
                             "entries) decide no tensor's size in this model: the peak holds for any choices")
        return
    est.routing = {"assumption": "balanced", "routers": routers, "followed": dict(routing.followed)}
    est.notes.append(f"tensor sizes depend on top-k choices made from values ({routers}: MoE routing, or any top-k "
                     f"over few entries; read by {', '.join(sorted(routing.followed))}): estimated with balanced "
                     "routing, every expert receiving tokens x k / experts of each micro-batch; the bound is the "
                     "worst of three extreme routings (k experts take every token; the first or the last expert "
                     "takes every token)")
    if trace_again is None:
        return
    traced = {"balanced": est}  # a router with a capacity drops tokens of extreme routings: balanced may be worst
    for assumption in BOUND_ROUTINGS:
        routing.assumption = assumption
        traced[assumption] = trace_again()
    routing.assumption = "balanced"
    worst = max(traced, key=lambda a: traced[a].peak_bytes)
    device = [e.device_peak_bytes for e in traced.values() if e.device_peak_bytes is not None]
    est.routing.update(bound_peak_bytes=traced[worst].peak_bytes, bound_routing=worst,
                       bound_device_peak_bytes=max(device) if device else None)
