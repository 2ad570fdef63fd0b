"""The snapshot doctor on layouts made by memfit's allocator model, whose free blocks are worked out by hand
from the allocator's rules, and the OOM message parser on both wordings PyTorch has used."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from collections import OrderedDict

import pytest
import torch

from memfit.errors import ConfigError
from memfit.memory.allocator import CachingAllocator
from memfit.memory.devices import context_bytes_for
from memfit.memory.snapshot import explain_oom, explain_snapshot, parse_oom_message, read_snapshot, render

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

USER = {"filename": "/home/me/train.py", "line": 12, "name": "step"}
TORCH = {"filename": "/opt/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py", "line": 125,
         "name": "forward"}
STDLIB = {"filename": "/usr/lib/python3.11/contextlib.py", "line": 81, "name": "inner"}
CPP = {"filename": "/pytorch/c10/cuda/CUDACachingAllocator.cpp", "line": 900, "name": "c10::cuda::malloc"}


def checkerboard(big: int | None = 12 * MiB, record_trace: bool = False) -> CachingAllocator:
    """Twenty 4 MiB tensors fill four 20 MiB segments (five each, the fifth takes the unsplit 4 MiB tail);
    freeing every other one leaves ten separate 4 MiB holes (40 MiB), no two adjacent. A request of
    `big` then fits no hole and gets a segment of its own."""
    a = CachingAllocator(record_trace=record_trace)
    for i in range(20):
        a.malloc(i, 4 * MiB, frames=[CPP, TORCH, USER])
    for i in range(1, 20, 2):
        a.free(i)
    if big:
        a.malloc("big", big, frames=[STDLIB, {"filename": "/home/me/train.py", "line": 30, "name": "step"}])
    return a


def test_model_snapshot_has_the_fields_pytorch_writes():
    snap = checkerboard().snapshot()
    assert set(snap) == {"segments", "device_traces"} and snap["device_traces"] == [[]]
    seg = snap["segments"][0]
    assert {"device", "address", "total_size", "allocated_size", "active_size", "requested_size", "stream",
            "segment_type", "blocks"} <= set(seg)
    assert {"address", "size", "requested_size", "state", "frames"} <= set(seg["blocks"][0])
    assert [s["total_size"] for s in snap["segments"]] == [20 * MiB] * 4 + [12 * MiB]
    assert {s["segment_type"] for s in snap["segments"]} == {"large"}
    for s in snap["segments"]:
        assert sum(b["size"] for b in s["blocks"]) == s["total_size"]
        offsets = [b["address"] - s["address"] for b in s["blocks"]]
        assert offsets == [sum(b["size"] for b in s["blocks"][:i]) for i in range(len(s["blocks"]))]
        assert s["allocated_size"] == sum(b["size"] for b in s["blocks"] if b["state"] == "active_allocated")
    # first segment: live, hole, live, hole, live, 4 MiB each
    assert [b["state"] for b in snap["segments"][0]["blocks"]] == ["active_allocated", "inactive"] * 2 + [
        "active_allocated"]


def test_fragmented_snapshot_names_the_largest_free_block_and_advises():
    r = explain_snapshot(checkerboard().snapshot(), context_bytes=context_bytes_for((9, 0)))
    assert (r.allocated, r.reserved, r.unallocated) == (52 * MiB, 92 * MiB, 40 * MiB)
    assert (r.free_in_segments, r.free_blocks, r.largest_free) == (40 * MiB, 10, 4 * MiB)
    assert r.fragmentation == pytest.approx(0.9)
    assert (r.small_segments, r.large_segments, r.releasable) == (0, 5, 0)
    assert r.nvidia_smi == 92 * MiB + 500 * MiB
    assert [(s.where, s.bytes, s.blocks) for s in r.top] == [
        ("/home/me/train.py:12 in step", 40 * MiB, 10), ("/home/me/train.py:30 in step", 12 * MiB, 1)]
    assert r.advice[0] == ("The cache is fragmented: 40 MiB free inside segments would hold the largest live tensor "
                           "(12 MiB) but its largest free block is 4 MiB, so tensors that large take new segments; "
                           "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True so the allocator can map free pages "
                           "into one range.")
    assert any("largest long-lived buffers first" in a for a in r.advice)
    assert any("empty_cache() would hand back nothing" in a for a in r.advice)
    text = render(r)
    assert "largest 4 MiB" in text and "592 MiB" in text and "expandable_segments" in text
    snap = checkerboard().snapshot()
    for seg in snap["segments"]:
        seg["is_expandable"] = True
    assert "expandable_segments is already on" in explain_snapshot(snap).advice[0]


def test_unfragmented_snapshots_get_no_fragmentation_advice():
    full = CachingAllocator()
    for i in range(20):
        full.malloc(i, 4 * MiB)      # four 20 MiB segments, exactly full
    full.malloc("s", 3 * KiB)        # one small segment, mostly free: 2 MiB - 3 KiB in one block
    r = explain_snapshot(full.snapshot())
    assert (r.free_in_segments, r.largest_free, r.reserved) == (2 * MiB - 3 * KiB, 2 * MiB - 3 * KiB, 82 * MiB)
    assert r.advice == () and r.fragmentation == 0
    assert "advice: none" in render(r)
    # lots of free memory in holes, but every hole holds the largest tensor the run makes: the cache works
    holes = explain_snapshot(checkerboard(big=None).snapshot())
    assert (holes.free_in_segments, holes.largest_free, holes.largest_live) == (40 * MiB, 4 * MiB, 4 * MiB)
    assert not any("expandable" in a or "fragment" in a.lower() for a in holes.advice)
    # 1 MiB holes in the small pool cannot serve the 4 MiB tensor, and the small pool's own tensors fit them
    pools = CachingAllocator()
    for i in range(20):
        pools.malloc(i, 1 * MiB)     # two per 2 MiB small segment
    for i in range(1, 20, 2):
        pools.free(i)
    pools.malloc("big", 4 * MiB)
    r = explain_snapshot(pools.snapshot())
    assert (r.free_in_segments, r.largest_free, r.largest_live) == (26 * MiB, 16 * MiB, 4 * MiB)
    assert not any("expandable" in a or "fragment" in a.lower() for a in r.advice)


def test_oom_in_the_trace_is_compared_with_the_largest_free_block():
    snap = checkerboard(big=None, record_trace=True).snapshot()
    snap["device_traces"][0].append({"action": "oom", "size": 12 * MiB, "device_free": 2 * MiB, "stream": 0,
                                     "frames": [USER]})
    r = explain_snapshot(snap)
    assert (r.oom.requested, r.oom.device_free, r.oom.free_in_pool, r.oom.largest_free) == (
        12 * MiB, 2 * MiB, 40 * MiB, 4 * MiB)
    assert r.oom.fragmentation
    assert r.advice[0].startswith("Fragmentation caused the OOM") and "expandable_segments:True" in r.advice[0]
    assert "OOM: a 12 MiB request failed with 2 MiB free" in render(r)
    # a request larger than all free memory together is real use: 64 - 40 - 2 = 22 MiB short
    snap["device_traces"][0][-1]["size"] = 64 * MiB
    r = explain_snapshot(snap)
    assert not r.oom.fragmentation
    assert "needed 22 MiB more than was free" in r.advice[0]
    assert not any("expandable" in a for a in r.advice)
    # a snapshot dumped after the failing frames let go of their tensors no longer shows the failure
    snap["device_traces"][0][-1]["size"] = 4 * MiB
    assert explain_snapshot(snap).advice[0].startswith("This snapshot was taken after memory was freed")


def test_snapshot_round_trips_through_a_pickle_file(tmp_path):
    snap = checkerboard(record_trace=True).snapshot()
    path = tmp_path / "snapshot.pickle"
    with open(path, "wb") as f:
        pickle.dump(snap, f)       # what torch.cuda.memory._dump_snapshot does
    assert read_snapshot(path) == snap
    assert explain_snapshot(str(path)) == explain_snapshot(snap)


def test_bad_snapshot_files_raise_one_line_config_errors(tmp_path):
    garbage, hostile, wrong = tmp_path / "garbage", tmp_path / "hostile", tmp_path / "wrong"
    garbage.write_bytes(b"not a pickle at all")
    hostile.write_bytes(pickle.dumps(OrderedDict(segments=[])))  # names a class: refused, never imported
    wrong.write_bytes(pickle.dumps({"segments": [{"total_size": 1}]}))
    for path, match in [(garbage, "not a readable snapshot"), (hostile, "plain data only"),
                        (wrong, "lacks total_size or blocks"), (tmp_path / "missing", "cannot read snapshot")]:
        with pytest.raises(ConfigError, match=match) as e:
            explain_snapshot(path)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="expected a dict with a 'segments' list"):
        read_snapshot({"blocks": []})
    two = checkerboard().snapshot()
    two["segments"][0]["device"] = 1
    with pytest.raises(ConfigError, match="devices 0, 1: choose one"):
        explain_snapshot(two)
    assert explain_snapshot(two, device=1).reserved == 20 * MiB


def test_pytorchs_own_viewers_accept_the_model_snapshot():
    from memfit.torch_internals import memory_viz

    viz = memory_viz()
    snap = checkerboard(record_trace=True).snapshot()
    summary = viz.segsum(snap)   # checks allocated + free == reserved for every segment
    assert "total_reserved: 92.0MiB" in summary and "total_free: 40.0MiB" in summary
    events = viz.trace(snap)     # replays alloc / free_requested / free_completed / segment_alloc
    assert "46 entries" in events        # 5 segments, 21 allocations, 10 frees of two events each
    assert (events.count("cudaMalloc("), events.count("del "), events.count("# free completed")) == (5, 10, 10)
    assert "snapshot.pickle" in viz.segment_plot(snap)


def test_trace_records_what_pytorch_records():
    a = CachingAllocator(record_trace=True)
    a.malloc("x", 1000, frames=[USER])
    a.free("x")
    assert [(e["action"], e["addr"], e["size"]) for e in a.trace] == [
        ("segment_alloc", 0, 2 * MiB), ("alloc", 0, 1000), ("free_requested", 0, 1000), ("free_completed", 0, 1000)]
    assert a.trace[1]["frames"] == [USER]
    assert CachingAllocator().trace is None


NEW = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
       "79.15 GiB of which 1.02 GiB is free. Including non-PyTorch memory, this process has 78.1 GiB memory in use. "
       "Of the allocated memory 75.30 GiB is allocated by PyTorch, and 1.20 GiB is reserved by PyTorch but "
       "unallocated. If reserved but unallocated memory is large try setting "
       "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
       "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
OLD = ("RuntimeError: CUDA out of memory. Tried to allocate 36.00 MiB (GPU 0; 7.93 GiB total capacity; 130.35 MiB "
       "already allocated; 47.06 MiB free; 188.00 MiB reserved in total by PyTorch) If reserved memory is >> "
       "allocated memory try setting max_split_size_mb to avoid fragmentation.")


def test_parse_the_current_oom_message():
    p = parse_oom_message(NEW)
    assert p == {"device": 0, "requested": 2 * GiB, "total": 84986665370, "free": 1095216660,
                 "in_use": 83859236454, "processes": {}, "allowed": None, "allocated": 80852759347,
                 "private_pools": 0, "reserved_unallocated": 1288490189}
    # wrapped over lines as tracebacks print it, in 2.1's spelling, with other processes, a cap and CUDA graphs
    text = ("CUDA out of memory. Tried to allocate 512.00 MiB. GPU 1 has a total capacty of 79.10 GiB of\n"
            "which 300.00 MiB is free. Process 4242 has 2.00 GiB memory in use. Process 4343 has 76.50 GiB memory\n"
            "in use. 78.00 GiB allowed; Of the allocated memory 70.00 GiB is allocated by PyTorch, with 1.00 GiB "
            "allocated in private pools (e.g., CUDA Graphs), and 4.00 GiB is reserved by PyTorch but unallocated.")
    p = parse_oom_message(text)
    assert (p["device"], p["requested"], p["total"], p["free"]) == (1, 512 * MiB, 84932978278, 300 * MiB)
    assert (p["in_use"], p["processes"], p["allowed"]) == (None, {4242: 2 * GiB, 4343: 76 * GiB + 512 * MiB}, 78 * GiB)
    assert (p["allocated"], p["private_pools"], p["reserved_unallocated"]) == (70 * GiB, 1 * GiB, 4 * GiB)
    assert parse_oom_message("... of which 0 bytes is free ...") is None
    assert parse_oom_message("RuntimeError: shapes cannot be multiplied") is None


def test_parse_the_pre_2_1_oom_message():
    assert parse_oom_message(OLD) == {
        "device": 0, "requested": 36 * MiB, "total": 8514772664, "free": 49345987, "in_use": None, "processes": {},
        "allowed": None, "allocated": 136681882, "private_pools": 0, "reserved_unallocated": 188 * MiB - 136681882}


def test_explain_oom_tells_fragmentation_from_real_use():
    tipped = explain_oom(parse_oom_message(NEW))  # 1.02 GiB free + 1.2 GiB cached >= 2 GiB > either
    assert tipped[1].startswith("Fragmentation tipped it") and "expandable_segments:True" in tipped[1]
    assert len(tipped) == 2                       # 79.15 - 1.02 - 78.1 GiB: no other process worth a line
    caused = explain_oom(parse_oom_message(OLD))  # 57.6 MiB cached >= the 36 MiB asked
    assert caused[1].startswith("Fragmentation caused it")
    assert caused[2].startswith("7.7 GiB of the GPU is outside PyTorch's allocator")
    used = explain_oom(parse_oom_message(
        "CUDA out of memory. Tried to allocate 8.00 GiB. GPU 0 has a total capacity of 23.64 GiB of which 1.50 GiB "
        "is free. Including non-PyTorch memory, this process has 18.00 GiB memory in use. Of the allocated memory "
        "17.00 GiB is allocated by PyTorch, and 512.00 MiB is reserved by PyTorch but unallocated."))
    assert "needs 6 GiB more than is free" in used[1]            # 8 - 1.5 - 0.5
    assert used[2].startswith("Other processes use 4.14 GiB")    # 23.64 - 1.5 - 18
    assert not any("expandable" in line for line in used)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_real_snapshot_matches_the_model(tmp_path):
    """The same checkerboard on the real allocator, in a fresh process so that no earlier test's cache is
    reused: PyTorch's own snapshot must show the layout the model predicts, and the doctor the same holes."""
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ:
        pytest.skip("the model covers the default allocator settings only")
    path = tmp_path / "real.pickle"
    script = f"""if True:
        import json, torch
        keep = [torch.empty(4 << 20, dtype=torch.uint8, device="cuda") for _ in range(20)]
        del keep[1::2]
        keep.append(torch.empty(12 << 20, dtype=torch.uint8, device="cuda"))
        import pickle
        from memfit.torch_internals import memory_snapshot
        open({str(path)!r}, "wb").write(pickle.dumps(memory_snapshot()))
        print(json.dumps([t.data_ptr() for t in keep]))
        """
    ptrs = json.loads(subprocess.run([sys.executable, "-c", script], check=True, capture_output=True,
                                     text=True, timeout=120).stdout)
    real = read_snapshot(path)
    ours = [s for s in real["segments"]
            if any(s["address"] <= p < s["address"] + s["total_size"] for p in ptrs)]
    shape = [[(b["size"], b["state"]) for b in s["blocks"]] for s in sorted(ours, key=lambda s: s["total_size"])]
    model = [[(b["size"], b["state"]) for b in s["blocks"]] for s in
             sorted(checkerboard().snapshot()["segments"], key=lambda s: s["total_size"])]
    assert sorted(shape) == sorted(model)
    r = explain_snapshot({"segments": ours, "device_traces": []})
    assert (r.free_in_segments, r.largest_free, r.reserved) == (40 * MiB, 4 * MiB, 92 * MiB)
