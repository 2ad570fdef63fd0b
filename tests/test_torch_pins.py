"""Pins for the private PyTorch pieces memfit relies on (wrapped in memfit/memory/fake.py and tracker.py).
If a torch upgrade moves or changes one of them, these fail before any estimate silently goes wrong."""
import weakref

import torch
import torch.nn.functional as F

from memfit.memory.fake import FakeTensor, FlopCounterMode, is_fake, new_fake_mode


def test_fake_tensors_have_storages_with_stable_identity_and_finalisers():
    freed = []
    with new_fake_mode():
        x = torch.randn(1000)
        assert is_fake(x) and isinstance(x, FakeTensor)
        st = x.untyped_storage()
        assert st.nbytes() == 4000
        assert x.untyped_storage() is st and x.view(10, 100).untyped_storage()._cdata == st._cdata
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
    timeline = p._memory_profile().timeline
    assert timeline and {a.name for _, a, _, _ in timeline} >= {"CREATE", "DESTROY"}


def test_data_dependent_ops_are_refused_by_fake_tensors():
    """memfit falls back to real steps exactly when this happens; if torch starts to follow these ops,
    the fallback tests would stop exercising the fallback."""
    import pytest

    with new_fake_mode():
        x = torch.randn(10)
        with pytest.raises(Exception):
            (x > 0).nonzero()
        with pytest.raises(Exception):
            x.sum().item()
