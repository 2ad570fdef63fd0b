"""Checkpoints: exact resume, atomic saves, checksums, corrupt files, a full disk, weights_only loading, wrapper
prefixes, export."""
from __future__ import annotations

import errno
import io
import os
import random
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

from memfit.runtime import checkpoints as ck
from memfit.runtime.checkpoints import (CheckpointError, export_safetensors, latest_checkpoint, load_checkpoint,
                                        load_model_state, restore, save_checkpoint)

CONFIG = {"micro_batch": 2, "precision": "fp32", "grad_accum": 1, "activation_checkpoint": "none"}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.2)  # consumes the global RNG: resume is only exact if RNG is restored
        self.fc2 = nn.Linear(16, 4)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count += 1
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx):
        return self.head(self.embed(idx))


class Wrapper(nn.Module):
    """Stands in for DataParallel/DDP: the model lives at attribute `module`."""

    def __init__(self, module):
        super().__init__()
        self.module = module


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)  # the data depends on the step only
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def make(seed=0):
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched


def train(model, opt, sched, steps):
    model.train()
    for s in steps:
        x, y = batch(s)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()


def test_round_trip_is_bit_identical(tmp_path):
    model, opt, sched = make()
    train(model, opt, sched, range(10))
    ref = {k: v.clone() for k, v in model.state_dict().items()}

    model, opt, sched = make()
    train(model, opt, sched, range(5))
    p = save_checkpoint(tmp_path, 5, model=model, optimizer=opt, scheduler=sched, config=CONFIG,
                        data_state={"epoch": 0, "order": [3, 1, 2]})
    assert p == tmp_path / "checkpoints" / "step-00000005.pt"
    torch.rand(7)  # the interrupted process goes on consuming RNG before it dies
    del model, opt, sched

    model, opt, sched = make(seed=123)  # a fresh process: different init, fresh optimizer
    ckpt = load_checkpoint(latest_checkpoint(tmp_path))
    restore(ckpt, model=model, optimizer=opt, scheduler=sched)
    assert ckpt["step"] == 5 and ckpt["data_state"] == {"epoch": 0, "order": [3, 1, 2]}
    assert ckpt["config"] == CONFIG and ckpt["version"] == ck.VERSION
    train(model, opt, sched, range(ckpt["step"], 10))
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k]), k


def test_rng_states_restored(tmp_path):
    np = pytest.importorskip("numpy")
    model, opt, _ = make()
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    random.gauss(0, 1)  # leaves a cached gauss_next
    save_checkpoint(tmp_path, 1, model=model, optimizer=opt, config=CONFIG)
    expect = torch.rand(5), random.random(), random.gauss(0, 1), np.random.rand(3)
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    restore(load_checkpoint(latest_checkpoint(tmp_path)), model=model, optimizer=opt)
    got = torch.rand(5), random.random(), random.gauss(0, 1), np.random.rand(3)
    assert torch.equal(got[0], expect[0])
    assert got[1:3] == expect[1:3]
    assert (got[3] == expect[3]).all()


def test_scaler_state_round_trips(tmp_path):
    model, opt, _ = make()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    save_checkpoint(tmp_path, 1, model=model, optimizer=opt, scaler=scaler, config=CONFIG)
    other = torch.amp.GradScaler("cpu")
    restore(load_checkpoint(latest_checkpoint(tmp_path)), model=model, optimizer=opt, scaler=other)
    assert other.state_dict() == scaler.state_dict()


def test_keeps_newest_and_names_sort(tmp_path):
    model, opt, _ = make()
    for step in (1, 2, 10, 100):
        save_checkpoint(tmp_path, step, model=model, optimizer=opt, config=CONFIG, keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-00000010.pt", "step-00000010.pt.sha256", "step-00000100.pt", "step-00000100.pt.sha256"]
    assert latest_checkpoint(tmp_path).name == "step-00000100.pt"
    assert latest_checkpoint(tmp_path / "nothing-here") is None


def test_crash_during_rename_keeps_previous(tmp_path, monkeypatch):
    model, opt, _ = make()
    good = save_checkpoint(tmp_path, 1, model=model, optimizer=opt, config=CONFIG, keep=1)

    def crash(*a, **k):
        raise OSError("simulated crash")

    with monkeypatch.context() as m:
        m.setattr(os, "replace", crash)
        with pytest.raises(OSError, match="simulated crash"):
            save_checkpoint(tmp_path, 2, model=model, optimizer=opt, config=CONFIG, keep=1)
    assert latest_checkpoint(tmp_path) == good  # and keep=1 did not delete it
    # no temporary left behind, and no checksum of the checkpoint that was never committed
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [good.name, good.name + ".sha256"]
    assert load_checkpoint(good)["step"] == 1


def test_kill_9_mid_save_leaves_previous_and_temp_is_ignored(tmp_path):
    """A real SIGKILL after the temporary file is written but before the rename."""
    script = textwrap.dedent(f"""
        import os, signal, torch
        from torch import nn
        from memfit.runtime.checkpoints import save_checkpoint
        model = nn.Linear(3, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        save_checkpoint({str(tmp_path)!r}, 1, model=model, optimizer=opt, config={{}})
        os.replace = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
        save_checkpoint({str(tmp_path)!r}, 2, model=model, optimizer=opt, config={{}})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    files = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert "step-00000001.pt" in files and "step-00000002.pt" not in files
    assert any(f.endswith(".tmp") for f in files)  # the leftover of the killed save
    assert latest_checkpoint(tmp_path).name == "step-00000001.pt"
    assert load_checkpoint(latest_checkpoint(tmp_path))["step"] == 1
    # the next successful save cleans the leftover
    model = nn.Linear(3, 3)
    save_checkpoint(tmp_path, 3, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config={})
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "checkpoints").iterdir())


def skipped_lines(capsys) -> list[str]:
    """The one-line reports of skipped checkpoints on stderr (and that nothing else was said there)."""
    lines = capsys.readouterr().err.splitlines()
    assert all(line.startswith("memfit: warning: skipping checkpoint ") for line in lines), lines
    return lines


def test_truncated_checkpoint_is_skipped_in_one_line(tmp_path, capsys):
    model, opt, _ = make()
    good = save_checkpoint(tmp_path, 1, model=model, optimizer=opt, config=CONFIG)
    bad = save_checkpoint(tmp_path, 2, model=model, optimizer=opt, config=CONFIG)
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a Python warning is four lines for one fact: none is raised
        assert latest_checkpoint(tmp_path) == good
    [line] = skipped_lines(capsys)
    assert "step-00000002.pt" in line and "truncated" in line
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(bad)
    msg = str(e.value)
    assert "\n" not in msg and str(bad) in msg and "corrupt" in msg

    garbage = tmp_path / "checkpoints" / "step-00000003.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    assert latest_checkpoint(tmp_path) == good
    lines = skipped_lines(capsys)
    assert ["00000003" in line for line in lines] == [True, False]  # newest first, both named
    with pytest.raises(CheckpointError, match="step-00000003.pt"):
        load_checkpoint(garbage)


def overwrite_weights_in_place(path, model: nn.Module) -> None:
    """Overwrite fc1.weight's bytes inside the file with NaNs of the same length: the size and the zip
    structure stay as they were (bit rot, a bad copy, a stray write)."""
    data = bytearray(path.read_bytes())
    old = model.fc1.weight.detach().numpy().tobytes()
    at = bytes(data).index(old)
    data[at: at + len(old)] = torch.full_like(model.fc1.weight, float("nan")).numpy().tobytes()
    size = path.stat().st_size
    path.write_bytes(bytes(data))
    assert path.stat().st_size == size


def test_bytes_changed_in_place_are_caught_by_the_checksum(tmp_path, capsys):
    model, opt, _ = make()
    good = save_checkpoint(tmp_path, 1, model=model, optimizer=opt, config=CONFIG)
    bad = save_checkpoint(tmp_path, 2, model=model, optimizer=opt, config=CONFIG)
    overwrite_weights_in_place(bad, model)
    # the danger: torch itself loads such a file without a word, NaN weights and all
    assert torch.load(bad, weights_only=True)["model"]["fc1.weight"].isnan().all()
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(bad)
    assert "\n" not in str(e.value) and str(bad) in str(e.value) and "checksum" in str(e.value)
    assert latest_checkpoint(tmp_path) == good
    [line] = skipped_lines(capsys)
    assert "step-00000002.pt" in line and "checksum" in line
    path, state = ck.load_latest(tmp_path)
    assert path == good and state["step"] == 1 and not state["model"]["fc1.weight"].isnan().any()
    skipped_lines(capsys)
    if shutil.which("sha256sum"):  # the checksum file is sha256sum's own format
        check = subprocess.run(["sha256sum", "-c", good.name + ".sha256"], cwd=good.parent, capture_output=True)
        assert check.returncode == 0, check.stdout + check.stderr


def test_a_checkpoint_without_its_checksum_is_not_trusted(tmp_path, capsys):
    model, opt, _ = make()
    good = save_checkpoint(tmp_path, 1, model=model, optimizer=opt, config=CONFIG)
    lone = save_checkpoint(tmp_path, 2, model=model, optimizer=opt, config=CONFIG)
    ck.checksum_path(lone).unlink()
    with pytest.raises(CheckpointError, match="checksum .* is missing"):
        load_checkpoint(lone)
    assert latest_checkpoint(tmp_path) == good
    assert len(skipped_lines(capsys)) == 1


class FailingFile(io.FileIO):
    """A checkpoint file whose third write fails as `error` (a full disk, a Ctrl-C)."""
    error: BaseException

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.writes = 0

    def write(self, data):
        self.writes += 1
        if self.writes == 3:
            raise self.error
        return super().write(data)


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()],
                         ids=["disk-full", "ctrl-c"])
def test_a_failed_write_raises_its_own_error_and_keeps_the_previous(tmp_path, monkeypatch, error):
    """torch reports a failing write as "[enforce fail at inline_container.cc] unexpected pos": the save must
    raise the real error, leave no temporary file and no checksum behind, and not touch the previous one."""
    model, opt, _ = make()
    good = save_checkpoint(tmp_path, 1, model=model, optimizer=opt, config=CONFIG)
    before = good.read_bytes()

    def failing_open(path, mode="r", *a, **k):
        if "step-00000002" in str(path) and mode == "wb":  # the checkpoint's temporary file
            f = FailingFile(path, "wb")
            f.error = error
            return f
        return open(path, mode, *a, **k)

    monkeypatch.setattr(ck, "open", failing_open, raising=False)
    with pytest.raises(type(error)) as info:
        save_checkpoint(tmp_path, 2, model=model, optimizer=opt, config=CONFIG)
    assert info.value is error
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [good.name, good.name + ".sha256"]
    assert good.read_bytes() == before and load_checkpoint(good)["step"] == 1


def test_not_a_memfit_checkpoint(tmp_path):
    p = tmp_path / "plain.pt"
    torch.save({"weights": torch.ones(2)}, p)
    with pytest.raises(CheckpointError, match="not a memfit checkpoint"):
        load_checkpoint(p)
    with pytest.raises(CheckpointError, match="no such"):
        load_checkpoint(tmp_path / "missing.pt")


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


class Custom:
    pass


def test_weights_only_refuses_pickled_objects(tmp_path):
    model, opt, _ = make()
    p = save_checkpoint(tmp_path, 1, model=model, optimizer=opt, config=CONFIG)
    pristine = torch.load(p, weights_only=True)
    for obj in (Custom(), Evil()):
        payload = dict(pristine, data_state={"sampler": obj})
        torch.save(payload, p)  # plain torch.save: a checkpoint someone tampered with, checksum and all
        ck.checksum_path(p).write_text(f"{ck.sha256_of(p)}  {p.name}\n")
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(p)
        assert "\n" not in str(e.value) and str(p) in str(e.value)
        assert "weights_only" in str(e.value)
        assert ("test_checkpoints.Custom" if isinstance(obj, Custom) else "system") in str(e.value)
    # and save_checkpoint itself refuses what would not load back
    with pytest.raises(CheckpointError, match="data_state"):
        save_checkpoint(tmp_path, 2, model=model, optimizer=opt, config=CONFIG, data_state={"x": Custom()})


def test_data_parallel_prefixes_both_ways(tmp_path):
    torch.manual_seed(0)
    bare = Net()
    wrapped = Wrapper(Net())
    assert all(k.startswith("module.") for k in wrapped.state_dict())
    # wrapped -> bare
    load_model_state(bare, wrapped.state_dict())
    for k, v in bare.state_dict().items():
        assert torch.equal(v, wrapped.module.state_dict()[k])
    # bare -> wrapped (through a checkpoint file)
    torch.manual_seed(1)
    src = Net()
    opt = torch.optim.AdamW(src.parameters())
    save_checkpoint(tmp_path, 1, model=src, optimizer=opt, config=CONFIG)
    ckpt = load_checkpoint(latest_checkpoint(tmp_path))
    target = Wrapper(Net())
    restore(ckpt, model=target, optimizer=torch.optim.AdamW(target.parameters()))
    for k, v in src.state_dict().items():
        assert torch.equal(v, target.module.state_dict()[k])


def test_real_data_parallel_and_compile_prefixes():
    torch.manual_seed(0)
    bare = Net()
    dp = nn.DataParallel(Net())  # on CPU it is a plain wrapper
    load_model_state(dp, bare.state_dict())
    assert torch.equal(dp.module.fc1.weight, bare.fc1.weight)
    # torch.compile-style and nested wrapper names
    sd = {f"module._orig_mod.{k}": v for k, v in bare.state_dict().items()}
    sd = {k.replace("fc1.", "fc1._checkpoint_wrapped_module."): v for k, v in sd.items()}
    fresh = Net()
    load_model_state(fresh, sd)
    assert torch.equal(fresh.fc1.weight, bare.fc1.weight)
    assert ck.normalize_key("encoder.module.weight") == "encoder.module.weight"  # a real submodule name


def test_true_mismatch_names_keys():
    model = Net()
    sd = {f"module.{k}": v for k, v in model.state_dict().items()}
    sd["module.extra.weight"] = torch.zeros(1)
    del sd["module.fc2.bias"]
    sd["module.fc1.weight"] = torch.zeros(3, 3)
    with pytest.raises(CheckpointError) as e:
        load_model_state(Net(), sd)
    msg = str(e.value)
    assert "\n" not in msg
    assert "1 missing" in msg and "fc2.bias" in msg
    assert "1 unexpected" in msg and "module.extra.weight" in msg
    assert "fc1.weight" in msg and "(3, 3)" in msg and "(16, 8)" in msg


def test_export_safetensors_tied(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = Tied()
    assert model.head.weight is model.embed.weight
    out = tmp_path / "final" / "model.safetensors"
    export_safetensors(Wrapper(model), out)
    loaded = load_file(str(out))
    sd = model.state_dict()
    assert set(loaded) == set(sd)  # wrapper prefix stripped, both tied names kept
    for k, v in sd.items():
        assert torch.equal(loaded[k], v), k
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["memfit.tied"] == "head.weight=embed.weight"
    assert [p.name for p in out.parent.iterdir()] == ["model.safetensors"]  # no temporary left
    fresh = Tied()
    load_model_state(fresh, loaded)
    assert torch.equal(fresh.head.weight, model.head.weight)


def test_export_is_atomic(tmp_path, monkeypatch):
    model = Tied()
    out = tmp_path / "model.safetensors"
    export_safetensors(model, out)
    before = out.read_bytes()
    with torch.no_grad():
        model.embed.weight.add_(1)
    monkeypatch.setattr(os, "replace", lambda *a, **k: (_ for _ in ()).throw(OSError("crash")))
    with pytest.raises(OSError):
        export_safetensors(model, out)
    assert out.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


def test_config_object_accepted(tmp_path):
    from memfit.config import Config

    model, opt, _ = make()
    cfg = Config(micro_batch=2, grad_accum=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = save_checkpoint(tmp_path, 4, model=model, optimizer=opt, config=cfg)
    assert Config.from_dict(load_checkpoint(p)["config"]) == cfg


@pytest.mark.parametrize("options", [{}, {"precision": "fp16"}, {"offload_optimizer": True},
                                     {"grad_accum": 2, "precision": "bf16"}])
def test_trainer_resume_is_exact(tmp_path, options):
    """The engine memfit actually runs: the grad scaler and offloaded fp32 masters come back too."""
    import memfit
    from memfit import Config, Trainer

    def model():
        return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))

    wl = memfit.Workload(model=model, batch=lambda n: {"x": torch.randn(n, 8), "y": torch.randn(n, 1)},
                         loss=lambda m, b: nn.functional.mse_loss(m(b["x"]), b["y"]),
                         optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    cfg = Config(micro_batch=4, **options)

    def save(t, run_dir):
        e = t.engine
        return save_checkpoint(run_dir, t.step_count, model=e.model, optimizer=e.optimizer, scaler=e.scaler,
                               config=cfg, data_state={"seed": t.seed}, optimizer_offload=e.optimizer_offload)

    ref = Trainer(wl, cfg, seed=3)
    for _ in range(6):
        ref.step()

    first = Trainer(wl, cfg, seed=3)
    for _ in range(3):
        first.step()
    save(first, tmp_path)
    del first

    torch.manual_seed(12345)
    resumed = Trainer(wl, cfg, seed=3)
    torch.rand(3)
    ckpt = load_checkpoint(latest_checkpoint(tmp_path))
    e = resumed.engine
    restore(ckpt, model=e.model, optimizer=e.optimizer, scaler=e.scaler, optimizer_offload=e.optimizer_offload)
    resumed.step_count = ckpt["step"]
    assert Config.from_dict(ckpt["config"]) == cfg
    for _ in range(3):
        resumed.step()
    for (k, a), b in zip(ref.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), k
    if e.scaler is not None:
        assert e.scaler.state_dict() == ref.engine.scaler.state_dict()
