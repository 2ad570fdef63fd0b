"""Pins for the private PyTorch pieces memfit relies on, every one behind memfit/torch_internals.py.
If a torch upgrade moves or changes one of them, these fail before any estimate silently goes wrong."""
import contextlib
import logging
import weakref

import pytest
import torch
import torch.nn.functional as F

from memfit import torch_internals as ti
from memfit.memory.fake import FakeTensor, FlopCounterMode, is_fake, new_fake_mode


def test_the_shim_exports_only_what_is_pinned_here():
    pinned = {"FAKE_TENSOR_LOGGER", "FakeTensor", "FakeTensorMode", "TorchDispatchMode", "grad_scaler_tensors",
              "profiler_memory_timeline", "profiler_surviving_allocations", "storage_key", "tree_leaves"}
    pinned |= {"DataDependentOutputException", "make_op_outputs_swappable"}  # modules and optimizers on fake
    pinned |= {"autocast_disabled", "autocast_kernel_ops"}  # CUDA autocast's policy on a CPU trace
    pinned |= {"detach_sharing_version", "tensor_version"}  # selective checkpointing's kept outputs
    pinned |= {"profiler_call_allocations"}  # CPU convolution workspaces, measured
    pinned |= {"fake_constant", "fake_constants_up_to", "trunc_normal_skipped", "unset_fake_temporarily"}  # builds
    pinned |= {"DATA_DEPENDENT_ERRORS"}  # MoE routing on fake tensors
    pinned |= {"fake_process_group", "held_by", "profiler_allocations"}  # per-rank estimates and their truth
    pinned |= {"compiled_modules"}  # torch.compile'd models are said to be traced eagerly
    pinned |= {"ACCUMULATE_GRAD", "autograd_node_name", "FILLED_IN_PLACE"}  # in place on a plain step
    pinned |= {"ddp_bucket_assignment", "replicate"}  # DDP
    pinned |= {"memory_history", "memory_snapshot", "memory_viz"}  # allocator snapshots (doctor, gpu_check)
    pinned |= {"import_dynamo"}  # forked tracing children inherit it
    pinned |= {"DEVICE_QUERY", "answer_device_query"}  # answered unrecorded by every mode
    pinned |= {"fast_cache_keys"}  # a fifth of every op's cost
    pinned |= {"fast_cache_entries", "fast_cache_size", "add_fast_cache_entries"}  # children pass them on
    pinned |= {"function_modes", "function_modes_again"}  # checkpoint's recompute, as its forward ran
    pinned |= {"keep_tensors_on_unchanged_conversion"}  # a fake model's `.to()` in its forward
    pinned |= {"stand_ins_for_rng_state_copies"}  # checkpoint()'s RNG-state copies, wherever it runs
    pinned |= {"storage_uses", "current_autograd_node"}  # autograd's gradient sums, in place where a real step's are
    pinned |= {"WAIT_TENSOR"}  # DTensor's collectives on fake tensors (tensor parallelism)
    pinned |= {"mesh_concatenation_on_real_tensors"}  # FSDP2 over TP's DTensor parameters on fake tensors
    pinned |= {"p2p_works_hold_tensors", "static_pipeline_metadata"}  # pipeline schedules in a fake world
    assert set(ti.__all__) == pinned


def test_dynamo_imports_as_fake_tracing_needs():
    import sys

    ti.import_dynamo()
    assert "torch._dynamo" in sys.modules


def test_fake_tensors_have_storages_with_stable_identity_and_finalisers():
    freed = []
    with new_fake_mode():
        x = torch.randn(1000)
        assert is_fake(x) and isinstance(x, FakeTensor)
        st = x.untyped_storage()
        assert st.nbytes() == 4000
        assert x.untyped_storage() is st and ti.storage_key(x.view(10, 100)) == ti.storage_key(st)
        assert ti.storage_key(torch.randn(1000)) != ti.storage_key(x)
        weakref.finalize(st, lambda: freed.append(True))
        del st
        y = x[:10]
        del x
        assert freed == []  # a view keeps the storage alive
        del y
    assert freed == [True]


def test_fake_cpu_attention_uses_the_flash_kernel_and_its_flops_are_counted():
    with new_fake_mode(), FlopCounterMode(display=False) as fc:
        q = torch.randn(2, 4, 128, 32, requires_grad=True)
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    ops = {str(op) for op in fc.get_flop_counts()["Global"]}
    assert "aten._scaled_dot_product_flash_attention_for_cpu" in ops
    assert fc.get_total_flops() == 2 * 2 * 4 * 128 * 128 * 32 * (2 + 5)


def test_profiler_memory_timeline_is_available():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as p:
        x = torch.randn(256, 256, requires_grad=True)
        (x @ x).sum().backward()
    timeline = ti.profiler_memory_timeline(p)
    assert timeline and {a.name for _, a, _, _ in timeline} >= {"CREATE", "DESTROY"}


def test_data_dependent_ops_are_refused_by_fake_tensors():
    """memfit falls back to real steps exactly when this happens; if torch starts to follow these ops,
    the fallback tests would stop exercising the fallback."""

    with new_fake_mode():
        x = torch.randn(10)
        with pytest.raises(Exception):
            (x > 0).nonzero()
        with pytest.raises(Exception):
            x.sum().item()


def test_storage_key_identifies_real_storages_shared_by_views():
    x = torch.zeros(16)
    assert ti.storage_key(x[4:]) == ti.storage_key(x) != ti.storage_key(x.clone())


def test_storage_uses_count_views_and_autograd_sums_a_gradient_in_place_only_outside_dispatch_modes():
    """What memory.tracker.PlainPaths relies on: autograd's engine sums two gradients of one tensor into the
    buffer it alone holds (add_), but under a dispatch mode (or on fake tensors) makes a new tensor (add)."""
    x = torch.zeros(16)
    alone = ti.storage_uses(x)
    view = x[4:]
    assert ti.storage_uses(x) == alone + 1 and ti.storage_uses(view) == alone + 1

    w = torch.randn(8, 100, requires_grad=True)
    y = w.exp()
    loss = (y[:, :60] * 2).sum() + (y[:, 40:] * 3).sum()  # two slices: two gradients of y, summed
    with torch.profiler.profile() as prof:
        loss.backward(retain_graph=True)
    assert "aten::add_" in {e.name for e in prof.events()}
    spy, w.grad = _Spy(), None
    with spy:
        loss.backward()
    assert torch.ops.aten.add.Tensor in spy.seen and torch.ops.aten.add_.Tensor not in spy.seen


def test_the_engine_sums_a_nodes_gradients_after_its_post_hooks_with_it_current():
    """What PlainPaths' `summing` relies on: y is used twice, so the second gradient to reach it is added to
    the first after the node that made it ran its post-hooks, while that node is still the current one; a
    node's own ops run under it before its hooks; the current node is the wrapper `next_functions` gave."""
    x = torch.randn(3, requires_grad=True)
    y = x.exp()
    loss = (y.sin() * y.cos()).sum()
    nodes, todo = [], [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in nodes:
            nodes.append(node)
            todo += [n for n, _ in node.next_functions]
    log = []
    for node in nodes:
        node.register_hook(lambda grad_inputs, grad_outputs, name=node.name(): log.append(("hook", name)))

    class Current(ti.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            node = ti.current_autograd_node()
            log.append((func, node.name() if node is not None else None, any(node is n for n in nodes)))
            return func(*args, **(kwargs or {}))

    with Current():
        loss.backward()
    adds = [i for i, entry in enumerate(log) if entry[0] is torch.ops.aten.add.Tensor]
    assert len(adds) == 1 and log[adds[0] - 1][0] == "hook"
    assert log[adds[0]][1:] == (log[adds[0] - 1][1], True)  # the hooked node, as the wrapper held here
    assert ti.current_autograd_node() is None


class _Spy(ti.TorchDispatchMode):
    """Lists every op dispatched while it is active (`seen`)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_a_dispatch_mode_sees_ops_below_autograd_and_pytree_flattens_nested_outputs():
    x = torch.randn(4, requires_grad=True)
    with _Spy() as spy:
        (x * 2).sum().backward()
    assert torch.ops.aten.mul.Tensor in spy.seen and torch.ops.aten.expand.default in spy.seen  # sum's backward
    a, b = torch.ones(1), torch.zeros(2)
    assert ti.tree_leaves({"k": [a, (b, 3)]}) == [a, b, 3]


def test_a_fake_tensors_device_is_dispatched_as_the_pinned_op_and_a_real_ones_is_not():
    real = torch.randn(4, requires_grad=True)
    with new_fake_mode() as mode:
        fake = mode.from_tensor(real)
        with _Spy() as spy:
            (fake * 2).sum().backward()
            assert fake.device == torch.device("cpu")
    assert spy.seen.count(ti.DEVICE_QUERY) > 1  # autograd's own queries and the one above
    with _Spy() as spy:
        (real * 2).sum().backward()
        assert real.device == torch.device("cpu")
    assert spy.seen and ti.DEVICE_QUERY not in spy.seen


def test_a_device_query_is_answered_as_the_fake_mode_answers_it():
    with new_fake_mode() as mode:
        on_cpu, on_gpu = mode.from_tensor(torch.ones(2)), torch.ones(2, device="cuda")
        for fake in (on_cpu, on_gpu):
            with _Spy() as spy:
                assert ti.answer_device_query((fake,), {}) == ti.DEVICE_QUERY(fake) == fake.device
            assert spy.seen == [ti.DEVICE_QUERY]  # only the op itself: the answer dispatched nothing
    assert on_gpu.device == torch.device("cuda", 0)
    assert ti.answer_device_query((torch.ones(1),), {}) == torch.device("cpu")


def test_grad_scaler_tensors_are_the_scale_and_growth_tracker():
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    assert ti.grad_scaler_tensors(scaler) == []  # nothing until a loss is scaled
    scaler.scale(torch.ones(()))
    scale, tracker = ti.grad_scaler_tensors(scaler)
    assert scale.item() == 256.0 == scaler.get_scale() and tracker.item() == 0


def test_profiler_sees_an_ops_surviving_allocations():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
        y = torch.randn(1000)
    assert ti.profiler_surviving_allocations(p, "aten::randn") == [[4000]]
    del y


def test_data_dependent_ops_raise_the_pinned_errors_and_real_ops_run_with_the_fake_mode_unset():
    """memory/routing.py answers exactly these errors, from values it computes with the fake mode unset."""
    with new_fake_mode():
        choice = torch.zeros(4, 2, dtype=torch.long)
        with pytest.raises(ti.DATA_DEPENDENT_ERRORS[0]):
            choice.nonzero()
        with pytest.raises(ti.DATA_DEPENDENT_ERRORS[1]):
            choice.sum().item()
        with ti.unset_fake_temporarily():
            real = torch.tensor([0, 3]).nonzero()
        assert not is_fake(real) and real.tolist() == [[1]]


def test_fake_tensor_errors_are_logged_under_the_pinned_logger_name():
    assert ti.FAKE_TENSOR_LOGGER in logging.Logger.manager.loggerDict


def test_fake_modules_move_only_once_op_outputs_are_not_memoised():
    """A plain FakeTensorMode keeps a weak reference to the outputs of an op's first call, which makes
    `Module.to()` fail to swap such a parameter (PEFT moves every adapter layer it makes). If this starts to
    pass without `make_op_outputs_swappable`, torch fixed it and the shim can go."""
    with ti.FakeTensorMode(allow_non_fake_inputs=True):
        layer = torch.nn.Linear(3, 5)
        with pytest.raises(RuntimeError, match="Couldn't swap"):
            layer.to(torch.float64)
    mode = ti.FakeTensorMode(allow_non_fake_inputs=True)
    ti.make_op_outputs_swappable(mode)
    with mode:
        layer = torch.nn.Linear(3, 5)
        assert not weakref.getweakrefs(layer.weight)
        layer.to(torch.float64)
        assert is_fake(layer.weight) and layer.weight.dtype == torch.float64
        assert isinstance(layer.weight, torch.nn.Parameter) and layer.weight.requires_grad


def test_an_unchanged_conversion_swaps_fake_parameters_unless_the_model_keeps_them():
    """torch swaps a fake parameter on `.to()` even when nothing changes; once the graph uses it the swap
    poisons its gradient accumulator and backward raises (a recomputed block of switch_transformers converts
    its router in its forward). If the first half starts to pass, torch stopped swapping and the shim can go."""
    mode = ti.FakeTensorMode(allow_non_fake_inputs=True)
    ti.make_op_outputs_swappable(mode)
    with mode:
        model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
        loss = model(torch.randn(4, 3)).sum()
        model[0].to(torch.float32)
        with pytest.raises(RuntimeError, match="poisoned by swap_tensors"):
            loss.backward()

        model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
        ti.keep_tensors_on_unchanged_conversion(model)
        weight = model[0].weight
        loss = model(torch.randn(4, 3)).sum()
        assert model[0].to(torch.float32) is model[0] and model[0].weight is weight
        model.float()
        loss.backward()
        assert model[0].weight.grad.shape == (5, 3)
        del loss, weight
        for p in model.parameters():
            p.grad = None
        copies = []

        class Copies(ti.TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                copies.extend([func] if func is torch.ops.aten._to_copy.default else [])
                return func(*args, **(kwargs or {}))

        with Copies():
            model[1].to(torch.float64)  # a conversion that changes something is torch's, as before
        assert len(copies) == 2  # the weight and the bias, each converted once (the check's copy is used)
        assert model[1].weight.dtype == torch.float64 and model[0].weight.dtype == torch.float32
        assert isinstance(model[1].weight, torch.nn.Parameter) and is_fake(model[1].weight)
    real = torch.nn.Linear(3, 5)
    ti.keep_tensors_on_unchanged_conversion(real)
    assert "_apply" not in vars(real)  # real parameters are never swapped: left alone


def test_fast_cache_keys_answer_as_a_fresh_dispatch_would_and_leave_the_rest_to_torch():
    """Under `fast_cache_keys`, with torch's cross-check on (each cache hit compared with a fresh dispatch:
    dtype, shape, strides, storage offset, views' bases), a step with views, scalars of each type, dtype and
    list arguments and keyword arguments runs twice and its second run is all hits; 1, 1.0 and True are told
    apart (int64, float32, bool), as are bf16 and fp16 tensors (same storage size); a tensor with a constant
    still bypasses the cache as torch decides."""
    mode = ti.FakeTensorMode(allow_non_fake_inputs=True)
    ti.fast_cache_keys(mode)
    mode.cache_crosscheck_enabled = True

    def step():
        x = torch.randn(5, 7, 11, requires_grad=True)  # shapes no other test uses: the cache is process-wide
        y = x[:, 2:5].transpose(0, 1).reshape(3, 55) * 2.5 + 1
        z = torch.cat([y, y.to(torch.bfloat16).float()], dim=0).sum(dim=(0,), keepdim=True, dtype=torch.float64)
        w = x[:, 2].unsqueeze(0) + x[:, 3].unsqueeze(0)  # views alike but for their storage offset
        (z.mean() + F.softmax(x, dim=-1).sum() + w.sum()).backward()
        same_but_dtype = torch.ones(4, 9, dtype=torch.bfloat16) + 1, torch.ones(4, 9, dtype=torch.float16) + 1
        return torch.full((2,), 1), torch.full((2,), 1.0), torch.full((2,), True), same_but_dtype, x.grad

    with mode:
        step()
        hits, misses = ti.FakeTensorMode.cache_hits, ti.FakeTensorMode.cache_misses
        ints, floats, bools, (in_bf16, in_fp16), grad = step()
    assert ti.FakeTensorMode.cache_misses == misses and ti.FakeTensorMode.cache_hits - hits >= 20
    assert (ints.dtype, floats.dtype, bools.dtype) == (torch.int64, torch.float32, torch.bool)
    assert (in_bf16.dtype, in_fp16.dtype) == (torch.bfloat16, torch.float16)
    assert grad.shape == (5, 7, 11) and is_fake(grad)
    bypassed = ti.FakeTensorMode.cache_bypasses["constant attribute"]
    constant = ti.fake_constant(mode, torch.ones(3))
    with mode:
        constant + 1
    assert ti.FakeTensorMode.cache_bypasses["constant attribute"] == bypassed + 1


def test_cache_entries_a_child_learned_answer_in_its_parent_as_a_fresh_dispatch_would(tmp_path):
    """The entries a forked tracing child adds under memfit's keys come back to the parent (ops by name:
    an OpOverload does not pickle) and answer there, cross-checked against a fresh dispatch, with no miss."""
    from memfit.memory.isolate import run_isolated

    def step():
        x = torch.randn(3, 13, 17, requires_grad=True)  # shapes no other test uses: the cache is process-wide
        y = (x.transpose(1, 2) @ x).softmax(-1).sum() + F.gelu(x[:, 1:]).mean()
        y.backward()
        return x.grad

    def in_child():
        mode = ti.FakeTensorMode(allow_non_fake_inputs=True)
        ti.fast_cache_keys(mode)
        with mode:
            step()
        return ti.fast_cache_size()

    before = ti.fast_cache_size()
    grown = run_isolated(in_child)
    assert ti.fast_cache_size() == grown > before + 10
    mode = ti.FakeTensorMode(allow_non_fake_inputs=True)
    ti.fast_cache_keys(mode)
    mode.cache_crosscheck_enabled = True
    misses, hits = ti.FakeTensorMode.cache_misses, ti.FakeTensorMode.cache_hits
    with mode:
        grad = step()
    assert ti.FakeTensorMode.cache_misses == misses and ti.FakeTensorMode.cache_hits - hits >= 10
    assert grad.shape == (3, 13, 17) and is_fake(grad)
    assert ti.fast_cache_entries(ti.fast_cache_size()) == ti.fast_cache_entries(10**9)  # nothing new: empty


def test_a_transformers_step_traced_with_fast_keys_is_cross_checked_and_estimated_as_with_torchs(monkeypatch):
    """A whole traced step of a model memfit did not write (transformers' Llama, bf16 for an H100: autocast,
    SDPA, the optimizer's foreach kernels) with torch's cross-check on every cache hit, and the same estimate
    to the byte and op for op with torch's own keys."""
    import memfit
    from memfit.memory import fake
    from memfit.memory.estimate import probe
    from memfit.workloads import builtin

    pytest.importorskip("transformers")
    wl, config = builtin("hf:llama"), memfit.Config(micro_batch=2, precision="bf16")

    def cross_checked(mode):
        ti.fast_cache_keys(mode)
        mode.cache_crosscheck_enabled = True

    monkeypatch.setattr(fake, "fast_cache_keys", cross_checked)
    fast = probe(wl, config, "h100", isolate=False)
    monkeypatch.setattr(fake, "fast_cache_keys", lambda mode: None)
    slow = probe(wl, config, "h100", isolate=False)
    assert fast.estimate.method == slow.estimate.method == "fake"
    assert fast.estimate.peak_bytes == slow.estimate.peak_bytes
    assert fast.ops.bytes == slow.ops.bytes and fast.ops.name == slow.ops.name


def test_checkpoints_recompute_drops_function_modes_and_they_can_be_pushed_again():
    """torch.utils.checkpoint recomputes from backward without the TorchFunctionModes its forward ran under
    (if this starts to see the mode, torch carries them and `function_modes_again` can go); pushed again by
    the recompute context, the recompute sees them, and they are gone after."""
    from torch.overrides import TorchFunctionMode
    from torch.utils.checkpoint import checkpoint

    class Seen(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def block(x):
        seen.append([type(m).__name__ for m in ti.function_modes()])
        return x.sin().cos()

    def contexts():
        return contextlib.nullcontext(), ti.function_modes_again(ti.function_modes())

    for context_fn, recomputed in ((None, []), (contexts, ["Seen"])):
        seen: list = []
        x = torch.randn(3, requires_grad=True)
        with Seen():
            kwargs = {"context_fn": context_fn} if context_fn else {}
            checkpoint(block, x, use_reentrant=False, **kwargs).sum().backward()
        assert seen == [["Seen"], recomputed] and ti.function_modes() == []


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_copies_the_rng_state_through_torch_get_rng_state_outside_the_dispatcher(reentrant):
    """A checkpointed block with dropout: one copy made beside the forward and kept until backward, and one
    more (fork_rng's) while the block is recomputed, each through `torch.get_rng_state` looked up at call time,
    neither seen by a dispatch mode. The stand-ins live exactly as long as the copies."""
    seen, live = [], []

    class Factories(ti.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    def stand_in(nbytes):
        t = torch.empty(nbytes, dtype=torch.uint8)
        live.append(weakref.ref(t))
        return t

    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5))
    x, nbytes = torch.randn(4, 8, requires_grad=True), torch.get_rng_state().numel()
    with ti.stand_ins_for_rng_state_copies(stand_in):
        with Factories():
            y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=reentrant)
        assert len(live) == 1 and live[0]() is not None and live[0]().numel() == nbytes
        y.sum().backward()
        del y  # the graph, which a reentrant checkpoint's saved copy belongs to
    assert len(live) == 2 and all(ref() is None for ref in live)
    assert not any("rng" in str(f) for f in seen)


def test_a_value_read_from_a_fake_tensor_raises_the_pinned_exception():
    """OptimizerScalars answers exactly this exception of this op."""
    with new_fake_mode():
        x = torch.randn(4)
        with pytest.raises(ti.DataDependentOutputException) as e:
            x.norm().item()
    assert e.value.func is torch.ops.aten._local_scalar_dense.default


def test_autocast_kernels_are_listed_per_dispatch_key():
    """Even a CPU-only build registers CUDA autocast's kernels: memfit checks its CUDA lists against them."""
    cuda, cpu = ti.autocast_kernel_ops("AutocastCUDA"), ti.autocast_kernel_ops("AutocastCPU")
    assert {"mm", "softmax.int", "layer_norm", "sum.dim_IntList", "binary_cross_entropy"} <= cuda
    assert {"mm", "cat", "cross_entropy_loss"} <= cpu and "softmax.int" not in cpu and "relu" not in cuda | cpu
    assert "mm.out" not in cuda and "add.Tensor" not in cuda  # out= variants and untouched ops: no kernel


def test_autocast_disabled_excludes_autocast_for_what_runs_inside():
    x = torch.randn(2, 2)
    with torch.autocast("cpu", dtype=torch.float16):
        with ti.autocast_disabled():
            assert (x @ x).dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
        assert (x @ x).dtype == torch.float16 and torch.is_autocast_enabled("cpu")


def test_a_detach_inside_a_dispatch_mode_can_share_the_version_counter():
    """Selective checkpointing keeps detached matmul outputs and must see them modified in place later. A
    plain detach inside a TorchDispatchMode gets a counter of its own; if that ever changes, the shim can go."""
    kept = []

    class Keep(ti.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.mm.default:
                kept.extend([out.detach(), ti.detach_sharing_version(out)])
            return out

    x = torch.randn(3, 3, requires_grad=True)
    with Keep():
        y = x @ x
    before = [ti.tensor_version(t) for t in kept]
    y.mul_(2)
    plain, shared = kept
    assert ti.tensor_version(plain) == before[0] and ti.tensor_version(shared) == before[1] + 1 == ti.tensor_version(y)
    assert shared.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() and not shared.requires_grad


def test_fake_constants_carry_values_and_keep_them_through_small_ops_only_under_a_raised_limit():
    """FakeBuild computes drop-path schedules from fake constants. torch keeps an op's values on fake
    constants only up to CONSTANT_NUMEL_LIMIT elements (1): without a raised limit a split schedule loses
    them; if torch changes either, this fails."""
    mode, real = new_fake_mode(), torch.linspace(0, 0.3, 4)
    with mode:
        rates = ti.fake_constant(mode, real)
        assert is_fake(rates) and rates[2].item() == pytest.approx(0.2)
        with ti.fake_constants_up_to(8):
            assert rates.split([1, 3])[1].tolist() == pytest.approx([0.1, 0.2, 0.3])
        with pytest.raises(Exception, match="_local_scalar_dense"):
            (rates * 2).tolist()
        with pytest.raises(Exception, match="_local_scalar_dense"):  # and a view over the limit drops the base's values
            rates.split([1, 3])[1].tolist()


def test_real_tensors_can_be_made_inside_a_fake_mode():
    with new_fake_mode():
        with ti.unset_fake_temporarily():
            real = torch.arange(3)
        assert not is_fake(real) and real.tolist() == [0, 1, 2] and is_fake(torch.arange(3))


def test_trunc_normal_reads_values_and_can_be_skipped_for_chosen_tensors():
    """`trunc_normal_` loops on `mask.any()` (stops a fake trace) and returns at once for meta tensors; the
    shim makes it return at once for the tensors it is told, through the private sampler that every caller
    of the public function reaches."""
    with new_fake_mode():
        w = torch.empty(64, 64)
        with pytest.raises(Exception, match="_local_scalar_dense"):
            torch.nn.init.trunc_normal_(w)
        with ti.trunc_normal_skipped(is_fake):
            assert torch.nn.init.trunc_normal_(w) is w
    real = torch.empty(1000)
    with ti.trunc_normal_skipped(is_fake):
        torch.nn.init.trunc_normal_(real, std=1.0, a=-2.0, b=2.0)  # real tensors are still sampled
    assert real.abs().max() <= 2.0 and real.std() > 0.5


def test_profiler_lists_each_calls_allocations_in_order():
    """A call's allocations and frees, in order: their running total's highest point is what the kernel held
    while it ran, and what is left is its output (here a matmul that allocates one 64 KiB result)."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(128, 128)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
        y = torch.mm(x, x)
    [calls] = ti.profiler_call_allocations(p, "aten::mm")
    assert calls and sum(calls) == y.untyped_storage().nbytes() == 128 * 128 * 4


def test_a_fake_world_runs_fsdp2_on_fake_tensors_and_dtensors_are_held_by_their_shards():
    """One process as rank 0 of 8: FSDP2 shards fake parameters (dim 0 padded to a multiple of 8), and its
    collectives run as aten ops a dispatch mode sees, with outputs of the full size."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    seen = []

    class Ops(ti.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen.append((str(func), [t.shape for t in ti.tree_leaves(out) if isinstance(t, torch.Tensor)]))
            return out

    with ti.fake_process_group(8):
        mesh = init_device_mesh("cpu", (8,))  # on real tensors: it reads the ranks' numbers
        with new_fake_mode():
            layer = fully_shard(torch.nn.Linear(4, 30), mesh=mesh)
            assert dist.get_world_size() == 8 and dist.get_rank() == 0
            (local,) = ti.held_by(layer.weight)
            assert layer.weight.shape == (30, 4) and local.shape == (4, 4)  # ceil(30 / 8) rows on rank 0
            assert ti.storage_key(layer.weight) == ti.storage_key(local)
            with Ops():
                layer(torch.randn(2, 4)).sum().backward()
    assert not dist.is_initialized()
    gathers = [shapes for op, shapes in seen if op == "c10d._allgather_base_.default"]
    assert gathers and gathers[0][0] == (8 * (4 * 4 + 4),)  # weight + bias shards, padded, from every rank
    assert any(op == "c10d._reduce_scatter_base_.default" for op, _ in seen)
    assert ti.held_by(torch.ones(3))[0].shape == (3,)


def test_fsdp2_over_a_tp_split_parameter_joins_the_meshes_only_on_real_tensors():
    """FSDP2 joins its axis and a DTensor parameter's with the private `DeviceMesh._concatenate`, whose rank lookup
    (`nonzero` on a new mesh tensor) has no static shape on fake tensors: the shim runs it on real ones, and the
    parameter is sharded over both axes (a quarter of the rows on rank 0 of a 2 x 2 mesh)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    with ti.fake_process_group(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "tp"))
        with new_fake_mode():
            layer = parallelize_module(torch.nn.Linear(4, 8), mesh["tp"], ColwiseParallel())
            other = parallelize_module(torch.nn.Linear(4, 8), mesh["tp"], ColwiseParallel())
            with pytest.raises(ti.DATA_DEPENDENT_ERRORS):  # without the shim
                fully_shard(other, mesh=mesh["shard"])
            with ti.mesh_concatenation_on_real_tensors():
                fully_shard(layer, mesh=mesh["shard"])
            (local,) = ti.held_by(layer.weight)
            assert layer.weight.shape == (8, 4) and local.shape == (2, 4)


def test_a_real_world_after_a_fake_one_in_this_process_gets_its_own_mesh():
    """DTensor caches sharding decisions process-wide, keyed by specs whose meshes compare equal across
    worlds of the same shape; leaving a fake world empties those caches. Without that, two gloo ranks forked
    after a fake-world FSDP2 step of the same layer both held rank 0's coordinate (and rows)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from truth import on_gloo_ranks

    def step(mesh):
        layer = fully_shard(torch.nn.Linear(4, 30), mesh=mesh)
        layer(torch.ones(2, 4)).sum().backward()
        return layer

    with ti.fake_process_group(2):
        mesh = init_device_mesh("cpu", (2,))
        with new_fake_mode():
            step(mesh)

    def on_rank(rank):
        layer = step(init_device_mesh("cpu", (2,)))
        return layer.weight.device_mesh.get_coordinate(), layer.weight.grad.device_mesh.get_coordinate()

    assert on_gloo_ranks(2, on_rank) == [((0,), (0,)), ((1,), (1,))]


def test_profiler_reports_the_cpu_allocators_running_total_and_recorded_ranges():
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        a = torch.ones(1000)
        with record_function("pin.window"):
            b = torch.ones(2000)
            del b
    windows, events = ti.profiler_allocations(prof, "pin.")
    base = events[0][2] - events[0][1]
    assert len(windows) == 1 and [(size, total - base, op) for _, size, total, op, _ in events] == [
        (4000, 4000, "aten::ones"), (8000, 12000, "aten::ones"), (-8000, 4000, "")]
    assert events[1][4] == events[2][4] != events[0][4]  # the block's address, at allocation and at free
    assert windows[0][0] <= events[1][0] <= events[2][0] <= windows[0][1] and a.numel() == 1000


def test_ddp_buckets_close_at_the_first_cap_then_the_bucket_cap():
    """DDP's assignment: in the order given, a bucket closes once it holds at least its cap (about 1 MiB for
    the first, then the given cap), one dtype per bucket."""
    params = [torch.empty(n) for n in (100, 300_000, 50, 200_000, 7_000_000, 10)]  # fp32: 4 bytes each
    assert ti.ddp_bucket_assignment(params, 25 * 2**20) == [[0, 1], [2, 3, 4], [5]]
    mixed = [torch.empty(10), torch.empty(10, dtype=torch.bfloat16), torch.empty(10)]
    assert sorted(ti.ddp_bucket_assignment(mixed, 25 * 2**20)) == [[0, 2], [1]]


def test_replicate_is_ddp_in_place_with_gradients_in_one_bucket(tmp_path):
    """A one-rank gloo world: the module keeps its class and parameter names; after backward every
    gradient is a view into DDP's one flat bucket (gradient_as_bucket_view)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        names = [n for n, _ in model.named_parameters()]
        assert ti.replicate(model, gradient_as_bucket_view=True) is model
        assert isinstance(model, torch.nn.Sequential) and [n for n, _ in model.named_parameters()] == names
        model(torch.randn(3, 4)).sum().backward()
        storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
        assert len(storages) == 1
        assert model[0].weight.grad.untyped_storage().nbytes() == 4 * sum(p.numel() for p in model.parameters())
    finally:
        dist.destroy_process_group()


def test_allocator_history_snapshot_and_viewer_are_where_the_shim_looks():
    import inspect

    params = inspect.signature(torch.cuda.memory._record_memory_history).parameters
    assert {"enabled", "stacks", "max_entries"} <= set(params)
    assert callable(torch.cuda.memory._snapshot) and callable(torch.cuda.memory._dump_snapshot)
    viz = ti.memory_viz()
    assert all(callable(getattr(viz, name)) for name in ("segsum", "trace", "segment_plot"))


def test_a_sparse_gradients_parts_and_accumulate_grads_copy_of_it():
    """What held_by and the tracker's `_keeps_sparse_gradient` rely on: a sparse embedding's gradient is an
    uncoalesced COO tensor (`indices()` refuses it) whose `_indices()` / `_values()` are dense tensors with
    storages; AccumulateGrad keeps it without a copy when only the engine holds it (its values are the
    incoming gradient's bytes), and under a dispatch mode copies it, with the AccumulateGrad node current."""
    emb = torch.nn.Embedding(10, 4, sparse=True)
    ids, g = torch.tensor([[1, 2, 1]]), torch.randn(1, 3, 4)
    emb(ids).backward(g)
    grad = emb.weight.grad
    assert grad.layout is torch.sparse_coo and not grad.is_coalesced()
    with pytest.raises(RuntimeError, match="coalesced"):
        grad.indices()
    indices, values = ti.held_by(grad)
    assert indices.shape == (1, 3) and values.shape == (3, 4) and indices.untyped_storage().nbytes() == 3 * 8
    assert values.data_ptr() == g.data_ptr()  # kept as the engine made it
    assert ti.storage_key(grad) == ti.storage_key(values)
    copies = []

    class Spy(ti.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.clone.default and args[0].layout is torch.sparse_coo:
                copies.append(ti.autograd_node_name())
            return func(*args, **(kwargs or {}))

    emb.weight.grad = None
    out = emb(ids)
    with Spy():
        out.backward(g)
    assert copies == [ti.ACCUMULATE_GRAD] and emb.weight.grad._values().data_ptr() != g.data_ptr()


def test_compiled_modules_finds_what_torch_compile_wraps_and_what_it_compiles_in_place():
    """The two ways a model is compiled: `torch.compile(module)` returns a wrapper (OptimizedModule) over it,
    `module.compile()` compiles that module in place. Neither runs anything until called."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert ti.compiled_modules(model) == []
    assert ti.compiled_modules(torch.compile(model)) == [""]
    model[1].compile()
    assert ti.compiled_modules(model) == ["1"]


_FILLERS = {  # a forward that makes each FILLED_IN_PLACE node, from x (8, 16)
    "GatherBackward0": lambda x: x.gather(0, torch.randint(0, 8, (4, 16))),
    "CummaxBackward0": lambda x: x.cummax(1).values, "CumminBackward0": lambda x: x.cummin(1).values,
    "IndexSelectBackward0": lambda x: x.index_select(0, torch.tensor([1, 3, 3])),
    "IndexBackward0": lambda x: x[torch.tensor([1, 3, 3])],
    "MaskedSelectBackward0": lambda x: x.masked_select(x.detach() > 0),
    "TakeBackward0": lambda x: x.take(torch.tensor([1, 30, 30])),
    "MaxBackward0": lambda x: x.max(1).values, "MinBackward0": lambda x: x.min(1).values,
    "TopkBackward0": lambda x: x.topk(3, 1).values, "SortBackward0": lambda x: x.sort(1).values,
    "KthvalueBackward0": lambda x: x.kthvalue(3, 1).values, "MedianBackward1": lambda x: x.median(1).values,
    "NanmedianBackward1": lambda x: x.nanmedian(1).values, "ModeBackward0": lambda x: x.mode(1).values,
}


@pytest.mark.parametrize("op,node", [(op, node) for op, nodes in ti.FILLED_IN_PLACE.items() for node in sorted(nodes)])
def test_these_backward_formulas_fill_their_zeros_in_place_only_without_a_mode(op, node):
    """What the tracker's `_fills_in_place` relies on: the backward formula runs as `node` (its class name),
    calls `op` (out of place) under a dispatch mode with that node current, and on a plain step calls the
    in-place op instead, as the profiler shows."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(8, 16, requires_grad=True)
    y = _FILLERS[node](x)
    assert type(y.grad_fn).__name__ == node
    seen = []

    class Spy(ti.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append((func, ti.autograd_node_name()))
            return func(*args, **(kwargs or {}))

    with Spy():
        torch.autograd.grad(y, x, torch.ones_like(y), retain_graph=True)
    assert (op, node) in seen
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.autograd.grad(y, x, torch.ones_like(y))
    names = {e.name for e in prof.events()}
    name = op.__name__.split(".")[0]
    in_place = "aten::_index_put_impl_" if op is torch.ops.aten.index_put.default else f"aten::{name}_"
    assert in_place in names and f"aten::{name}" not in names


def test_a_functional_collectives_wait_is_the_pinned_op_and_its_fake_kernel_makes_a_second_tensor():
    """DTensor's redistributions end in this wait; the real op returns the tensor it waited on, its meta kernel a
    new one, which memfit's fix_fake_outputs replaces with the input (else every gathered tensor counts twice)."""
    import torch.distributed._functional_collectives  # noqa: F401 - registers the op and its meta kernel

    from memfit.memory.kernels import fix_fake_outputs

    op = torch.ops._c10d_functional.wait_tensor.default
    assert str(op) == ti.WAIT_TENSOR
    with new_fake_mode():
        x = torch.empty(8, 4)
        out = op(x)
        assert ti.storage_key(out) != ti.storage_key(x)
        assert fix_fake_outputs(op, (x,), {}, out) is x


def _names_used(code) -> set[str]:
    """Global names a function reads, its nested functions' included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _names_used(const)
    return names


def test_pipeline_schedules_send_through_the_module_level_batch_p2p_and_vote_on_shapes_in_warmup_p2p():
    """p2p_works_hold_tensors swaps schedules._batch_p2p, which every schedule memfit runs must look up as a
    module global when it sends or receives (single-stage 1F1B and GPipe through _sorted_batch_p2p, the
    multi-stage runtime of the interleaved schedules directly); static_pipeline_metadata replaces the start-up shape vote, `_warmup_p2p`, which
    `_initialize_pp_stages` calls. The runtime keeps its send works in a list it drains after the last action."""
    import inspect

    from torch.distributed.pipelining import schedules

    assert "_batch_p2p" in _names_used(schedules._sorted_batch_p2p.__code__)  # the single-stage schedules' way
    for kind in (schedules.ScheduleGPipe, schedules.Schedule1F1B, schedules.ScheduleInterleaved1F1B,
                 schedules.ScheduleInterleavedZeroBubble):
        assert {"_batch_p2p", "_sorted_batch_p2p"} & _names_used(kind._step_microbatches.__code__), kind
    assert callable(schedules._batch_p2p)
    assert "_warmup_p2p" in _names_used(schedules._PipelineSchedule._initialize_pp_stages.__code__)
    assert list(inspect.signature(schedules._PipelineSchedule._warmup_p2p).parameters) == [
        "self", "stages", "has_backward", "p2p_done"]
    runtime = inspect.getsource(schedules._PipelineScheduleRuntime._step_microbatches)
    assert "send_ops.append(_batch_p2p(" in runtime and "while send_ops:" in runtime
