"""`plan`'s stages, each run on its own on gpt-tiny with 4 blocks: the search space, the state floors, the
probes, the candidates, their confirmation, and the choice (or "nothing fits")."""
import pytest

import memfit.planner.search as search
from memfit import Config
from memfit.errors import PlanError
from memfit.memory.devices import get_device
from memfit.memory.estimate import Phase, state_bytes
from memfit.planner.costmodel import Profile, describe
from memfit.planner.search import (MARGIN, _AtCount, _candidates, _choose, _confirm, _count_free, _family_name,
                                   _Family, _floors, _nothing_fits, _probe_families, _probes, _Search, _search_space,
                                   _state_key, check_allow, resolve_budget)
from memfit.units import fmt_bytes, parse_size
from memfit.workloads import builtin

FLAT = Profile(device="test", kind="cpu", source="fixed test figures",
               matmul={"f32": [[1e6, 1e-5], [1e12, 10.0]], "lp": [[1e6, 2e-5], [1e12, 20.0]]},
               bandwidth=20e9, op_overhead=5e-6, link_bandwidth=float("inf"))
GPT = builtin("gpt-tiny", layers=4)


def searching(global_batch=8, device="cpu", budget="1GiB", host=None, allow=(), **fixed) -> search._Search:
    dev = get_device(device)
    return _Search(GPT, global_batch, dev, check_allow(allow), budget_bytes=resolve_budget(budget, dev),
                   host_bytes=parse_size(host) if host else None, rates=lambda: FLAT, **fixed)


@pytest.fixture(scope="module")
def families() -> dict:
    """gpt-tiny's fp32 families without and with checkpointing, probed on this CPU."""
    bases = [Config(micro_batch=1, precision="fp32", activation_checkpoint=ck) for ck in ("none", "all")]
    probed = _probe_families(GPT, bases, get_device("cpu"), None, "probing")
    assert [kind for kind, _ in probed] == ["ok", "ok"]
    return {b: fam for b, (_, fam) in zip(bases, probed)}


def test_search_space_crosses_the_open_choices_and_notes_the_techniques_allowed():
    s = searching(device="h100", allow=["paged-optim"], precision="bf16", activation_checkpoint="all",
                  offload_activations=False)
    base, paged = Config(micro_batch=1, precision="bf16", activation_checkpoint="all"), dict(
        optimizer_8bit=True, paged_optimizer=True)
    # no paged states with optimizer offload; the chunked loss with checkpointing "all"
    assert _search_space(s, ["none"]) == [
        base, base.replace(loss_chunks=8), base.replace(**paged), base.replace(loss_chunks=8, **paged),
        base.replace(offload_optimizer=True), base.replace(offload_optimizer=True, loss_chunks=8)]
    assert len(s.notes) == 2 and s.notes[0].startswith(f"{MARGIN:.0%} of the budget is kept free")
    assert s.notes[1].startswith("paged 8-bit optimizer states allowed")
    s = searching(device="h100")  # open: bf16-pure too, offloaded activations only without checkpointing
    bases = _search_space(s, ["none"])
    assert {b.precision for b in bases} == {"bf16", "bf16-pure"}
    assert {b.activation_checkpoint for b in bases if b.offload_activations} == {"none"}
    assert any(n.startswith("fp32 not searched on a GPU") for n in s.notes)


def test_floors_rescue_a_family_over_by_its_gradients_and_hold_offloading_to_the_host_memory():
    """gpt-tiny on an H100 just under bf16's state floor, with 1 MiB of host memory: the families on the GPU fit
    only with the optimizer step in backward (no gradient buffer), the offloaded ones are over the host's."""
    h100 = get_device("h100")
    floor = state_bytes(GPT, Config(precision="bf16"), h100)
    s = searching(device="h100", budget=int((floor - 1) / (1 - MARGIN)), host="1MiB", precision="bf16",
                  activation_checkpoint="all", offload_activations=False)
    bases = _search_space(s, ["none"])
    kept, floors, depth = _floors(s, list(bases))
    on_gpu = [b for b in bases if not b.offload_optimizer]
    assert kept == [b.replace(optimizer_in_backward=True) for b in on_gpu] and depth is None
    assert all(floors[_state_key(b.replace(optimizer_in_backward=True))] <= s.usable < floors[_state_key(b)]
               for b in on_gpu)
    offloaded = [_family_name(b) for b in bases if b.offload_optimizer]
    assert [v.split(":")[0] + ("; traced that way" if v.endswith("traced that way") else "")
            for _, v in s.verdicts] == ["does not fit; traced that way"] * 2 + ["does not fit the host"] * 2
    assert list(s.host_need) == offloaded and all(need > 2**20 for need in s.host_need.values())


def test_probes_reuse_a_family_traced_at_another_count_and_step_in_backward_where_it_would_accumulate():
    """gpt-tiny, global batch 16, fp32: probed once (and kept in `traced`); on a budget the whole batch is
    over but its forward pass is not, the family is reused from `traced` and its step in backward probed."""
    base = Config(micro_batch=1, precision="fp32")
    floors, traced = {_state_key(base): 10**7}, {}
    families, failed = _probes(searching(16, precision="fp32", activation_checkpoint="none"), [base], floors,
                               None, traced)
    fam = families[base]
    assert isinstance(fam, _Family) and failed == [] and list(families) == [base]
    assert traced[_count_free(base)] == (fam, base, 10**7)
    forward = fam.memory(16, 1, True, phases={Phase.FORWARD: fam.phases(16, 1)[Phase.FORWARD]})
    whole = fam.memory(16, 1, True)
    assert forward < whole
    s = searching(16, budget=int((forward + whole) / 2 / (1 - MARGIN)), precision="fp32",
                  activation_checkpoint="none")
    families, failed = _probes(s, [base], floors, None, traced)
    in_backward = base.replace(optimizer_in_backward=True)
    assert list(families) == [base, in_backward] and failed == []
    assert isinstance(families[base], _AtCount) and families[base].family is fam
    assert isinstance(families[in_backward], _Family) and families[in_backward].base == in_backward


def test_candidates_are_every_micro_batch_and_every_k_that_fit_fastest_first(families):
    none, full = families.values()
    s = searching(precision="fp32")
    candidates = _candidates(s, dict(families))
    # micro-batches 1, 2, 4, 8 of each family, and every 2nd block of 4 checkpointed
    assert sorted((str(c.config.activation_checkpoint), c.config.micro_batch) for c in candidates) == sorted(
        (ck, m) for ck in ("none", "all", "2") for m in (1, 2, 4, 8))
    assert all(c.config.global_batch == 8 and not c.confirmed for c in candidates)
    assert [c.step_seconds for c in candidates] == sorted(c.step_seconds for c in candidates)
    every2 = next(c for c in candidates if c.config.activation_checkpoint == 2 and c.config.micro_batch == 4)
    assert every2.peak_bytes == int(none.memory(4, 2, True) + (full.memory(4, 2, True) - none.memory(4, 2, True)) / 2)
    s = searching(budget=int(none.memory(2, 4, True) / (1 - MARGIN)) - 2, precision="fp32")
    candidates = _candidates(s, dict(families))
    assert candidates and all(c.peak_bytes <= s.usable for c in candidates)
    assert not any(c.config.activation_checkpoint == "none" and c.config.micro_batch >= 2 for c in candidates)
    assert s.smallest_need == {_family_name(b): fam.memory(1, 8, True) for b, fam in families.items()}


def test_confirmation_drops_a_candidate_its_full_estimate_refutes(families, monkeypatch):
    s = searching(precision="fp32")
    candidates = _candidates(s, dict(families))
    fastest, next_three, real = candidates[0], candidates[1:4], search.full_probe
    predicted = [(c.config, c.step_seconds) for c in candidates]

    def refuting(workload, config, dev):
        p = real(workload, config, dev)
        if config == fastest.config:
            p.estimate.peak_bytes = s.usable + 1
        return p

    def seconds_off_by(extra):  # the full estimate's step time: the prediction plus `extra`
        return lambda profile, p, config, dev: next(t for c, t in predicted if c == config) + extra

    monkeypatch.setattr(search, "full_probe", refuting)
    monkeypatch.setattr(search, "_seconds", seconds_off_by(1000.0))
    confirmed = _confirm(s, candidates, 2)  # in twos: the fastest refuted, its partner and the next two confirmed
    assert sorted(map(id, confirmed)) == sorted(map(id, next_three)) and fastest not in candidates
    assert all(c.confirmed and c.estimate is not None and c.peak_bytes == c.estimate.peak_bytes for c in confirmed)
    assert [c.step_seconds for c in confirmed] == sorted(c.step_seconds for c in confirmed)
    label = f"{_family_name(fastest.config)}, micro-batch {fastest.config.micro_batch}"
    assert s.verdicts == [(label, f"predicted to fit, but the full estimate needs {fmt_bytes(s.usable + 1)}")]
    monkeypatch.setattr(search, "full_probe", lambda *a: pytest.fail("confirm=0 estimates nothing"))
    assert _confirm(s, candidates, 0) == candidates[:1]

    # confirmed as fast as predicted, the refuted one's partner beats every prediction left: no second round
    s = searching(precision="fp32")
    candidates = _candidates(s, dict(families))
    monkeypatch.setattr(search, "full_probe", refuting)
    monkeypatch.setattr(search, "_seconds", seconds_off_by(0.0))
    assert _confirm(s, candidates, 2) == [candidates[0]] and candidates[0].config == next_three[0].config


def test_the_choice_says_a_verdict_for_every_family(families):
    s = searching(precision="fp32")
    candidates = _candidates(s, dict(families))
    best = candidates[0]
    p = _choose(s, families, candidates, best)
    assert (p.config, p.peak_bytes, p.step_seconds, p.confirmed) == (best.config, best.peak_bytes,
                                                                     best.step_seconds, False)
    assert p.samples_per_second == 8 / best.step_seconds and p.profile_source == describe(FLAT)
    assert p.alternatives == [c for c in candidates if c is not best][:5]
    assert p.families[0] == (_family_name(best.config), f"chosen at micro-batch {best.config.micro_batch}")
    verdicts = dict(p.families)
    for base in families:
        v = verdicts[_family_name(base)]
        assert v.startswith("chosen") or v.startswith("fits, ") and "x slower (best at micro-batch" in v


def test_nothing_fits_says_the_least_budget_and_host_memory_needed():
    s = searching(budget="1MiB", host="2MiB")
    with pytest.raises(PlanError) as said:
        _nothing_fits(s, {})
    assert str(said.value) == "nothing fits in 1 MiB on cpu for a global batch of 8: no family could be traced"
    s.smallest_need.update(a=3 * 2**20, b=2 * 2**20)
    s.host_need.update(c=5 * 2**20, d=4 * 2**20)
    with pytest.raises(PlanError) as said:
        _nothing_fits(s, {})
    assert str(said.value) == (
        f"nothing fits in 1 MiB on cpu for a global batch of 8: the smallest configuration tried needs at least "
        f"{fmt_bytes(2 * 2**20 / (1 - MARGIN))} of budget; 2 families that offload to the host were ruled out by "
        "--host-memory 2 MiB (the least needs 4 MiB of host memory; not traced)")
