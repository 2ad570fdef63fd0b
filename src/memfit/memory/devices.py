"""Catalogue of target devices, so memfit can answer "does this fit on an H100?" without one.

Conventions used by every catalogue entry (each figure's basis is noted beside it):

* memory_bytes is what ``torch.cuda.get_device_properties(i).total_memory`` reports, i.e. the
  memory a PyTorch process can actually address. This is *less* than the marketing size
  (80 GB) and less than nvidia-smi's total, because the driver keeps some for itself (ECC,
  page tables, reserved regions). Figures are binary GiB as PyTorch prints them in its OOM
  message ("GPU 0 has a total capacity of 79.11 GiB"), kept at MiB granularity. They drift by
  ~0.05 GiB between driver versions. Where no PyTorch figure was found, the entry says
  "estimate": nvidia-smi's total minus the gap seen on a sibling card.
* peak_flops are dense (no 2:4 sparsity) peaks from NVIDIA's data sheets, in FLOP/s. bf16/fp16
  are tensor-core figures with FP32 accumulation, which is what PyTorch's matmuls use. That
  halves the GeForce figures quoted "with FP16 accumulate". A precision the hardware has no
  fast path for (tf32 before Ampere, bf16 on Volta/Turing) gets the fp32 figure, since that
  is roughly what such a matmul runs at.
* memory_bandwidth is the data-sheet peak, in bytes/s.
* host_bandwidth is a realistic *achieved* pinned-memory copy rate per direction, not the
  link's peak: PCIe 3.0 x16 ~12 GB/s (peak 15.8), 4.0 x16 ~25 GB/s (peak 31.5),
  5.0 x16 ~50 GB/s (peak 63).
"""
from __future__ import annotations

import dataclasses
import math
import os
import platform
import re

from memfit.errors import ConfigError

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Device:
    name: str                 # catalogue key, e.g. "h100"
    kind: str                 # "cuda" or "cpu"
    description: str          # "NVIDIA H100 SXM5 80GB"
    memory_bytes: int         # usable device memory, as torch's total_memory reports it
    # dense peak FLOP/s by "fp32", "tf32", "bf16", "fp16"; {} = unknown. Left out of the hash so that
    # a Device still works as a dict key or cache key.
    peak_flops: dict = dataclasses.field(hash=False)
    memory_bandwidth: float   # bytes/s; 0.0 = unknown
    host_bandwidth: float     # bytes/s host<->device per direction, achieved (see module doc)
    compute_capability: tuple[int, int] | None
    bf16: bool                # native bf16 support
    context_bytes: int        # CUDA context + library code outside PyTorch's allocator
    cublas_workspace_bytes: int  # cuBLAS workspace PyTorch takes from its caching allocator
    multiprocessors: int = 0  # streaming multiprocessors (SMs), which size some kernels' scratch; 0 = unknown


def _gib(value: float) -> int:
    """A GiB figure as PyTorch prints it (two decimals) -> bytes, rounded to a whole MiB."""
    return round(value * 1024) * MiB


def _flops(fp32: float, tf32: float, bf16: float, fp16: float) -> dict:
    """Data-sheet TFLOP/s -> FLOP/s."""
    return {"fp32": fp32 * 1e12, "tf32": tf32 * 1e12, "bf16": bf16 * 1e12, "fp16": fp16 * 1e12}


def context_bytes_for(compute_capability: tuple[int, int] | None) -> int:
    """Memory a PyTorch process holds outside its caching allocator: the CUDA context plus the
    cuBLAS/cuDNN kernels it loads. This is the gap nvidia-smi shows above
    torch.cuda.memory_reserved(). It is an assumption per architecture, not a measurement.
    The figures are typical nvidia-smi readings of a process that has run a matmul, under
    CUDA 12 with lazy module loading (CUDA_MODULE_LOADING=LAZY, the default). Roughly 300 MiB
    on Volta/Turing, 400 MiB on Ampere/Ada, 500 MiB on Hopper and later. It grows with cuDNN
    convolutions, NCCL and Triton kernels, so calibrate it on real hardware when it matters."""
    if compute_capability is None:
        return 0
    major = compute_capability[0]
    if major >= 9:
        return 500 * MiB
    if major == 8:
        return 400 * MiB
    return 300 * MiB


def cublas_workspace_bytes(compute_capability: tuple[int, int] | None, config: str | None = None) -> int:
    """Size of the cuBLAS workspace PyTorch allocates, through its caching allocator, per
    (handle, stream) pair (aten/src/ATen/cuda/CublasHandlePool.cpp).

    CUBLAS_WORKSPACE_CONFIG is a list of ":SIZE_KiB:COUNT" pairs, summed. Unset, PyTorch uses
    ":4096:8" (32 MiB) on Hopper and Blackwell and ":4096:2:16:8" (8 MiB + 128 KiB) elsewhere.
    Releases up to ~2.5 used 32 MiB on sm_90 only; later ones use it for major 9, 10, 11 and 12.
    One caveat: PyTorch 2.x also gives cuBLASLt its own workspace of CUBLASLT_WORKSPACE_SIZE
    (1 MiB by default). That one is not counted here."""
    if compute_capability is None:
        return 0
    if config:
        pairs = re.findall(r":(\d+):(\d+)", config)
        if pairs:  # PyTorch falls back to the default when nothing parses, and so do we
            return sum(int(size) * KiB * int(count) for size, count in pairs)
    if compute_capability[0] in (9, 10, 11, 12):
        return 4096 * KiB * 8
    return 4096 * KiB * 2 + 16 * KiB * 8


_PCIE3, _PCIE4, _PCIE5 = 12e9, 25e9, 50e9


def _gpu(name, description, memory_bytes, peak_flops, memory_bandwidth, host_bandwidth, cc, bf16, sms) -> Device:
    return Device(name, "cuda", description, memory_bytes, peak_flops, memory_bandwidth, host_bandwidth,
                  cc, bf16, context_bytes_for(cc), cublas_workspace_bytes(cc), sms)


# SMs (the last figure) from NVIDIA's data sheets and architecture whitepapers.
# Memory sources: "oom" means PyTorch's OOM message as quoted in public issue reports.
# "smi" means nvidia-smi / NVML totals, as tabled at thundergolfer.com/blog/nvidia-gpu-memory-capacity.
_CATALOGUE = [
    # Hopper. H100 SXM: oom 79.11 GiB (vllm-project/vllm#27508); smi 81,559 MiB.
    _gpu("h100", "NVIDIA H100 SXM5 80GB", _gib(79.11),
         _flops(66.9, 494.7, 989.4, 989.4), 3.35e12, _PCIE5, (9, 0), True, 132),
    # H100 PCIe (80GB HBM2e, 114 SMs). Memory is an estimate: same smi total as SXM.
    _gpu("h100-pcie", "NVIDIA H100 PCIe 80GB", _gib(79.11),
         _flops(51.2, 378.0, 756.0, 756.0), 2.0e12, _PCIE5, (9, 0), True, 114),
    # H200 SXM: H100 SXM compute, 141 GB HBM3e. Memory is an estimate: smi 143,771 MiB, minus
    # the 550 MiB gap between smi and torch seen on H100.
    _gpu("h200", "NVIDIA H200 SXM 141GB", (143_771 - 550) * MiB,
         _flops(66.9, 494.7, 989.4, 989.4), 4.8e12, _PCIE5, (9, 0), True, 132),
    # Ampere. A100 80GB: oom 79.25 GiB (levihsu/OOTDiffusion#235); smi 81,920 MiB.
    _gpu("a100-80gb", "NVIDIA A100 SXM4 80GB", _gib(79.25),
         _flops(19.5, 156.0, 312.0, 312.0), 2.039e12, _PCIE4, (8, 0), True, 108),
    # A100 40GB: deviceQuery totalGlobalMem 42,298,834,944 B (bottlerocket-os/bottlerocket#3873).
    _gpu("a100-40gb", "NVIDIA A100 SXM4 40GB", 42_298_834_944,
         _flops(19.5, 156.0, 312.0, 312.0), 1.555e12, _PCIE4, (8, 0), True, 108),
    # A10G (AWS G5): oom 22.20 GiB (XavierXiao/Dreambooth-Stable-Diffusion#18, h2oai/h2ogpt#48).
    # AWS's A10G variant trades tensor throughput for clocks: ~70 dense bf16/fp16 TFLOP/s
    # against the A10's 125 (per Baseten's A10-vs-A10G comparison). Less certain than the rest.
    _gpu("a10g", "NVIDIA A10G 24GB (AWS G5)", _gib(22.20),
         _flops(31.52, 35.0, 70.0, 70.0), 600e9, _PCIE4, (8, 6), True, 80),
    # RTX 3090: oom 23.69-23.70 GiB (GaoLii/DSP#10). GA102 whitepaper, FP32 accumulate.
    _gpu("rtx-3090", "NVIDIA GeForce RTX 3090 24GB", _gib(23.69),
         _flops(35.6, 35.6, 71.0, 71.0), 936e9, _PCIE4, (8, 6), True, 82),
    # Ada. L4: memory is an estimate. smi shows 23,034 MiB, the same as the A10G's 23,028.
    _gpu("l4", "NVIDIA L4 24GB", _gib(22.20),
         _flops(30.3, 60.0, 121.0, 121.0), 300e9, _PCIE4, (8, 9), True, 58),
    # L40S: memory is an estimate. smi 46,068 MiB, minus the ~300 MiB GDDR6 gap seen on A10G/T4.
    _gpu("l40s", "NVIDIA L40S 48GB", (46_068 - 300) * MiB,
         _flops(91.6, 183.0, 362.0, 362.0), 864e9, _PCIE4, (8, 9), True, 142),
    # RTX 4090: oom 23.64 GiB (ali-vilab/VGen#104, 3DTopia/Phidias-Diffusion#8). Ada whitepaper,
    # FP32 accumulate.
    _gpu("rtx-4090", "NVIDIA GeForce RTX 4090 24GB", _gib(23.64),
         _flops(82.6, 82.6, 165.2, 165.2), 1008e9, _PCIE4, (8, 9), True, 128),
    # Turing. T4: oom 14.75 GiB (googlecolab/colabtools#3439); smi 15,360 MiB. No TF32, no bf16.
    _gpu("t4", "NVIDIA Tesla T4 16GB", _gib(14.75),
         _flops(8.1, 8.1, 8.1, 65.0), 320e9, _PCIE3, (7, 5), False, 40),
    # Volta (SXM2, whose host link is PCIe 3.0 x16; NVLink only joins the GPUs). No TF32, no bf16.
    # V100 32GB: oom 31.75 GiB (hiyouga/LlamaFactory#182). V100 16GB: oom 15.78 GiB
    # (googlecolab/colabtools#2001).
    _gpu("v100-32gb", "NVIDIA Tesla V100 SXM2 32GB", _gib(31.75),
         _flops(15.7, 15.7, 15.7, 125.0), 900e9, _PCIE3, (7, 0), False, 80),
    _gpu("v100-16gb", "NVIDIA Tesla V100 SXM2 16GB", _gib(15.78),
         _flops(15.7, 15.7, 15.7, 125.0), 900e9, _PCIE3, (7, 0), False, 80),
]

DEVICES: dict[str, Device] = {d.name: d for d in _CATALOGUE}


@dataclasses.dataclass(frozen=True)
class Links:
    """How fast a GPU's collectives run, in NCCL's bus-bandwidth convention (nccl-tests PERFORMANCE.md: a
    ring all-gather or reduce-scatter of S bytes over n ranks moves S (n-1)/n through each GPU, an all-reduce
    twice that). Effective per-GPU figures, not data-sheet totals (those count both directions): PyTorch
    inductor's `comm_analysis.py` uses NVLink ~370 GB/s on Hopper, ~240 on Ampere, PCIe ~24 within a node;
    InfiniBand NDR (400 Gb/s per GPU) ~50 GB/s, HDR ~25. `latency` is per ring step (a few microseconds
    for NCCL's simple protocol). Assumptions until measured on the machines themselves.

    `nccl_bytes`: device memory one NCCL communicator holds outside PyTorch's allocator once it has run a
    collective (its channels' buffers; it grows with the channels NCCL opens for the link's bandwidth):
    688 MiB per communicator of more than two A100s over NVLink, measured with PyTorch (NVIDIA/nccl#964);
    about 1.1 GiB on H100 with NVLink SHARP (NVLS) buffers (nccl#864: ~1.6 GB for one communicator, CUDA
    context included; NCCL_NVLS_ENABLE=0 gives most of it back); 484 MiB on a PCIe card (RTX 3090, NCCL
    2.28, nccl#2366). `nccl_net_bytes`: the network proxy's shared buffer a communicator adds once it spans
    nodes (512 MiB, nccl#2363)."""
    within_node: float  # bytes/s
    across_nodes: float  # bytes/s
    nccl_bytes: int
    latency: float = 5e-6  # seconds per ring step
    node_gpus: int = 8  # the most GPUs of this kind one node holds (HGX / DGX boards and PCIe servers: 8)
    nccl_net_bytes: int = 512 * MiB


_LINKS = {"h100": Links(370e9, 50e9, 1126 * MiB), "h200": Links(370e9, 50e9, 1126 * MiB),
          "h100-pcie": Links(24e9, 50e9, 484 * MiB),
          "a100-80gb": Links(240e9, 25e9, 688 * MiB), "a100-40gb": Links(240e9, 25e9, 688 * MiB)}
# consumer and PCIe datacenter cards: PCIe peer copies, 100 GbE across
_PCIE_LINKS = Links(24e9, 12.5e9, 484 * MiB)


def links(dev: Device) -> Links | None:
    """The catalogue's collective speeds for `dev`; None for a CPU (gloo's are not modelled) and for
    V100 (NVLink 2, no figure collected)."""
    if dev.kind != "cuda" or dev.name.startswith("v100"):
        return None
    return _LINKS.get(dev.name, _PCIE_LINKS)


def nccl_communicators(dev: Device, gpus: int, layout: str, gpus_per_node: int | None, tp: int = 1,
                       pp: int = 1) -> tuple[int, int]:
    """The NCCL communicators one rank holds for a layout, and how many of them span nodes: one for the
    whole world (ddp and fsdp all-reduce, gather and reduce in the default group, which a 1-D device mesh
    over every rank reuses); hsdp adds its 2-D mesh's two groups, the replicas across nodes and the shard
    group within one. NCCL creates each at its first collective; every layout makes one in the default group
    (the loss is all-reduced there). Tensor parallelism adds its group, within a node, unless it spans every
    rank; beside data parallelism a mesh's data-parallel axis is a group of its own; a pipeline stage adds a
    point-to-point communicator per neighbouring stage (two in the middle), its neighbours `gpus * tp` ranks
    away. Each is counted at the catalogue's per-communicator figure (none is measured for two-rank ones)."""
    world = gpus * tp * pp
    if world == 1:
        return 0, 0
    speeds = links(dev)
    per_node = gpus_per_node or min(world, speeds.node_gpus if speeds else 8)
    spans = world > per_node
    if layout == "hsdp":
        return 3, 2 * spans  # the world and the replicas span nodes; the shard group is one node
    count, spanning = 1, int(spans)
    if tp > 1 or pp > 1:
        shard = gpus > 1  # the mesh's data-parallel axis: a group of its own
        count += shard + (1 < tp < world) + (pp > 1) * min(2, pp - 1)  # a TP group of every rank is the world
        spanning += shard and gpus * tp > per_node
        spanning += (pp > 1) * min(2, pp - 1) * (gpus * tp >= per_node)
    return count, spanning


def nccl_bytes(dev: Device, gpus: int, layout: str, gpus_per_node: int | None, tp: int = 1,
               pp: int = 1) -> int | None:
    """Device memory NCCL holds on each rank outside PyTorch's allocator (Links.nccl_bytes per communicator,
    and the network buffer of each that spans nodes); None where the catalogue has no figure (V100)."""
    speeds = links(dev)
    count, spanning = nccl_communicators(dev, gpus, layout, gpus_per_node, tp, pp)
    if count and speeds is None:
        return None
    return count * speeds.nccl_bytes + spanning * speeds.nccl_net_bytes if count else 0


def check_node(dev: Device, gpus_per_node: int | None) -> None:
    """A node size the catalogue's nodes can hold (the step time prices the links inside a node as NVLink
    or PCIe, and those between nodes as the network: a larger node would be priced too fast)."""
    speeds = links(dev)
    if gpus_per_node is not None and speeds is not None and gpus_per_node > speeds.node_gpus:
        raise ConfigError(f"{gpus_per_node} GPUs per node: a {dev.name} node holds at most {speeds.node_gpus} "
                          "(HGX / DGX boards, PCIe servers)")

ALIASES: dict[str, str] = {
    "a100": "a100-80gb",
    "v100": "v100-32gb",
    "4090": "rtx-4090",
    "3090": "rtx-3090",
    "h100-sxm": "h100",
}

# How a present GPU's name (torch's props.name, e.g. "NVIDIA H100 80GB HBM3") maps onto the
# catalogue. The first pattern that matches wins, so specific ones come first.
_NAME_PATTERNS = [
    (r"h200", "h200"),
    (r"h100.*(pcie|nvl)", "h100-pcie"),
    (r"h100", "h100"),
    (r"a100.*80", "a100-80gb"),
    (r"a100", "a100-40gb"),
    (r"a10g", "a10g"),
    (r"l40s", "l40s"),
    (r"\bl4\b", "l4"),
    (r"4090", "rtx-4090"),
    (r"3090", "rtx-3090"),
    (r"\bt4\b", "t4"),
    (r"v100.*32", "v100-32gb"),
    (r"v100", "v100-16gb"),
]


# How people and drivers name each entry: (model word, memory as marketed in GB, form factor). A name that
# gives the model word selects the entry; memory and form factor, where given, must agree with it.
_SPELLINGS: dict[str, tuple[str, int, str]] = {
    "h100": ("h100", 80, "sxm"), "h100-pcie": ("h100", 80, "pcie"), "h200": ("h200", 141, "sxm"),
    "a100-80gb": ("a100", 80, "sxm"), "a100-40gb": ("a100", 40, "sxm"), "a10g": ("a10g", 24, "pcie"),
    "rtx-3090": ("3090", 24, "pcie"), "l4": ("l4", 24, "pcie"), "l40s": ("l40s", 48, "pcie"),
    "rtx-4090": ("4090", 24, "pcie"), "t4": ("t4", 16, "pcie"), "v100-32gb": ("v100", 32, "sxm"),
    "v100-16gb": ("v100", 16, "sxm"),
}
# Words that do not tell the catalogue's cards apart: vendor, product line, memory technology.
_NOISE = {"nvidia", "geforce", "rtx", "tesla", "gpu", "hbm2", "hbm2e", "hbm3", "hbm3e", "gddr6", "gddr6x"}


@dataclasses.dataclass(frozen=True)
class Defaults:
    """What memfit assumes on a device when the user does not say (one home for every command)."""
    precision: str              # a single configuration's precision: estimate, --max-micro-batch, train
    precisions: tuple           # what plan searches
    search_offload: bool        # offload only helps where host memory is not device memory


def defaults_for(dev: Device) -> Defaults:
    """CPU: fp32 (and bf16 searched: its kernels are not always faster there). GPU: mixed precision in the
    device's fast half-precision type -- bf16 where the hardware has it, else fp16 with loss scaling; fp32
    is not searched, autocast is smaller and faster on every catalogue GPU."""
    if dev.kind == "cpu":
        return Defaults(precision="fp32", precisions=("fp32", "bf16"), search_offload=False)
    half = "bf16" if dev.bf16 else "fp16"
    return Defaults(precision=half, precisions=(half,), search_offload=True)


def device_names() -> list[str]:
    """Catalogue keys, sorted (aliases, "cpu" and "cuda" excluded)."""
    return sorted(DEVICES)


def aliases_of(name: str) -> list[str]:
    """The short names that also select catalogue entry `name` (e.g. "a100" for "a100-80gb")."""
    return sorted(alias for alias, key in ALIASES.items() if key == name)


def _normalise(name: str) -> str:
    key = re.sub(r"[\s_]+", "-", name.strip().lower())
    return re.sub(r"-+", "-", key).strip("-")


def _read_name(text: str) -> tuple[str | None, int | None, str | None, list[str]]:
    """A card's name as (model word, memory in GB, form factor, words not understood):
    "NVIDIA H100 80GB HBM3" -> ("h100", 80, None, []); "A100-SXM4-40GB" -> ("a100", 40, "sxm", [])."""
    models = {model for model, _, _ in _SPELLINGS.values()}
    model = memory = form = None
    unknown = []
    for word in re.findall(r"[a-z0-9]+", text.lower()):
        word = re.sub(r"^rtx(?=\d)", "", word)  # rtx4090
        size = re.fullmatch(r"(\d+)(?:gb|gib|g)?", word)
        if word in _NOISE:
            continue
        if model is None and word in models:
            model = word
        elif memory is None and size and model is not None:
            memory = int(size.group(1))
        elif form is None and re.fullmatch(r"sxm\d?|pcie|nvl", word):
            form = word.rstrip("0123456789")  # SXM2/4/5 are generations of one socket
        else:
            unknown.append(word)
    return model, memory, form, unknown


def _one_slip(typed: str, known: str) -> bool:
    """Whether `typed` is `known` with one keystroke wrong: a character added, dropped or changed, or two
    neighbours swapped. One digit changed into another is not a slip but another product (h200, rtx-4080)."""
    if typed == known or min(len(typed), len(known)) < 3:
        return False
    if len(typed) == len(known):
        diff = [i for i, (a, b) in enumerate(zip(typed, known)) if a != b]
        if len(diff) == 1:
            return not (typed[diff[0]].isdigit() and known[diff[0]].isdigit())
        i = diff[0]
        return len(diff) == 2 and diff[1] == i + 1 and typed[i] == known[i + 1] and typed[i + 1] == known[i]
    short, long = sorted((typed, known), key=len)
    return len(long) - len(short) == 1 and any(long[:i] + long[i + 1:] == short for i in range(len(long)))


def _from_spelling(text: str) -> tuple[str | None, str]:
    """(catalogue key, "") for a name that spells an entry out; (None, why not) otherwise."""
    model, memory, form, unknown = _read_name(text)
    if model is None or unknown:
        return None, ""
    entries = [k for k, (m, _, _) in _SPELLINGS.items() if m == model]
    fits = [k for k in entries if memory in (None, _SPELLINGS[k][1]) and form in (None, _SPELLINGS[k][2])]
    default = ALIASES.get(model, model)
    if len(fits) > 1 and default in fits:
        fits = [default]
    if len(fits) == 1:
        return fits[0], ""
    listed = ", ".join(f"{k} ({DEVICES[k].description})" for k in (fits or entries))
    if fits:
        return None, f"it could be any of {listed}"
    given = " ".join(x for x in (f"{memory}GB" if memory is not None else "", form or "") if x)
    return None, f"it has no {model} {given}; its {model} cards: {listed}"


def get_device(name: str) -> Device:
    """Look a device up by catalogue name, alias or a common spelling of the card ("h100-80gb", "h100 sxm",
    "NVIDIA H100 80GB HBM3"). Case doesn't matter, and `_` or a space counts as `-`. "cpu" describes this
    machine, and "cuda" or "cuda:N" the GPU present."""
    key = _normalise(name)
    if key == "cpu":
        return _host_cpu()
    if key == "cuda" or key.startswith("cuda:"):
        return _present_gpu(key)
    key = ALIASES.get(key, key)
    if key in DEVICES:
        return DEVICES[key]
    found, why = _from_spelling(key)
    if found:
        return DEVICES[found]
    known = ", ".join(["cpu", "cuda"] + device_names())
    if why:
        raise ConfigError(f"device {name!r} is not in memfit's catalogue: {why}")
    # A suggestion only for a slip of the keyboard; a different card gets the list, not a misleading guess.
    words = re.findall(r"[a-z0-9]+", key)
    close = [k for k in ["cpu", "cuda", *device_names(), *ALIASES] if _one_slip(key, k)]
    models = {m for m, _, _ in _SPELLINGS.values()}
    for i, word in enumerate(words):
        for model in sorted(models):
            if _one_slip(word, model):
                fixed, _ = _from_spelling(" ".join(words[:i] + [model] + words[i + 1:]))
                close += [fixed] if fixed else []
    if close:
        raise ConfigError(f"unknown device {name!r} (did you mean {close[0]!r}?); known devices: {known}")
    raise ConfigError(f"unknown device {name!r}: not in memfit's catalogue (`memfit list` shows it); "
                     f"known devices: {known}")


def _host_cpu() -> Device:
    """This machine as a training target. FLOP/s and DRAM bandwidth are unknown until
    calibrated. host_bandwidth is infinite because tensors already live in host memory, so
    "offloading" them moves nothing."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows): size unknown
        memory = 0
    cores = os.cpu_count() or 0
    desc = f"host CPU ({platform.machine() or 'unknown'}, {cores} logical cores)"
    return Device("cpu", "cpu", desc, memory, {}, 0.0, math.inf, None, True, 0, 0)


def _present_gpu(key: str) -> Device:
    """Describe the GPU this process can see. Memory and compute capability come from the
    driver. FLOP/s and bandwidths are borrowed from the catalogue entry the name matches, and
    stay unknown ({} / 0.0) for a GPU the catalogue lacks."""
    import torch  # deferred: the catalogue itself must not need torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise ConfigError("no CUDA GPU is present; name a catalogue device instead, e.g. --device h100")
    index = 0
    if ":" in key:
        try:
            index = int(key.split(":", 1)[1])
        except ValueError:
            raise ConfigError(f"malformed device {key!r}: use cuda or cuda:N") from None
    if not 0 <= index < torch.cuda.device_count():
        raise ConfigError(f"no CUDA device {index}: this machine has {torch.cuda.device_count()}")
    props = torch.cuda.get_device_properties(index)
    cc = (props.major, props.minor)
    lowered = props.name.lower()
    match = next((DEVICES[k] for pattern, k in _NAME_PATTERNS if re.search(pattern, lowered)), None)
    return Device(
        name=f"cuda:{index}",
        kind="cuda",
        description=props.name,
        memory_bytes=int(props.total_memory),
        peak_flops=dict(match.peak_flops) if match else {},
        memory_bandwidth=match.memory_bandwidth if match else 0.0,
        host_bandwidth=match.host_bandwidth if match else _PCIE4,
        compute_capability=cc,
        bf16=cc >= (8, 0),
        context_bytes=context_bytes_for(cc),
        cublas_workspace_bytes=cublas_workspace_bytes(cc, os.environ.get("CUBLAS_WORKSPACE_CONFIG")),
        multiprocessors=props.multi_processor_count,
    )
