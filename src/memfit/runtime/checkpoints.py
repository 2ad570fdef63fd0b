"""Checkpoints for exact resume, and the final safetensors export.

Layout: ``RUN_DIR/checkpoints/step-00000042.pt`` (step zero-padded to 8 digits so names sort; larger steps
still work, ordering is by the parsed number) and beside it ``step-00000042.pt.sha256``, the SHA-256 of the
checkpoint's bytes in ``sha256sum`` format (``sha256sum -c`` checks it too). `latest_checkpoint` finds the
newest checkpoint whose bytes still match their checksum.

Integrity: a file overwritten in place (same size, different bytes) can still unpickle into plausible tensors
and train on NaNs without a word, so every load hashes the file and compares it with its checksum first; a
mismatch, a missing checksum, a truncated or unreadable file is a `CheckpointError`, and `latest_checkpoint`
skips it for the previous one, saying so in one line on stderr.

Atomicity: a checkpoint is written to a temporary file in the same directory (``.step-00000042.pt.<random>.tmp``),
flushed and fsynced; its checksum is written the same way and renamed into place; then the checkpoint is
renamed onto its final name with `os.replace` (an atomic rename on POSIX, and one that also overwrites on
Windows), and the directory is fsynced so the rename itself is durable. That last rename is the commit: a
crash (even ``kill -9``) at any point leaves either the old set of checkpoints or the old set plus the new
one, never a half-written ``step-*.pt``, and never a ``step-*.pt`` without its checksum. Older checkpoints
beyond the newest `keep` are deleted only after the new one is complete. Leftover temporary files and
checksums without a checkpoint are ignored by `latest_checkpoint` and removed by the next successful save
(one writer per run directory is assumed). A write that fails (disk full) or is interrupted (Ctrl-C) raises
that error itself, not torch's ``unexpected pos``, and leaves the old set untouched.

Sharded checkpoints (a run on several ranks, `save_sharded`): every rank writes its own shards of the model
and optimizer states with PyTorch's distributed checkpoint engine (`torch.distributed.checkpoint.save`;
nothing is gathered on one rank) into ``.step-00000042.dcp.<random>.tmp/``; the ranks hash its files between
them; rank 0 renames the folder to ``step-00000042.dcp`` and then writes ``step-00000042.pt`` as above, with
everything else and the size and SHA-256 of every shard file. That ``.pt`` is still the commit. A load
checks every shard file against it, and `restore` has DCP reshard the states to the layout and world size
of the run that resumes (4 ranks -> 2 -> 1 process). Ranks resuming together split that check: each loads
the ``.pt`` checking the shards' sizes only (`load_latest(..., hash_shards=False)`), then, once they have
joined, hashes its share of the shard files (`check_shards_together`), so the checkpoint is read once, not
once per rank.

Loading uses ``torch.load(path, map_location="cpu", weights_only=True)``: no pickled code runs. Everything a
checkpoint holds is therefore tensors, dicts, lists, tuples, ints, floats, strings, bools and None; the RNG
states (Python's `random`, numpy's) are converted to tensors and plain types on save.
"""
from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import sys
import tempfile
import uuid
import zipfile
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from memfit.errors import CheckpointError

FORMAT = "memfit-checkpoint"
VERSION = 1
CHECKPOINT_SUBDIR = "checkpoints"
_NAME_RE = re.compile(r"^step-(\d+)\.pt$")
_SUM_RE = re.compile(r"^step-(\d+)\.pt\.sha256$")
SUM_SUFFIX = ".sha256"
_TMP_RE = re.compile(r"^\.step-\d+\.(pt|dcp)\..*\.tmp$")
_SHARDS_RE = re.compile(r"^step-(\d+)\.dcp$")

# Components that wrappers insert into parameter names. "module." is only stripped as a leading component
# (DataParallel / DistributedDataParallel wrap the whole model), because a real submodule may be called
# "module"; the others are reserved attribute names of their wrappers and are stripped wherever they occur.
_LEADING_PREFIXES = ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
_ANYWHERE = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


# --------------------------------------------------------------------------------------------- paths


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINT_SUBDIR


def checkpoint_path(run_dir: str | os.PathLike, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step-{int(step):08d}.pt"


def shards_path(path: str | os.PathLike) -> Path:
    """The folder of a sharded checkpoint's model and optimizer shards: beside it, ``.dcp`` for ``.pt``."""
    return Path(path).with_suffix(".dcp")


def checksum_path(path: str | os.PathLike) -> Path:
    """Where the checksum of the checkpoint at `path` lives: beside it, ``.sha256`` appended."""
    path = Path(path)
    return path.with_name(path.name + SUM_SUFFIX)


def list_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every complete-by-name checkpoint, oldest first. Temporary files never match."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = _NAME_RE.match(p.name)
        if m and p.is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


# ----------------------------------------------------------------------------------- atomic writing


def _fsync_dir(d: Path) -> None:
    """Make a rename/unlink in `d` durable. Not possible on Windows (directories cannot be opened)."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(final: Path, write, before_commit=None) -> None:
    """`write(tmp_path)` writes the whole file; then fsync, `before_commit(tmp_path)` (the checksum goes in
    place here), rename onto `final`, fsync the directory. On any failure, Ctrl-C included, the temporary
    file is removed and `final` is untouched."""
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:  # flush whatever the writer left in OS buffers to the disk
            f.flush()
            os.fsync(f.fileno())
        if before_commit is not None:
            before_commit(tmp)
        os.replace(tmp, final)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    _fsync_dir(final.parent)


class _Sink:
    """The file object torch.save writes through. torch turns an exception raised by ``write`` (disk full,
    Ctrl-C) into ``[enforce fail at inline_container.cc] unexpected pos``; the sink keeps the real one so that
    it can be raised instead."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except BaseException as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def _torch_save_to(obj) -> Any:
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            sink = _Sink(f)
            try:
                torch.save(obj, sink)
            except BaseException:
                if sink.error is not None:
                    raise sink.error from None
                raise
    return write


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _write_checksum(final: Path):
    """`before_commit` for a checkpoint: hash what was written and put ``final``'s checksum file in place."""
    def write_sum(tmp: Path) -> None:
        line = f"{sha256_of(tmp)}  {final.name}\n"
        _atomic_write(checksum_path(final), lambda t: t.write_text(line))
    return write_sum


# ----------------------------------------------------------------------------------------- RNG state


def _rng_state() -> dict:
    py_version, py_state, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": int(py_version), "state": torch.tensor(py_state, dtype=torch.int64),
                   "gauss_next": py_gauss},
        "cuda": None,
        "numpy": None,
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    if "numpy" in sys.modules:  # only if the program uses numpy at all; never import it just for this
        np = sys.modules["numpy"]
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"name": str(name), "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return state


def _set_rng_state(state: Mapping) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(x) for x in py["state"].tolist()), py["gauss_next"]))
    cuda = state.get("cuda")
    if cuda:
        if not torch.cuda.is_available():
            _warn("checkpoint holds CUDA RNG states but CUDA is not available: not restored")
        else:
            n = torch.cuda.device_count()
            if n != len(cuda):
                _warn(f"checkpoint holds CUDA RNG states for {len(cuda)} device(s), this process sees {n}: "
                      f"restoring the first {min(n, len(cuda))}")
            for i, s in enumerate(cuda[:n]):
                torch.cuda.set_rng_state(s, i)
    npst = state.get("numpy")
    if npst is not None:
        import numpy as np
        np.random.set_state((npst["name"], npst["keys"].numpy().astype(np.uint32), int(npst["pos"]),
                             int(npst["has_gauss"]), float(npst["cached_gaussian"])))


# ------------------------------------------------------------------------------------ plain-data check


def _check_plain(value, what: str, path: str = "") -> None:
    """Everything saved must load under weights_only=True: refuse anything else at save time, not at resume."""
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise CheckpointError(f"{what}{path}: key {k!r} is a {type(k).__name__}; only str/int keys can be saved")
            _check_plain(v, what, f"{path}[{k!r}]")
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, what, f"{path}[{i}]")
        return
    raise CheckpointError(f"{what}{path} is a {type(value).__name__}; a checkpoint can only hold tensors, dicts, lists, "
                    "ints, floats, strings, bools and None")


# ------------------------------------------------------------------------------------------ saving


def save_checkpoint(run_dir: str | os.PathLike, step: int, *, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, scaler=None, scheduler=None, config: Mapping | Any,
                    data_state: Mapping | None = None, keep: int | None = 2, optimizer_offload=None,
                    run: Mapping | None = None, shards: Mapping | None = None, noise: Mapping | None = None,
                    flat_optimizer: bool = False) -> Path:
    """Atomically write ``RUN_DIR/checkpoints/step-XXXXXXXX.pt`` and its checksum, and return its path.

    `config` is `Config.to_dict()` (a `Config` is converted); `data_state` is a small dict of ints/lists
    (e.g. a sampler's state) returned untouched by `load_checkpoint(...)["data_state"]`; `run` likewise, for
    what identifies the run (workload, seed, length, schedule) so a resume can be checked against it before
    anything is written. After the new file is
    complete, only the newest `keep` checkpoints (by step; the one just written is always kept) remain;
    ``keep=None`` keeps all. `optimizer_offload` is the engine's `OptimizerOffload` when the optimizer steps
    fp32 master copies on the host: those masters are saved so that resume is exact even when the model's
    own parameters are lower precision. `shards`: {file name: [bytes, sha256]} of the folder `save_sharded`
    wrote the model and optimizer states to, recorded instead of them. `noise`: the gradient noise scale's
    `NoiseScale.state_dict()` (its moving averages), for a resume to go on with. `flat_optimizer`: the
    shards' optimizer state is keyed by parameter name, hyperparameters included (`save_sharded`).
    """
    step = int(step)
    if step < 0:
        raise CheckpointError(f"step must be >= 0, got {step}")
    if keep is not None and keep < 1:
        raise CheckpointError(f"keep must be >= 1 or None, got {keep}")
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    config = dict(config)
    data_state, run = dict(data_state or {}), dict(run or {})
    _check_plain(config, "config")
    _check_plain(data_state, "data_state")
    _check_plain(run, "run")
    _check_plain(noise, "noise")
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "model": {} if shards else model.state_dict(),
        "optimizer": {} if shards else optimizer.state_dict(),
        "shards": dict(shards) if shards else None,
        "flat_optimizer": bool(shards) and flat_optimizer,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "offload_master": ([m.detach() for m in optimizer_offload.master] if optimizer_offload is not None else None),
        "rng": _rng_state(),
        "data_state": data_state,
        "config": config,
        "run": run,
        "noise": dict(noise) if noise is not None else None,
        "torch_version": str(torch.__version__),
    }
    _check_plain(payload["optimizer"], "optimizer.state_dict()")
    if payload["scheduler"] is not None:
        _check_plain(payload["scheduler"], "scheduler.state_dict()")
    final = checkpoint_path(run_dir, step)
    _atomic_write(final, _torch_save_to(payload), before_commit=_write_checksum(final))
    _prune(run_dir, keep, final)
    return final


def save_sharded(run_dir: str | os.PathLike, step: int, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler=None, config: Mapping | Any, data_state: Mapping | None = None, keep: int | None = 2,
                 run: Mapping | None = None, flat_optimizer: bool = False) -> Path:
    """`save_checkpoint` for a run on several ranks, called by every rank: each writes its own shards of the
    model and optimizer states with `torch.distributed.checkpoint.save`, so no rank ever holds the whole
    state; rank 0 then commits the checkpoint (module docstring). Returns its path on every rank. An error on
    any rank (a full disk) is raised on every rank, and leaves the previous checkpoints as they were.

    `flat_optimizer` (pipeline stages): the optimizer's param groups saved per parameter name, as torchtitan
    saves them. Unflattened, every stage's group 0 is one key, DCP keeps one rank's copy of it, and a resume on
    stages failed (the other stages' parameters found no group: KeyError 'betas')."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = checkpoint_path(run_dir, step)
    box = [f".{shards_path(final).name}.{uuid.uuid4().hex[:12]}.tmp"]
    dist.broadcast_object_list(box, src=0)  # one folder for all ranks
    tmp = checkpoint_dir(run_dir) / box[0]
    error = None
    try:
        # every rank, as DCP's writer does on each: a rank 0 that insisted on making it raced the others' writers
        tmp.mkdir(parents=True, exist_ok=True)
        model_state, optimizer_state = get_state_dict(model, optimizer, options=_state_options(flat_optimizer))
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp)
        files = sorted(f.name for f in tmp.iterdir())  # complete on every rank: save() ends in a collective
        mine = {f: [(tmp / f).stat().st_size, sha256_of(tmp / f)]
                for i, f in enumerate(files) if i % dist.get_world_size() == dist.get_rank()}
    except (OSError, dcp.CheckpointException) as e:  # DCP raises a failure on any rank on every rank
        error, mine = e, {}
    hashed = [None] * dist.get_world_size()
    dist.all_gather_object(hashed, (None if error is None else f"{type(error).__name__}: {error}", mine))
    failed = next((e for e, _ in hashed if e is not None), None)
    if dist.get_rank() == 0 and failed is None:
        try:
            _fsync_tree(tmp)
            shards = {f: sums for _, part in hashed for f, sums in part.items()}
            target = shards_path(final)
            shutil.rmtree(target, ignore_errors=True)  # a stale folder of a save killed before its commit
            os.replace(tmp, target)
            _fsync_dir(target.parent)
            save_checkpoint(run_dir, step, model=model, optimizer=optimizer, scheduler=scheduler, config=config,
                            data_state=data_state, keep=keep, run=run, shards=shards, flat_optimizer=flat_optimizer)
        except OSError as e:
            failed = f"{type(e).__name__}: {e}"
    if dist.get_rank() == 0 and failed is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    box = [failed]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise error if isinstance(error, OSError) else OSError(box[0])
    return final


def _state_options(flat_optimizer: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=flat_optimizer)


def _fsync_tree(folder: Path) -> None:
    for f in folder.iterdir():
        with open(f, "rb+") as fh:
            os.fsync(fh.fileno())
    _fsync_dir(folder)


def _prune(run_dir, keep: int | None, just_written: Path) -> None:
    d = checkpoint_dir(run_dir)
    for p in d.iterdir():  # leftovers of saves that were killed mid-write, checksums of deleted checkpoints
        m = _SUM_RE.match(p.name) or _SHARDS_RE.match(p.name)
        if _TMP_RE.match(p.name) or (m and not (d / f"step-{m.group(1)}.pt").exists()):
            _remove(p)
    if keep is None:
        return
    others = [p for _, p in list_checkpoints(run_dir) if p != just_written]
    for p in others[: max(0, len(others) - (keep - 1))]:
        for doomed in (p, checksum_path(p), shards_path(p)):  # the checkpoint first: what is left is never one
            _remove(doomed)
    _fsync_dir(d)


def _remove(path: Path) -> None:
    try:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    except OSError:
        pass


# ----------------------------------------------------------------------------------------- loading


def _one_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    line = lines[0] if lines else ""
    if line.startswith("Weights only load failed"):  # torch's boilerplate; the reason is a later line
        reason = next((ln for ln in lines[1:] if "global" in ln.lower()), None)
        line = "weights_only=True refused it: " + (reason or line)
    text = f"{type(exc).__name__}: {line}" if line else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _warn(message: str) -> None:
    """One line on stderr: what was skipped and why (a Python warning would add a file, a line number and
    a source line, four lines for one fact)."""
    print(f"memfit: warning: {message}", file=sys.stderr, flush=True)


def _load(path: Path, mmap: bool, hash_shards: bool = True) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    if not zipfile.is_zipfile(path):  # cheap: reads the end-of-archive record that a truncated file lacks
        raise CheckpointError(f"{path}: corrupt or not a memfit checkpoint: not a complete zip archive "
                              f"({path.stat().st_size} bytes; truncated?)")
    sums = checksum_path(path)
    if sums.is_file():  # before unpickling anything: bytes changed in place must not load
        want = sums.read_text().split()[:1]
        got = sha256_of(path)
        if want != [got]:
            raise CheckpointError(f"{path}: corrupt: its bytes no longer match the checksum written with it "
                                  f"(sha256 {got[:12]}..., {sums.name} says {(want or ['nothing'])[0][:12]}...)")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # truncated zip, bad pickle, a disallowed global under weights_only, ...
        raise CheckpointError(f"{path}: corrupt or not a memfit checkpoint: {_one_line(e)}") from e
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a memfit checkpoint (no '{FORMAT}' format marker)")
    version = obj.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {version!r} is not supported "
                              f"(this memfit reads up to {VERSION})")
    missing = [k for k in ("step", "model", "optimizer", "rng", "data_state", "config") if k not in obj]
    if missing:
        raise CheckpointError(f"{path}: corrupt memfit checkpoint: missing {', '.join(missing)}")
    if not sums.is_file():
        raise CheckpointError(f"{path}: its checksum {sums.name} is missing, so its bytes cannot be checked")
    if obj.get("shards"):
        _check_shards(path, obj["shards"], hashed=obj["shards"] if hash_shards else {})
    return obj


def _check_shards(path: Path, shards: Mapping, hashed: Mapping) -> None:
    """Every shard file the checkpoint recorded is there with its size (cheap), and those in `hashed` hold
    the bytes they were written with."""
    folder = shards_path(path)
    for name, (size, _) in shards.items():
        f = folder / name
        if not f.is_file() or f.stat().st_size != size:
            raise CheckpointError(f"{path}: shard {folder.name}/{name} is missing or not {size} bytes (truncated?)")
    for name, (_, digest) in hashed.items():
        if sha256_of(folder / name) != digest:
            raise CheckpointError(f"{path}: corrupt: shard {folder.name}/{name} no longer matches the checksum "
                                  f"written with it")


def check_shards_together(path: str | os.PathLike, state: Mapping) -> None:
    """The shard files of `state` (loaded from `path` with ``hash_shards=False``) against their checksums,
    each rank hashing its share (file i on rank i mod N), as `save_sharded` hashed them. Called by every
    rank; a mismatch anywhere raises the same `CheckpointError` on every rank. Unlike a single process's
    load, it does not fall back to an older checkpoint: the ranks were set up from this one."""
    import torch.distributed as dist

    shards = state.get("shards") or {}
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {name: sums for i, (name, sums) in enumerate(sorted(shards.items())) if i % world == rank}
    try:
        _check_shards(Path(path), shards, hashed=mine)
        error = None
    except CheckpointError as e:
        error = str(e)
    verdicts = [None] * world
    dist.all_gather_object(verdicts, error)
    failed = next((v for v in verdicts if v is not None), None)
    if failed is not None:
        raise CheckpointError(f"{failed}; nothing was changed: move it aside to resume from the one before it")


def load_checkpoint(path: str | os.PathLike) -> dict:
    """Load a checkpoint onto the CPU with ``weights_only=True``, after checking its bytes against its
    checksum. Raises `CheckpointError` (one line naming the file) if it is missing, truncated, corrupt,
    changed since it was written, holds pickled code, or is not a memfit checkpoint.

    Keys: format, version, step, model, optimizer, scaler, scheduler, offload_master, rng, data_state, config,
    run, torch_version.
    """
    return _load(Path(path), mmap=False)


def _newest(run_dir, mmap: bool, hash_shards: bool = True) -> tuple[Path, dict] | None:
    for _, p in reversed(list_checkpoints(run_dir)):
        try:
            return p, _load(p, mmap=mmap, hash_shards=hash_shards)
        except CheckpointError as e:
            if mmap:
                try:  # mmap may be unsupported where the file lives; a full read also gives a clearer reason
                    return p, _load(p, mmap=False, hash_shards=hash_shards)
                except CheckpointError as full:
                    e = full
            _warn(f"skipping checkpoint {e}")
    return None


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest intact checkpoint under ``RUN_DIR/checkpoints``, or None. Temporary files are ignored; a
    checkpoint that fails its checksum or does not load is skipped with one line on stderr naming it and
    why, falling back to the previous one.

    Validation hashes the file, then memory-maps it (``torch.load(..., mmap=True)``): the zip structure, the
    pickled structure and the format marker are checked without reading every tensor into memory.
    """
    found = _newest(run_dir, mmap=True)
    return found[0] if found else None


def intact(run_dir: str | os.PathLike, resume_hint: str = "") -> str:
    """Which checkpoint a failure leaves to resume from, checked (checksum and all), as a clause; `resume_hint`
    is added where there is one."""
    path = latest_checkpoint(run_dir)
    if path is None:
        return "no checkpoint of this run exists yet"
    step = next(s for s, p in list_checkpoints(run_dir) if p == path)
    return f"the checkpoint of step {step} is intact{resume_hint}"


def load_latest(run_dir: str | os.PathLike, hash_shards: bool = True) -> tuple[Path, dict] | None:
    """(path, `load_checkpoint(path)`) of the newest intact checkpoint, each candidate read once; None if
    there is none. Skips are reported as by `latest_checkpoint`. Without `hash_shards`, a sharded
    checkpoint's shard files are checked for their sizes only: for ranks that will resume together and
    hash them between them (`check_shards_together`)."""
    return _newest(run_dir, mmap=False, hash_shards=hash_shards)


# ---------------------------------------------------------------------------------------- restoring


def restore(ckpt: Mapping, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler=None,
            scheduler=None, optimizer_offload=None, path: str | os.PathLike | None = None) -> None:
    """Load model, optimizer, grad scaler, LR scheduler (and offloaded master weights) states, then the RNG
    states, so the next step is the one the interrupted run would have taken. The step number and
    `data_state` are the caller's to apply (``ckpt["step"]``, ``ckpt["data_state"]``). A checkpoint of a
    sharded run (`save_sharded`) loads into a model of any layout and world size: DCP reads each rank's part
    of every saved shard (`path`: that checkpoint's file)."""
    if ckpt.get("shards"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        options = _state_options(bool(ckpt.get("flat_optimizer")))  # as it was saved
        try:
            model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
            dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=shards_path(path))
            set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                           options=options)
        except (ValueError, KeyError, RuntimeError, dcp.CheckpointException) as e:
            raise CheckpointError(f"the saved state does not fit this model and optimizer: {_one_line(e)}") from e
    elif ckpt.get("named_state"):  # a sharded run's checkpoint from before DCP: full states by name
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        try:
            set_state_dict(model, optimizer, model_state_dict=ckpt["model"], optim_state_dict=ckpt["optimizer"],
                           options=StateDictOptions(full_state_dict=True))
        except (ValueError, KeyError, RuntimeError) as e:
            raise CheckpointError(f"the saved state does not fit this model and optimizer: {_one_line(e)}") from e
    else:
        if getattr(model, "_is_fsdp_managed_module", False) or any(type(p).__name__ == "DTensor"
                                                                    for p in model.parameters()):
            raise CheckpointError("a checkpoint of a one-process run resumes in one process: resume with --gpus 1")
        load_model_state(model, ckpt["model"])
        try:
            optimizer.load_state_dict(ckpt["optimizer"])
        except (ValueError, KeyError, RuntimeError) as e:
            raise CheckpointError(f"optimizer state does not fit this optimizer: {_one_line(e)}") from e
    if optimizer_offload is not None:
        masters = ckpt.get("offload_master")
        with torch.no_grad():
            if masters is not None:
                if len(masters) != len(optimizer_offload.master):
                    raise CheckpointError(f"checkpoint holds {len(masters)} offloaded master tensors, "
                                          f"the optimizer offload has {len(optimizer_offload.master)}")
                for m, saved in zip(optimizer_offload.master, masters):
                    m.copy_(saved)
            else:  # saved without offload: the model's parameters are the masters
                for m, p in zip(optimizer_offload.master, optimizer_offload.params):
                    m.copy_(p.detach())
    _load_optional("scaler", scaler, ckpt.get("scaler"))
    _load_optional("scheduler", scheduler, ckpt.get("scheduler"))
    _set_rng_state(ckpt["rng"])


def _load_optional(name: str, obj, state) -> None:
    if obj is not None and state is not None:
        obj.load_state_dict(state)
    elif obj is not None:
        _warn(f"checkpoint holds no {name} state: the {name} starts fresh")
    elif state is not None:
        _warn(f"checkpoint holds {name} state but no {name} was given: ignored")


def normalize_key(key: str) -> str:
    """Strip wrapper components: leading ``module.`` / ``_orig_mod.`` / ``_fsdp_wrapped_module.`` /
    ``_checkpoint_wrapped_module.`` (repeatedly) and the last three wherever they occur."""
    parts = key.split(".")
    i = 0
    while i < len(parts) - 1 and parts[i] in _LEADING_PREFIXES:
        i += 1
    return ".".join(p for j, p in enumerate(parts) if j >= i and not (p in _ANYWHERE and j < len(parts) - 1))


def _normalized(keys: Iterable[str], side: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for k in keys:
        n = normalize_key(k)
        if n in out:
            raise CheckpointError(f"{side} keys {out[n]!r} and {k!r} both normalise to {n!r}: "
                                  "cannot match them unambiguously")
        out[n] = k
    return out


def _first(keys: list[str], n: int = 5) -> str:
    shown = ", ".join(keys[:n])
    return shown + (f", ... (+{len(keys) - n} more)" if len(keys) > n else "")


def load_model_state(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """`model.load_state_dict` that ignores wrapper prefixes (DataParallel/DDP ``module.``, torch.compile
    ``_orig_mod.``, FSDP ``_fsdp_wrapped_module.``, activation-checkpoint ``_checkpoint_wrapped_module.``) on
    both sides: a checkpoint from a wrapped model loads into a bare one and vice versa. Keys that still do
    not match, and shape mismatches, raise `CheckpointError` naming them."""
    own = model.state_dict()
    own_norm = _normalized(own.keys(), "model")
    ckpt_norm = _normalized(state_dict.keys(), "checkpoint")
    missing = [own_norm[n] for n in own_norm if n not in ckpt_norm]
    unexpected = [ckpt_norm[n] for n in ckpt_norm if n not in own_norm]
    shapes = []
    for n, k in own_norm.items():
        if n in ckpt_norm:
            a, b = state_dict[ckpt_norm[n]], own[k]
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape != b.shape:
                shapes.append(f"{k}: checkpoint {tuple(a.shape)} vs model {tuple(b.shape)}")
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing from checkpoint: {_first(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected in checkpoint: {_first(unexpected)}")
        if shapes:
            parts.append(f"{len(shapes)} shape mismatch(es): {_first(shapes, 3)}")
        raise CheckpointError("model state does not match the model after stripping wrapper prefixes: "
                              + "; ".join(parts))
    remapped = {own_norm[n]: state_dict[k] for n, k in ckpt_norm.items()}
    model.load_state_dict(remapped, strict=True)


# ------------------------------------------------------------------------------------------- export


def export_safetensors(model: torch.nn.Module | None, path: str | os.PathLike, state_dict: Mapping | None = None) -> None:
    """Write the model's final weights (its state_dict, wrapper prefixes stripped) to `path` as safetensors,
    atomically (temporary file, fsync, rename, fsync of the directory).

    safetensors refuses tensors that share storage (tied embeddings, views). Choice: every state_dict key is
    kept and a tensor whose storage was already written is *cloned*, so the file loads with a plain
    `safetensors.torch.load_file` and has exactly the model's keys, at the cost of storing tied weights
    twice. The ties are recorded in the metadata (``"memfit.tied"``: ``"alias=original,..."``) for anyone who
    wants to re-tie them. `state_dict`: a full state dict to write instead of `model`'s (a sharded run's,
    gathered on rank 0).
    """
    from safetensors.torch import save_file

    path = Path(path)
    sd = dict(state_dict) if state_dict is not None else model.state_dict()
    names = _normalized(sd.keys(), "model")
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[tuple, tuple[str, torch.Tensor]] = {}  # storage -> (first name, its original view)
    tied = []
    for n, k in names.items():
        src = sd[k].detach()
        # identify storage on the tensor's own device: a .cpu() copy would hide the sharing
        key = (src.device, src.untyped_storage().data_ptr()) if src.numel() else None
        t = src.cpu() if src.device.type != "cpu" else src
        if key is not None and key in seen:
            first, view = seen[key]
            if _same_view(view, src):
                tied.append(f"{n}={first}")
            t = t.clone(memory_format=torch.contiguous_format)
        else:
            if key is not None:
                seen[key] = (n, src)
            if not t.is_contiguous():
                t = t.contiguous()
        tensors[n] = t
    metadata = {"format": "pt"}
    if tied:
        metadata["memfit.tied"] = ",".join(tied)

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp), metadata=metadata)

    _atomic_write(path, write)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.storage_offset() == b.storage_offset() \
        and a.stride() == b.stride()


__all__ = ["CheckpointError", "save_checkpoint", "latest_checkpoint", "intact", "load_checkpoint", "load_latest",
           "check_shards_together", "restore", "load_model_state", "export_safetensors", "list_checkpoints",
           "checkpoint_path", "checksum_path", "normalize_key"]
