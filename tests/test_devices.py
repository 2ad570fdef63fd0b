"""The device catalogue: lookups, aliases, the host CPU, and the figures other modules rely on."""
from __future__ import annotations

import os

import pytest
import torch

from memfit.memory import devices
from memfit.memory.devices import DEVICES, Device, cublas_workspace_bytes, device_names, get_device

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

EXPECTED = ["a100-40gb", "a100-80gb", "a10g", "h100", "h100-pcie", "h200", "l4", "l40s", "rtx-3090",
            "rtx-4090", "t4", "v100-16gb", "v100-32gb"]


def test_catalogue_names():
    assert device_names() == EXPECTED
    assert set(DEVICES) == set(EXPECTED)
    for name, dev in DEVICES.items():
        assert dev.name == name and dev.kind == "cuda"


@pytest.mark.parametrize("query, expected", [
    ("h100", "h100"), ("H100", "h100"), ("  h100-PCIe ", "h100-pcie"), ("h100_pcie", "h100-pcie"),
    ("h100 pcie", "h100-pcie"), ("A100", "a100-80gb"), ("a100_40gb", "a100-40gb"), ("v100", "v100-32gb"),
    ("V100 16GB", "v100-16gb"), ("4090", "rtx-4090"), ("RTX_4090", "rtx-4090"), ("3090", "rtx-3090"),
    ("rtx 3090", "rtx-3090"), ("T4", "t4"), ("L40S", "l40s"), ("a10g", "a10g"),
])
def test_lookup_is_case_and_separator_insensitive_with_aliases(query, expected):
    assert get_device(query) is DEVICES[expected]


def test_memory_sizes_are_what_torch_reports():
    # PyTorch's "total capacity" figures (binary GiB, two decimals), kept to a whole MiB
    assert get_device("h100").memory_bytes == 81009 * MiB            # 79.11 GiB
    assert get_device("a100-80gb").memory_bytes == 81152 * MiB       # 79.25 GiB
    assert get_device("a100-40gb").memory_bytes == 42_298_834_944    # deviceQuery, exact
    assert get_device("t4").memory_bytes == 15104 * MiB              # 14.75 GiB
    assert get_device("rtx-4090").memory_bytes == 24207 * MiB        # 23.64 GiB
    # usable memory is below the marketing size but within a few percent of it
    for name, nominal_gib in [("h100", 80), ("h200", 141), ("a100-80gb", 80), ("a100-40gb", 40),
                              ("l4", 24e9 / GiB), ("l40s", 48e9 / GiB), ("rtx-4090", 24), ("rtx-3090", 24),
                              ("t4", 16), ("v100-32gb", 32), ("v100-16gb", 16), ("a10g", 24e9 / GiB)]:
        ratio = get_device(name).memory_bytes / (nominal_gib * GiB)
        assert 0.90 < ratio < 1.0, name


def test_cublas_workspace_follows_pytorch_defaults():
    assert get_device("h100").cublas_workspace_bytes == 32 * MiB                # ":4096:8" on Hopper
    assert get_device("h200").cublas_workspace_bytes == 32 * MiB
    for name in ("a100-80gb", "l4", "rtx-3090", "t4", "v100-32gb"):
        assert get_device(name).cublas_workspace_bytes == 8 * MiB + 128 * KiB  # ":4096:2:16:8"
    assert cublas_workspace_bytes((8, 0), ":4096:8") == 32 * MiB
    assert cublas_workspace_bytes((9, 0), ":16:8") == 128 * KiB
    assert cublas_workspace_bytes((9, 0), "garbage") == 32 * MiB             # unparsable: default
    assert cublas_workspace_bytes((10, 0)) == 32 * MiB                       # Blackwell
    assert cublas_workspace_bytes(None) == 0


def test_figures_are_dense_and_consistent():
    h100 = get_device("h100")
    assert h100.peak_flops["bf16"] == pytest.approx(989.4e12)  # dense, not the 1979 sparse figure
    assert h100.compute_capability == (9, 0) and h100.bf16
    assert get_device("a100").peak_flops == {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}
    assert get_device("h200").memory_bandwidth == 4.8e12
    assert get_device("h100").host_bandwidth == 50e9 and get_device("a100").host_bandwidth == 25e9
    for name in ("t4", "v100-16gb", "v100-32gb"):
        dev = get_device(name)
        assert not dev.bf16
        assert dev.peak_flops["bf16"] == dev.peak_flops["tf32"] == dev.peak_flops["fp32"]
    for dev in DEVICES.values():
        assert set(dev.peak_flops) == {"fp32", "tf32", "bf16", "fp16"}
        if dev.bf16:
            assert dev.peak_flops["fp32"] <= dev.peak_flops["tf32"] <= dev.peak_flops["bf16"] == dev.peak_flops["fp16"]
        assert 300 * MiB <= dev.context_bytes <= 600 * MiB
        assert dev.memory_bandwidth > 0 and dev.host_bandwidth > 0


def test_devices_are_immutable():
    with pytest.raises(Exception):
        get_device("h100").memory_bytes = 1  # type: ignore[misc]


def test_unknown_device_lists_known_names_on_one_line():
    with pytest.raises(ValueError) as err:
        get_device("h1000")
    msg = str(err.value)
    assert "\n" not in msg
    assert "'h1000'" in msg and "did you mean" in msg
    for name in ["cpu", "cuda"] + EXPECTED:
        assert name in msg
    with pytest.raises(ValueError) as err:
        get_device("tpu-v5")
    assert "did you mean" not in str(err.value) and "h100" in str(err.value)


@pytest.mark.parametrize("query, expected", [
    ("h100-80gb", "h100"), ("h100-sxm", "h100"), ("H100 SXM5 80GB", "h100"), ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H100 PCIe", "h100-pcie"), ("h100-pcie-80gb", "h100-pcie"), ("h200-141gb", "h200"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("a100-sxm4-40gb", "a100-40gb"), ("a100 40g", "a100-40gb"),
    ("nvidia a100", "a100-80gb"), ("rtx4090", "rtx-4090"), ("NVIDIA GeForce RTX 3090", "rtx-3090"),
    ("Tesla T4", "t4"), ("Tesla V100-SXM2-16GB", "v100-16gb"), ("l40s-48gb", "l40s"),
])
def test_common_spellings_of_catalogue_cards(query, expected):
    assert get_device(query) is DEVICES[expected]


@pytest.mark.parametrize("query, listed", [
    ("h100-nvl", ["h100 (NVIDIA H100 SXM5 80GB)", "h100-pcie"]),   # the 94GB NVL is another card
    ("a100-pcie", ["a100-80gb", "a100-40gb"]),
    ("h100-94gb", ["h100", "h100-pcie"]),
])
def test_a_variant_the_catalogue_lacks_is_not_mistaken_for_one_it_has(query, listed):
    with pytest.raises(ValueError) as err:
        get_device(query)
    msg = str(err.value)
    assert "not in memfit's catalogue" in msg and "did you mean" not in msg and "\n" not in msg
    assert all(name in msg for name in listed)


@pytest.mark.parametrize("query", ["mi300x", "rtx-4080", "h800", "gaudi2"])
def test_a_card_not_in_the_catalogue_gets_the_list_not_a_guess(query):
    with pytest.raises(ValueError) as err:
        get_device(query)
    msg = str(err.value)
    assert "not in memfit's catalogue" in msg and "did you mean" not in msg
    assert all(name in msg for name in EXPECTED)


@pytest.mark.parametrize("query, meant", [("h1000", "h100"), ("rtx-4900", "rtx-4090"), ("a100-80bg", "a100-80gb"),
                                          ("h100-pcei", "h100-pcie"), ("l40", "l40s"), ("h1000-80gb", "h100")])
def test_a_slip_of_the_keyboard_gets_a_suggestion(query, meant):
    with pytest.raises(ValueError, match=f"did you mean '{meant}'"):
        get_device(query)


def test_spellings_agree_with_the_catalogue():
    """Every entry is spelled, its memory and form factor are those its description gives, and a model word
    shared by several entries picks one of them when typed alone (as "a100" does)."""
    assert set(devices._SPELLINGS) == set(DEVICES)
    for name, (model, gb, form) in devices._SPELLINGS.items():
        words = DEVICES[name].description.lower().replace("-", " ").split()
        assert model in words and f"{gb}gb" in words, name
        assert form == "pcie" or any(w.startswith(form) for w in words), name
        assert get_device(model).name in [k for k, (m, _, _) in devices._SPELLINGS.items() if m == model]


def test_cpu_is_this_machine():
    cpu = get_device("cpu")
    assert isinstance(cpu, Device) and cpu.kind == "cpu" and cpu.name == "cpu"
    assert cpu.memory_bytes == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert cpu.peak_flops == {} and cpu.compute_capability is None and cpu.bf16
    assert cpu.context_bytes == 0 and cpu.cublas_workspace_bytes == 0
    assert get_device(" CPU ") == cpu


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_says_what_to_do():
    for name in ("cuda", "cuda:0", "CUDA:1"):
        with pytest.raises(ValueError, match="no CUDA GPU is present; name a catalogue device instead"):
            get_device(name)


class _Props:
    def __init__(self, name, total_memory, major, minor):
        self.name, self.total_memory, self.major, self.minor = name, total_memory, major, minor
        self.multi_processor_count = 77


@pytest.mark.parametrize("gpu_name, cc, match", [
    ("NVIDIA H100 80GB HBM3", (9, 0), "h100"),
    ("NVIDIA H100 PCIe", (9, 0), "h100-pcie"),
    ("NVIDIA A100-SXM4-80GB", (8, 0), "a100-80gb"),
    ("NVIDIA A100-SXM4-40GB", (8, 0), "a100-40gb"),
    ("Tesla T4", (7, 5), "t4"),
    ("NVIDIA L4", (8, 9), "l4"),
    ("NVIDIA L40S", (8, 9), "l40s"),
    ("NVIDIA GeForce RTX 4090", (8, 9), "rtx-4090"),
    ("Tesla V100-SXM2-16GB", (7, 0), "v100-16gb"),
    ("NVIDIA RTX A6000", (8, 6), None),
])
def test_present_gpu_borrows_catalogue_figures(monkeypatch, gpu_name, cc, match):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: _Props(gpu_name, 12345 * MiB, *cc))
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    dev = get_device("cuda:1")
    assert (dev.name, dev.kind, dev.description) == ("cuda:1", "cuda", gpu_name)
    assert dev.memory_bytes == 12345 * MiB and dev.compute_capability == cc
    assert dev.bf16 == (cc >= (8, 0))
    assert dev.cublas_workspace_bytes == devices.cublas_workspace_bytes(cc)
    assert dev.multiprocessors == 77  # the GPU's own count, which sizes vLLM's sampler scratch
    if match is None:
        assert dev.peak_flops == {} and dev.memory_bandwidth == 0.0
    else:
        assert dev.peak_flops == DEVICES[match].peak_flops
        assert dev.memory_bandwidth == DEVICES[match].memory_bandwidth
    with pytest.raises(ValueError, match="no CUDA device 2"):
        get_device("cuda:2")


def test_devices_are_hashable():
    assert len({get_device("h100"), get_device("H100"), get_device("a100")}) == 2
