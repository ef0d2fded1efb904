"""The GPU catalog: entries are complete and consistent, names resolve, device names are detected."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bigtune.core.gpus import (
    CATALOG,
    GPU,
    UnknownGPUError,
    custom_gpu,
    detect_gpu,
    find_gpu,
    normalize_name,
    peak_flops,
)

GIB = 2**30
ROOT = Path(__file__).resolve().parents[1]

REQUIRED_KEYS = {
    "v100-sxm2-16gb",
    "v100-sxm2-32gb",
    "t4-16gb",
    "a10g-24gb",
    "a10-24gb",
    "l4-24gb",
    "l40s-48gb",
    "rtx-a6000-48gb",
    "rtx-3090-24gb",
    "rtx-4090-24gb",
    "a100-sxm-40gb",
    "a100-sxm-80gb",
    "a100-pcie-80gb",
    "h100-pcie-80gb",
    "h100-sxm-80gb",
    "h100-nvl-94gb",
    "h200-sxm-141gb",
    "b200-180gb",
}


# ------------------------------------------------------------------------------------- entries


def test_catalog_has_the_required_models():
    assert REQUIRED_KEYS <= set(CATALOG)


@pytest.mark.parametrize("gpu", list(CATALOG.values()), ids=list(CATALOG))
def test_every_entry_is_complete(gpu: GPU):
    assert CATALOG[gpu.key] is gpu
    assert gpu.key == gpu.key.lower() == normalize_name(gpu.key)
    assert gpu.name.strip()
    assert all(a == a.lower() for a in gpu.aliases)
    assert gpu.memory_gib > 0
    assert gpu.mem_bandwidth_gbs is not None and gpu.mem_bandwidth_gbs > 0
    assert gpu.interconnect.strip()
    assert gpu.interconnect_gbs is not None and gpu.interconnect_gbs > 0
    assert gpu.fp32_tflops is not None and gpu.fp32_tflops > 0
    assert gpu.fp16_tflops is not None and gpu.fp16_tflops > 0
    assert len(gpu.source) > 10 and gpu.source.strip() == gpu.source


@pytest.mark.parametrize("gpu", list(CATALOG.values()), ids=list(CATALOG))
def test_numbers_are_dense_and_ordered(gpu: GPU):
    # Tensor-core half precision beats CUDA-core fp32 everywhere, TF32 sits between them, and bf16
    # (where present) runs at the fp16 rate: a sparse figure copied by mistake would break these.
    assert gpu.fp16_tflops > gpu.fp32_tflops
    if gpu.bf16_tflops is not None:
        assert gpu.bf16_tflops == pytest.approx(gpu.fp16_tflops)
    if gpu.tf32_tflops is not None:
        assert gpu.fp32_tflops <= gpu.tf32_tflops <= gpu.fp16_tflops / 2 * 1.02  # L40S: 183 vs 362.05
    # Usable memory is below the marketing size but not absurdly so.
    size_gb = int(gpu.key.rsplit("-", 1)[1].removesuffix("gb"))
    assert 0.85 * size_gb < gpu.memory_gib < size_gb


def test_precision_support_matches_the_hardware_generation():
    for key in ("v100-sxm2-16gb", "v100-sxm2-32gb", "t4-16gb"):
        assert CATALOG[key].bf16_tflops is None
        assert CATALOG[key].tf32_tflops is None
    for key in REQUIRED_KEYS - {"v100-sxm2-16gb", "v100-sxm2-32gb", "t4-16gb"}:
        assert CATALOG[key].bf16_tflops is not None
        assert CATALOG[key].tf32_tflops is not None


def test_known_datasheet_values():
    h100 = CATALOG["h100-sxm-80gb"]
    assert h100.bf16_tflops == pytest.approx(989, rel=0.01)
    assert h100.mem_bandwidth_gbs == 3350
    assert h100.interconnect_gbs == 900
    a100 = CATALOG["a100-sxm-80gb"]
    assert (a100.bf16_tflops, a100.tf32_tflops, a100.fp32_tflops) == (312, 156, 19.5)
    assert CATALOG["a100-sxm-40gb"].mem_bandwidth_gbs == 1555
    assert CATALOG["v100-sxm2-32gb"].fp16_tflops == 125
    assert CATALOG["h200-sxm-141gb"].bf16_tflops == h100.bf16_tflops
    assert CATALOG["h200-sxm-141gb"].memory_gib > 130
    assert CATALOG["b200-180gb"].bf16_tflops == pytest.approx(2250)
    # GeForce cards: fp16 with FP32 accumulation, i.e. half the marketing FP16-accumulate figure.
    assert CATALOG["rtx-4090-24gb"].fp16_tflops == pytest.approx(165.2)
    assert CATALOG["rtx-3090-24gb"].fp16_tflops == pytest.approx(71)


def test_80gb_cards_report_less_than_80_gib():
    for key in ("a100-sxm-80gb", "a100-pcie-80gb", "h100-sxm-80gb", "h100-pcie-80gb"):
        assert 78 < CATALOG[key].memory_gib < 80
        assert CATALOG[key].memory_bytes == int(CATALOG[key].memory_gib * GIB)


def test_entries_are_frozen():
    with pytest.raises(AttributeError):
        CATALOG["t4-16gb"].memory_gib = 1.0  # type: ignore[misc]


# --------------------------------------------------------------------------------------- find_gpu


@pytest.mark.parametrize("key", sorted(CATALOG))
def test_find_by_key_and_by_alias(key):
    gpu = CATALOG[key]
    assert find_gpu(key) is gpu
    assert find_gpu(key.upper()) is gpu
    assert find_gpu(gpu.name) is gpu
    for alias in gpu.aliases:
        assert find_gpu(alias) is gpu, alias


@pytest.mark.parametrize(
    "spelling, key",
    [
        ("H100_80GB", "h100-sxm-80gb"),
        ("h100", "h100-sxm-80gb"),
        ("  H100  80GB  HBM3 ", "h100-sxm-80gb"),
        ("H100 PCIe", "h100-pcie-80gb"),
        ("h100-nvl", "h100-nvl-94gb"),
        ("a100 80gb", "a100-sxm-80gb"),
        ("A100_40GB", "a100-sxm-40gb"),
        ("A100 80GB PCIe", "a100-pcie-80gb"),
        ("RTX-4090", "rtx-4090-24gb"),
        ("rtx4090", "rtx-4090-24gb"),
        ("GeForce RTX 3090", "rtx-3090-24gb"),
        ("Tesla T4", "t4-16gb"),
        ("A10G", "a10g-24gb"),
        ("a10", "a10-24gb"),
        ("L40S", "l40s-48gb"),
        ("RTX A6000", "rtx-a6000-48gb"),
        ("V100_32GB", "v100-sxm2-32gb"),
        ("H200", "h200-sxm-141gb"),
        ("b200", "b200-180gb"),
        # torch device-name strings resolve too
        ("NVIDIA A100-SXM4-80GB", "a100-sxm-80gb"),
        ("NVIDIA H100 80GB HBM3", "h100-sxm-80gb"),
        ("Tesla V100-SXM2-16GB", "v100-sxm2-16gb"),
    ],
)
def test_find_messy_spellings(spelling, key):
    assert find_gpu(spelling).key == key


def test_aliases_are_unambiguous():
    seen: dict[str, str] = {}
    for gpu in CATALOG.values():
        for name in (gpu.key, *gpu.aliases):
            n = normalize_name(name)
            assert seen.setdefault(n, gpu.key) == gpu.key, f"{name!r} names two GPUs"


def test_unknown_name_lists_close_matches_keys_and_the_memory_flag():
    with pytest.raises(UnknownGPUError) as exc:
        find_gpu("H1000")
    msg = str(exc.value)
    assert "h100-sxm-80gb" in msg.split("Known GPUs")[0]  # a close match, before the full list
    for key in CATALOG:
        assert key in msg
    assert "--gpu-memory GIB" in msg
    assert isinstance(exc.value, ValueError)


@pytest.mark.parametrize(
    "ambiguous, candidates",
    [
        ("a100", {"a100-sxm-40gb", "a100-sxm-80gb"}),
        ("V100", {"v100-sxm2-16gb", "v100-sxm2-32gb"}),
    ],
)
def test_names_without_a_size_are_not_guessed(ambiguous, candidates):
    with pytest.raises(UnknownGPUError) as exc:
        find_gpu(ambiguous)
    close = str(exc.value).split("Known GPUs")[0]
    assert any(c in close for c in candidates)


@pytest.mark.parametrize("bad", ["", "   ", "rtx-9999", "mi300x"])
def test_unknown_names_raise(bad):
    with pytest.raises(UnknownGPUError):
        find_gpu(bad)


# ------------------------------------------------------------------------------------- custom_gpu


def test_custom_gpu_without_base():
    g = custom_gpu(22.5)
    assert g.key == "custom-22.5gib"
    assert g.memory_gib == 22.5
    assert g.bf16_tflops is None and g.mem_bandwidth_gbs is None
    assert peak_flops(g, "bf16-true") is None
    assert custom_gpu(40).key == "custom-40gib"


def test_custom_gpu_with_base_keeps_everything_but_memory():
    base = find_gpu("h100")
    g = custom_gpu(70, base=base)
    assert g.memory_gib == 70.0
    assert base.memory_gib == pytest.approx(79.11)  # the catalog entry is untouched
    assert g.key != base.key and g.key.startswith(base.key)
    assert g.bf16_tflops == base.bf16_tflops
    assert g.mem_bandwidth_gbs == base.mem_bandwidth_gbs
    assert peak_flops(g, "bf16-mixed") == peak_flops(base, "bf16-mixed")


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf")])
def test_custom_gpu_rejects_non_positive_memory(bad):
    with pytest.raises(ValueError):
        custom_gpu(bad)


# ------------------------------------------------------------------------------------- detect_gpu


@pytest.mark.parametrize(
    "device_name, memory_gib, key",
    [
        ("NVIDIA H100 80GB HBM3", 79.11, "h100-sxm-80gb"),
        ("NVIDIA H100 PCIe", 79.11, "h100-pcie-80gb"),
        ("NVIDIA H100 NVL", 93.0, "h100-nvl-94gb"),
        ("NVIDIA A100-SXM4-80GB", 79.15, "a100-sxm-80gb"),
        ("NVIDIA A100-SXM4-40GB", 39.59, "a100-sxm-40gb"),
        ("NVIDIA A100 80GB PCIe", 79.15, "a100-pcie-80gb"),
        ("NVIDIA A100-PCIE-40GB", 39.5, "a100-pcie-40gb"),
        ("NVIDIA H200", 139.8, "h200-sxm-141gb"),
        ("NVIDIA H200 NVL", 139.8, "h200-nvl-141gb"),
        ("NVIDIA B200", 178.35, "b200-180gb"),
        ("NVIDIA GH200 480GB", 95.0, "gh200-96gb"),
        ("NVIDIA GeForce RTX 4090", 23.64, "rtx-4090-24gb"),
        ("NVIDIA GeForce RTX 3090", 23.69, "rtx-3090-24gb"),
        ("Tesla V100-SXM2-32GB", 31.74, "v100-sxm2-32gb"),
        ("Tesla V100-SXM2-16GB", 15.77, "v100-sxm2-16gb"),
        ("Tesla T4", 14.75, "t4-16gb"),
        ("NVIDIA A10G", 22.0, "a10g-24gb"),
        ("NVIDIA A10", 22.0, "a10-24gb"),
        ("NVIDIA L4", 22.0, "l4-24gb"),
        ("NVIDIA L40S", 44.42, "l40s-48gb"),
        ("NVIDIA RTX A6000", 47.54, "rtx-a6000-48gb"),
    ],
)
def test_detect_device_names(device_name, memory_gib, key):
    assert detect_gpu(device_name).key == key
    assert detect_gpu(device_name, int(memory_gib * GIB)).key == key


def test_detect_a100_size_from_memory_when_the_name_has_none():
    assert detect_gpu("NVIDIA A100-SXM4", int(39.59 * GIB)).key == "a100-sxm-40gb"
    assert detect_gpu("NVIDIA A100-SXM4", int(79.15 * GIB)).key == "a100-sxm-80gb"
    assert detect_gpu("NVIDIA A100 PCIe", int(39.5 * GIB)).key == "a100-pcie-40gb"
    assert detect_gpu("NVIDIA A100 PCIe", int(79.15 * GIB)).key == "a100-pcie-80gb"
    assert detect_gpu("Tesla V100-SXM2", int(31.74 * GIB)).key == "v100-sxm2-32gb"
    # the size printed in the name wins
    assert detect_gpu("NVIDIA A100-SXM4-40GB", int(39.59 * GIB)).key == "a100-sxm-40gb"
    # with no size anywhere, the smaller card is assumed
    assert detect_gpu("NVIDIA A100-SXM4").key == "a100-sxm-40gb"


@pytest.mark.parametrize(
    "device_name",
    [
        "",
        "NVIDIA GeForce RTX 2080 Ti",
        "NVIDIA L40",
        "NVIDIA RTX 6000 Ada Generation",
        "NVIDIA GeForce RTX 4090 D",
        "NVIDIA GeForce RTX 3090 Ti",
        "NVIDIA GeForce RTX 4090 Laptop GPU",
        "Tesla V100-PCIE-32GB",
        "NVIDIA A100-SXM4-80GB MIG 3g.40gb",
        "AMD Instinct MI300X",
        "cpu",
    ],
)
def test_detect_unknown_gives_none(device_name):
    assert detect_gpu(device_name, 24 * GIB) is None


# ------------------------------------------------------------------------------------- peak_flops


def test_peak_flops_h100_bf16_is_the_dense_sxm_figure():
    h100 = find_gpu("h100")
    for p in ("bf16-true", "bf16-mixed"):
        assert peak_flops(h100, p) == pytest.approx(989e12, rel=0.01)
    assert peak_flops(h100, "16-mixed") == pytest.approx(989e12, rel=0.01)
    assert peak_flops(h100, "16-true") == peak_flops(h100, "16-mixed")


def test_peak_flops_32_true_uses_tf32_only_when_allowed():
    a100 = CATALOG["a100-sxm-80gb"]
    assert peak_flops(a100, "32-true") == pytest.approx(19.5e12)
    assert peak_flops(a100, "32-true", allow_tf32=False) == pytest.approx(19.5e12)
    assert peak_flops(a100, "32-true", allow_tf32=True) == pytest.approx(156e12)
    v100 = CATALOG["v100-sxm2-32gb"]  # no TF32: falls back to FP32 even when allowed
    assert peak_flops(v100, "32-true", allow_tf32=True) == pytest.approx(15.7e12)


def test_peak_flops_without_bf16_is_none():
    for key in ("v100-sxm2-16gb", "v100-sxm2-32gb", "t4-16gb"):
        assert peak_flops(CATALOG[key], "bf16-true") is None
        assert peak_flops(CATALOG[key], "bf16-mixed") is None
        assert peak_flops(CATALOG[key], "16-mixed") > 0
    assert peak_flops(CATALOG["v100-sxm2-32gb"], "16-mixed") == pytest.approx(125e12)


@pytest.mark.parametrize("gpu", list(CATALOG.values()), ids=list(CATALOG))
def test_peak_flops_is_in_flops_not_tflops(gpu: GPU):
    for p in ("bf16-true", "bf16-mixed", "16-true", "16-mixed", "32-true"):
        v = peak_flops(gpu, p)
        assert v is None or 1e12 < v < 1e16


def test_peak_flops_rejects_unknown_precision():
    with pytest.raises(ValueError):
        peak_flops(CATALOG["t4-16gb"], "fp8-lol")
    assert peak_flops(CATALOG["t4-16gb"], "64-true") is None


# ---------------------------------------------------------------------------------------- imports


def test_import_does_not_load_torch():
    code = (
        "import sys, bigtune\n"
        "before = 'torch' in sys.modules\n"
        "import bigtune.core.gpus\n"
        "print('skip' if before else ('torch' in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": ""},
    )
    result = out.stdout.strip()
    if result == "skip":
        pytest.skip("the bigtune package itself imports torch")
    assert result == "False"
