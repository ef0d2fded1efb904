"""GPU catalog: device memory, peak throughput, memory bandwidth and interconnect per GPU model.

The planner uses this table to say whether a recipe fits on a given card and how long a step should
take at best. Everything here is plain data; importing the module does not import torch.

Where the numbers come from
---------------------------
* Throughput (``*_tflops``) is NVIDIA's published peak from the datasheet or architecture
  whitepaper named in each entry's ``source``. All tensor-core figures are DENSE: NVIDIA's
  datasheets headline the 2:4 structured-sparsity rate (marked with an asterisk there), which is
  exactly twice the dense rate; those headline numbers were halved. Dense training never reaches the
  sparse rate, and in practice reaches 40-80 % of the dense one.
* ``fp32_tflops`` is the plain CUDA-core FP32 rate (no tensor cores). ``tf32_tflops`` is the
  tensor-core TF32 rate, used by PyTorch for float32 matmuls only when TF32 is switched on (see
  :func:`peak_flops`). ``None`` means the hardware has no such mode (V100 and T4 have neither bf16
  nor TF32).
* ``fp16_tflops`` is the fp16 tensor-core rate with FP32 accumulation, because that is what
  PyTorch's half-precision GEMMs request from cuBLAS. On data-center parts this equals the
  fp16-accumulate rate; on GeForce cards (RTX 3090, RTX 4090) it is half of it, and the larger
  marketing number is not used.
* ``memory_gib`` is what the device offers a process: ``torch.cuda.get_device_properties(i)
  .total_memory / 2**30``. That is less than the marketing "GB" (the driver and ECC keep some) and
  drifts by a few hundred MiB between driver versions. Each entry says whether its value was observed
  from PyTorch on that card, or estimated from ``nvidia-smi``'s total minus the ~0.5 GiB that
  PyTorch typically reports less on similar cards.
* ``mem_bandwidth_gbs`` is the datasheet peak DRAM bandwidth in GB/s (10**9 bytes/s).
* ``interconnect_gbs`` is the per-GPU, bidirectional GPU-to-GPU bandwidth of the link a typical
  multi-GPU box of that model uses (NVLink through NVSwitch for SXM parts, NVLink bridges for NVL
  parts, PCIe otherwise; optional bridges for PCIe cards are named in ``interconnect`` but not
  counted).

Names that stand for cards with different memory sizes (bare "a100", "v100") are deliberately not
aliases: :func:`find_gpu` then lists the candidates instead of guessing a size.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from dataclasses import dataclass
from typing import Optional

__all__ = [
    "GPU",
    "CATALOG",
    "UnknownGPUError",
    "find_gpu",
    "custom_gpu",
    "detect_gpu",
    "peak_flops",
    "normalize_name",
    "cublas_workspace_bytes",
    "compute_capability",
]

_GIB = 2**30


class UnknownGPUError(ValueError):
    """A GPU name that is not in the catalog; the message lists close matches and every key."""


@dataclass(frozen=True)
class GPU:
    key: str  # canonical lowercase id, e.g. "h100-sxm-80gb"
    name: str  # marketing name
    aliases: tuple[str, ...]  # lowercase alternative spellings (normalised on lookup)
    memory_gib: float  # usable device memory in GiB (see module docstring)
    bf16_tflops: Optional[float]  # dense bf16 tensor-core peak; None = no bf16 support
    fp16_tflops: Optional[float]  # dense fp16 tensor-core peak, FP32 accumulate
    fp32_tflops: Optional[float]  # CUDA-core FP32 peak (no tensor cores)
    tf32_tflops: Optional[float]  # dense TF32 tensor-core peak; None = no TF32 support
    mem_bandwidth_gbs: Optional[float]  # peak DRAM bandwidth, GB/s
    interconnect: str  # the GPU-to-GPU link, in words
    interconnect_gbs: Optional[float]  # per-GPU bidirectional GB/s of that link
    source: str  # where the numbers come from
    sms: Optional[int] = None  # streaming multiprocessors (the time model's wave quantization)

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * _GIB)


_PCIE3 = "PCIe 3.0 x16 32 GB/s"

_PCIE4 = "PCIe 4.0 x16 64 GB/s"

_PCIE5 = "PCIe 5.0 x16 128 GB/s"

_ENTRIES: tuple[GPU, ...] = (
    # ---------------------------------------------------------------- Volta / Turing
    GPU(
        key="v100-sxm2-16gb",
        name="NVIDIA Tesla V100 SXM2 16GB",
        aliases=("v100-16gb", "v100 16gb", "tesla v100 16gb", "v100-sxm2-16gb", "v100 sxm2 16gb"),
        # Observed: PyTorch reports 15.75-15.78 GiB on V100-SXM2-16GB depending on driver.
        memory_gib=15.77,
        bf16_tflops=None,  # Volta tensor cores have no bf16 mode.
        fp16_tflops=125.0,  # "Tensor Performance 125 TFLOPS" (no sparsity on Volta).
        fp32_tflops=15.7,
        tf32_tflops=None,  # TF32 arrived with Ampere.
        mem_bandwidth_gbs=900.0,
        interconnect="NVLink2 300 GB/s",
        interconnect_gbs=300.0,
        sms=80,
        source="NVIDIA Tesla V100 datasheet (2020), V100 SXM2 column",
    ),
    GPU(
        key="v100-sxm2-32gb",
        name="NVIDIA Tesla V100 SXM2 32GB",
        aliases=("v100-32gb", "v100 32gb", "tesla v100 32gb", "v100 sxm2 32gb"),
        # Observed: PyTorch reports 31.74-31.75 GiB on V100-SXM2-32GB.
        memory_gib=31.74,
        bf16_tflops=None,
        fp16_tflops=125.0,
        fp32_tflops=15.7,
        tf32_tflops=None,
        mem_bandwidth_gbs=900.0,
        interconnect="NVLink2 300 GB/s",
        interconnect_gbs=300.0,
        sms=80,
        source="NVIDIA Tesla V100 datasheet (2020), V100 SXM2 column",
    ),
    GPU(
        key="t4-16gb",
        name="NVIDIA T4",
        aliases=("t4", "tesla t4", "t4 16gb", "nvidia t4"),
        # Observed: PyTorch reports 14.75 GiB (nvidia-smi: 15360 MiB), e.g. on Colab.
        memory_gib=14.75,
        bf16_tflops=None,  # Turing tensor cores have no bf16 mode.
        fp16_tflops=65.0,  # "Mixed Precision (FP16/FP32) 65 TFLOPS", dense.
        fp32_tflops=8.1,
        tf32_tflops=None,  # no TF32 before Ampere.
        mem_bandwidth_gbs=320.0,
        interconnect=_PCIE3,
        interconnect_gbs=32.0,
        sms=40,
        source="NVIDIA T4 datasheet (2019)",
    ),
    GPU(
        key="rtx-2080-ti-11gb",
        name="NVIDIA GeForce RTX 2080 Ti",
        aliases=(
            "rtx-2080-ti",
            "rtx 2080 ti",
            "2080 ti",
            "2080ti",
            "geforce rtx 2080 ti",
            "nvidia geforce rtx 2080 ti",
        ),
        # Estimated, not observed here: 10.76 GiB is the "total capacity" PyTorch's out-of-memory
        # messages report on 11 GB Turing cards (nvidia-smi: 11264 MiB). Common in university clusters.
        memory_gib=10.76,
        bf16_tflops=None,  # Turing tensor cores have no bf16 mode.
        # Turing whitepaper, RTX 2080 Ti (reference clocks): fp16 107.6 TFLOPS with FP16 accumulate,
        # 53.8 with FP32 accumulate (GeForce half rate); FP32 13.4.
        fp16_tflops=53.8,
        fp32_tflops=13.4,
        tf32_tflops=None,  # no TF32 before Ampere.
        mem_bandwidth_gbs=616.0,
        interconnect=_PCIE3 + " (optional 2-way NVLink bridge 100 GB/s)",
        interconnect_gbs=32.0,
        sms=68,
        source="NVIDIA Turing GPU architecture whitepaper (2018), GeForce RTX 2080 Ti column",
    ),
    # ---------------------------------------------------------------- Ampere (GA10x)
    GPU(
        key="a10-24gb",
        name="NVIDIA A10",
        aliases=("a10", "a10 24gb", "nvidia a10"),
        # Observed: PyTorch reports 21.99 GiB (nvidia-smi: 23028 MiB, ECC on).
        memory_gib=21.99,
        bf16_tflops=125.0,  # datasheet 250 with sparsity.
        fp16_tflops=125.0,
        fp32_tflops=31.2,
        tf32_tflops=62.5,  # datasheet 125 with sparsity.
        mem_bandwidth_gbs=600.0,
        interconnect=_PCIE4,
        interconnect_gbs=64.0,
        sms=72,
        source="NVIDIA A10 datasheet (2021)",
    ),
    GPU(
        key="a10g-24gb",
        name="NVIDIA A10G (AWS EC2 G5)",
        aliases=("a10g", "a10g 24gb", "nvidia a10g", "aws a10g"),
        # Same board memory as the A10 (nvidia-smi 23028 MiB). PyTorch reported 22.49 GiB with 2022
        # drivers; the A10's newer-driver 21.99 GiB is used as the safer figure.
        memory_gib=21.99,
        # NVIDIA publishes no A10G datasheet. The figures below are the commonly quoted ones for
        # its 80 SMs at ~1.71 GHz: more CUDA-core FP32 than the A10, but tensor cores at the
        # GeForce-style half rate for fp16/bf16 with FP32 accumulation. Treat as approximate.
        bf16_tflops=70.0,
        fp16_tflops=70.0,
        fp32_tflops=35.0,
        tf32_tflops=35.0,
        mem_bandwidth_gbs=600.0,
        interconnect=_PCIE4,
        interconnect_gbs=64.0,
        sms=80,
        source="No NVIDIA datasheet; AWS EC2 G5 instance documentation and third-party A10 vs A10G "
        "comparisons (approximate)",
    ),
    GPU(
        key="rtx-a6000-48gb",
        name="NVIDIA RTX A6000",
        aliases=("rtx-a6000", "rtx a6000", "a6000", "nvidia rtx a6000"),
        # PyTorch reports about 47.5 GiB (nvidia-smi: 49140 MiB with ECC off); not re-verified.
        memory_gib=47.54,
        # Datasheet: "Tensor Performance 309.7 TFLOPS" is the sparse fp16 figure; dense is half.
        # A professional part, so fp16 with FP32 accumulation runs at the full rate.
        bf16_tflops=154.8,
        fp16_tflops=154.8,
        fp32_tflops=38.7,
        tf32_tflops=77.4,  # half the dense fp16 rate on GA102 tensor cores.
        mem_bandwidth_gbs=768.0,
        interconnect=_PCIE4 + " (optional 2-way NVLink bridge 112.5 GB/s)",
        interconnect_gbs=64.0,
        sms=84,
        source="NVIDIA RTX A6000 datasheet (2021) and NVIDIA Ampere GA102 whitepaper",
    ),
    GPU(
        key="rtx-3090-24gb",
        name="NVIDIA GeForce RTX 3090",
        aliases=("rtx-3090", "rtx 3090", "3090", "geforce rtx 3090", "nvidia geforce rtx 3090"),
        # Observed: PyTorch reports 23.69 GiB (nvidia-smi: 24576 MiB) on a card without a display.
        memory_gib=23.69,
        # GA102 whitepaper, RTX 3090 column: fp16 142 TFLOPS with FP16 accumulate but 71 with FP32
        # accumulate (GeForce half rate); bf16 71; TF32 35.6 (all dense).
        bf16_tflops=71.0,
        fp16_tflops=71.0,
        fp32_tflops=35.6,
        tf32_tflops=35.6,
        mem_bandwidth_gbs=936.0,
        interconnect=_PCIE4 + " (optional 2-way NVLink bridge 112.5 GB/s)",
        interconnect_gbs=64.0,
        sms=82,
        source="NVIDIA Ampere GA102 GPU architecture whitepaper (2021), RTX 3090 column",
    ),
    # ---------------------------------------------------------------- Ada Lovelace
    GPU(
        key="rtx-4090-24gb",
        name="NVIDIA GeForce RTX 4090",
        aliases=("rtx-4090", "rtx 4090", "4090", "geforce rtx 4090", "nvidia geforce rtx 4090"),
        # Observed: PyTorch reports 23.64 GiB (nvidia-smi: 24564 MiB).
        memory_gib=23.64,
        # Ada whitepaper, RTX 4090 column: fp16 330.3 TFLOPS with FP16 accumulate, 165.2 with FP32
        # accumulate (GeForce half rate); bf16 165.2; TF32 82.6 (all dense).
        bf16_tflops=165.2,
        fp16_tflops=165.2,
        fp32_tflops=82.6,
        tf32_tflops=82.6,
        mem_bandwidth_gbs=1008.0,
        interconnect=_PCIE4 + " (no NVLink)",
        interconnect_gbs=64.0,
        sms=128,
        source="NVIDIA Ada Lovelace GPU architecture whitepaper (2022), RTX 4090 column",
    ),
    GPU(
        key="l4-24gb",
        name="NVIDIA L4",
        aliases=("l4", "l4 24gb", "nvidia l4"),
        # Estimated: nvidia-smi shows 23034 MiB (22.49 GiB); PyTorch typically reports ~0.5 GiB less.
        memory_gib=22.0,
        bf16_tflops=121.0,  # datasheet 242 with sparsity.
        fp16_tflops=121.0,
        fp32_tflops=30.3,
        tf32_tflops=60.0,  # datasheet 120 with sparsity.
        mem_bandwidth_gbs=300.0,
        interconnect=_PCIE4,
        interconnect_gbs=64.0,
        sms=58,
        source="NVIDIA L4 datasheet (2023)",
    ),
    GPU(
        key="l40s-48gb",
        name="NVIDIA L40S",
        aliases=("l40s", "l40s 48gb", "nvidia l40s"),
        # Observed: PyTorch reports 44.42 GiB (nvidia-smi: 46068 MiB, ECC on).
        memory_gib=44.42,
        bf16_tflops=362.05,  # datasheet: 362.05 dense | 733 sparse.
        fp16_tflops=362.05,
        fp32_tflops=91.6,
        tf32_tflops=183.0,  # datasheet: 183 dense | 366 sparse.
        mem_bandwidth_gbs=864.0,
        interconnect=_PCIE4 + " (no NVLink)",
        interconnect_gbs=64.0,
        sms=142,
        source="NVIDIA L40S datasheet (2023)",
    ),
    # ---------------------------------------------------------------- Ampere (A100)
    GPU(
        key="a100-sxm-40gb",
        name="NVIDIA A100 SXM4 40GB",
        aliases=("a100-40gb", "a100 40gb", "a100-sxm4-40gb", "a100 sxm 40gb", "a100-sxm-40gb"),
        # Observed: PyTorch reports 39.59 GiB.
        memory_gib=39.59,
        bf16_tflops=312.0,  # datasheet 624 with sparsity.
        fp16_tflops=312.0,
        fp32_tflops=19.5,
        tf32_tflops=156.0,  # datasheet 312 with sparsity.
        mem_bandwidth_gbs=1555.0,
        interconnect="NVLink3 600 GB/s",
        interconnect_gbs=600.0,
        sms=108,
        source="NVIDIA A100 datasheet (2020), A100 40GB SXM column",
    ),
    GPU(
        key="a100-pcie-40gb",
        name="NVIDIA A100 PCIe 40GB",
        aliases=("a100-pcie-40gb", "a100 pcie 40gb", "a100-pcie4-40gb"),
        # PyTorch reports about 39.5 GiB (observed 39.50 on an A100 40GB; variant not confirmed).
        memory_gib=39.5,
        # The datasheet lists the same peaks as the SXM part; the 250 W limit keeps sustained clocks
        # lower in practice.
        bf16_tflops=312.0,
        fp16_tflops=312.0,
        fp32_tflops=19.5,
        tf32_tflops=156.0,
        mem_bandwidth_gbs=1555.0,
        interconnect=_PCIE4 + " (optional 2-way NVLink bridge 600 GB/s)",
        interconnect_gbs=64.0,
        sms=108,
        source="NVIDIA A100 datasheet (2020), A100 40GB PCIe column",
    ),
    GPU(
        key="a100-sxm-80gb",
        name="NVIDIA A100 SXM4 80GB",
        aliases=("a100-80gb", "a100 80gb", "a100-sxm4-80gb", "a100 sxm 80gb", "a100 80gb sxm"),
        # Observed: PyTorch reports 79.15 GiB (79.14-79.25 across drivers).
        memory_gib=79.15,
        bf16_tflops=312.0,
        fp16_tflops=312.0,
        fp32_tflops=19.5,
        tf32_tflops=156.0,
        mem_bandwidth_gbs=2039.0,
        interconnect="NVLink3 600 GB/s",
        interconnect_gbs=600.0,
        sms=108,
        source="NVIDIA A100 datasheet (2021), A100 80GB SXM column",
    ),
    GPU(
        key="a100-pcie-80gb",
        name="NVIDIA A100 PCIe 80GB",
        aliases=("a100-pcie-80gb", "a100 pcie 80gb", "a100 80gb pcie"),
        # Taken equal to the SXM 80GB card's 79.15 GiB (same 80 GB HBM2e); not separately verified.
        memory_gib=79.15,
        bf16_tflops=312.0,
        fp16_tflops=312.0,
        fp32_tflops=19.5,
        tf32_tflops=156.0,
        mem_bandwidth_gbs=1935.0,
        interconnect=_PCIE4 + " (optional 2-way NVLink bridge 600 GB/s)",
        interconnect_gbs=64.0,
        sms=108,
        source="NVIDIA A100 datasheet (2021), A100 80GB PCIe column",
    ),
    # ---------------------------------------------------------------- Hopper
    GPU(
        key="h100-pcie-80gb",
        name="NVIDIA H100 PCIe 80GB",
        aliases=("h100-pcie", "h100 pcie", "h100 pcie 80gb", "h100-pcie-80gb"),
        # Same 80 GB as the SXM part; taken equal to its observed 79.11 GiB.
        memory_gib=79.11,
        bf16_tflops=756.5,  # datasheet 1,513 with sparsity.
        fp16_tflops=756.5,
        fp32_tflops=51.0,
        tf32_tflops=378.0,  # datasheet 756 with sparsity.
        mem_bandwidth_gbs=2000.0,
        interconnect=_PCIE5 + " (optional 2-way NVLink bridge 600 GB/s)",
        interconnect_gbs=128.0,
        sms=114,
        source="NVIDIA H100 datasheet (2022), H100 PCIe column",
    ),
    GPU(
        key="h100-sxm-80gb",
        name="NVIDIA H100 SXM5 80GB",
        aliases=(
            "h100",
            "h100-80gb",
            "h100 80gb",
            "h100 80gb hbm3",
            "h100-sxm",
            "h100 sxm",
            "h100-sxm5-80gb",
            "h100 sxm5",
            "hgx h100",
            "dgx h100",
        ),
        # Observed: PyTorch reports 79.11 GiB (nvidia-smi: 81559 MiB).
        memory_gib=79.11,
        bf16_tflops=989.5,  # datasheet 1,979 with sparsity.
        fp16_tflops=989.5,
        fp32_tflops=67.0,
        tf32_tflops=494.5,  # datasheet 989 with sparsity.
        mem_bandwidth_gbs=3350.0,
        interconnect="NVLink4 900 GB/s",
        interconnect_gbs=900.0,
        sms=132,
        source="NVIDIA H100 datasheet (2023), H100 SXM column",
    ),
    GPU(
        key="h100-nvl-94gb",
        name="NVIDIA H100 NVL 94GB",
        aliases=("h100-nvl", "h100 nvl", "h100 nvl 94gb", "h100-94gb", "h100 94gb"),
        # Observed: PyTorch reports 93.0 GiB (nvidia-smi: 95830 MiB).
        memory_gib=93.0,
        # Per-GPU column of the current datasheet (the first NVL announcement quoted a pair).
        bf16_tflops=835.5,  # datasheet 1,671 with sparsity.
        fp16_tflops=835.5,
        fp32_tflops=60.0,
        tf32_tflops=417.5,  # datasheet 835 with sparsity.
        mem_bandwidth_gbs=3900.0,
        interconnect="NVLink bridge 600 GB/s (" + _PCIE5 + ")",
        interconnect_gbs=600.0,
        sms=132,
        source="NVIDIA H100 datasheet (2023), H100 NVL column",
    ),
    GPU(
        key="h200-sxm-141gb",
        name="NVIDIA H200 SXM 141GB",
        aliases=("h200", "h200-141gb", "h200 141gb", "h200-sxm", "h200 sxm", "hgx h200", "dgx h200"),
        # Observed: PyTorch's total_memory 139.80 GiB, 132 SMs (driver 580.159, CUDA 13.0, 2026-12-04:
        # bench/results/gpu-logs/env-h200.txt); nvidia-smi shows 143771 MiB.
        memory_gib=139.8,
        # Same GH100 compute as the H100 SXM; only memory changed. An 8192^3 bf16 matmul ran at 779-782
        # TFLOP/s there (79 % of this dense peak).
        bf16_tflops=989.5,
        fp16_tflops=989.5,
        fp32_tflops=67.0,
        tf32_tflops=494.5,
        mem_bandwidth_gbs=4800.0,
        interconnect="NVLink4 900 GB/s",
        interconnect_gbs=900.0,
        sms=132,
        source="NVIDIA H200 datasheet (2024), H200 SXM column",
    ),
    GPU(
        key="h200-nvl-141gb",
        name="NVIDIA H200 NVL 141GB",
        aliases=("h200-nvl", "h200 nvl", "h200 nvl 141gb"),
        # Estimated like the H200 SXM (same 141 GB HBM3e).
        memory_gib=139.8,
        bf16_tflops=835.5,  # datasheet 1,671 with sparsity.
        fp16_tflops=835.5,
        fp32_tflops=60.0,
        tf32_tflops=417.5,  # datasheet 835 with sparsity.
        mem_bandwidth_gbs=4800.0,
        interconnect="NVLink bridge 900 GB/s (" + _PCIE5 + ")",
        interconnect_gbs=900.0,
        sms=132,
        source="NVIDIA H200 datasheet (2024), H200 NVL column",
    ),
    GPU(
        key="gh200-96gb",
        name="NVIDIA GH200 Grace Hopper Superchip (96GB HBM3)",
        aliases=("gh200", "gh200-480gb", "gh200 480gb", "grace hopper", "gh200 96gb"),
        # Estimated: nvidia-smi shows about 97871 MiB (95.6 GiB) of HBM3; PyTorch reports ~0.5 GiB
        # less. The Grace LPDDR5X (the "480GB" in the device name) is host memory and not counted.
        memory_gib=95.0,
        # The Hopper GPU of the superchip has the H100 SXM's peaks.
        bf16_tflops=989.5,
        fp16_tflops=989.5,
        fp32_tflops=67.0,
        tf32_tflops=494.5,
        mem_bandwidth_gbs=4000.0,
        interconnect="NVLink4 900 GB/s (NVLink-C2C to Grace 900 GB/s)",
        interconnect_gbs=900.0,
        sms=132,
        source="NVIDIA GH200 Grace Hopper Superchip datasheet (2023), 96GB HBM3 configuration",
    ),
    # ---------------------------------------------------------------- Blackwell
    GPU(
        key="b200-180gb",
        name="NVIDIA B200 180GB (HGX B200)",
        aliases=("b200", "b200 180gb", "b200-sxm", "hgx b200", "dgx b200"),
        # Observed: cudaDeviceProp.totalGlobalMem 178.35 GiB (nvidia-smi: 183359 MiB).
        memory_gib=178.35,
        bf16_tflops=2250.0,  # HGX B200: 4.5 PFLOPS per GPU with sparsity.
        fp16_tflops=2250.0,
        fp32_tflops=75.0,
        tf32_tflops=1100.0,  # datasheet 2.2 PFLOPS with sparsity (half of bf16 would be 1125).
        # The launch material said 8 TB/s; the current HGX B200 datasheet says 7.7 TB/s, which is what
        # the driver-reported 7680-bit bus gives at the shipping memory clock.
        mem_bandwidth_gbs=7700.0,
        interconnect="NVLink5 1.8 TB/s",
        interconnect_gbs=1800.0,
        sms=148,
        source="NVIDIA HGX B200 datasheet (2025), per-GPU figures",
    ),
)

CATALOG: dict[str, GPU] = {g.key: g for g in _ENTRIES}

_VENDOR_WORDS = ("nvidia", "tesla", "geforce")


def normalize_name(name: str) -> str:
    """Lowercase, spaces/underscores to '-', repeated dashes collapsed, ends trimmed."""
    s = re.sub(r"[\s_]+", "-", name.strip().lower())
    s = re.sub(r"-{2,}", "-", s)
    return s.strip("-")


def _strip_vendor(norm: str) -> str:
    parts = [p for p in norm.split("-") if p not in _VENDOR_WORDS]
    return "-".join(parts)


def _compact(norm: str) -> str:
    return norm.replace("-", "")


def _build_index() -> tuple[dict[str, str], dict[str, str]]:
    exact: dict[str, str] = {}
    compact: dict[str, Optional[str]] = {}
    for g in _ENTRIES:
        for raw in (g.key, g.name, *g.aliases):
            n = normalize_name(raw)
            for form in {n, _strip_vendor(n)}:
                if not form:
                    continue
                owner = exact.get(form)
                if owner is not None and owner != g.key:
                    raise RuntimeError(f"GPU name {raw!r} is claimed by both {owner} and {g.key}")
                exact[form] = g.key
                c = _compact(form)
                prev = compact.get(c, g.key)
                compact[c] = g.key if prev == g.key else None  # None marks an ambiguous compact form
    return exact, {c: k for c, k in compact.items() if k is not None}


_EXACT, _COMPACT = _build_index()


def find_gpu(name: str) -> GPU:
    """The catalog entry for a key, alias or marketing name (case, spaces and underscores ignored).

    A device name as printed by ``torch.cuda.get_device_name()`` also works.
    """
    norm = normalize_name(name)
    for form in (norm, _strip_vendor(norm)):
        if form in _EXACT:
            return CATALOG[_EXACT[form]]
    for form in (norm, _strip_vendor(norm)):
        c = _compact(form)
        if c in _COMPACT:
            return CATALOG[_COMPACT[c]]
    # Parse only what looks like a driver-reported device name; a typo such as "h100-81gb" must be
    # an error, not silently the nearest card.
    looks_like_device = norm.startswith(("nvidia", "tesla")) or "geforce" in norm
    detected = _detect(name, None, guess_size=False) if norm and looks_like_device else None
    if detected is not None:
        return detected
    raise UnknownGPUError(_unknown_message(name, norm))


def _unknown_message(name: str, norm: str) -> str:
    query = _strip_vendor(norm) or norm
    # Names that extend what was typed ("a100" -> "a100-80gb") first, then similar spellings.
    extending = [f for f in _EXACT if query and f.startswith(query + "-")]
    similar = difflib.get_close_matches(query, list(_EXACT), n=8, cutoff=0.5)
    keys: list[str] = []
    for form in extending + similar:
        k = _EXACT[form]
        if k not in keys:
            keys.append(k)
    lines = [f"Unknown GPU {name!r}."]
    if keys:
        lines.append("Closest matches: " + ", ".join(keys[:4]) + ".")
    lines.append("Known GPUs: " + ", ".join(CATALOG) + ".")
    lines.append("For a GPU not listed, give its memory instead with --gpu-memory GIB.")
    return " ".join(lines)


def custom_gpu(memory_gib: float, base: GPU | None = None) -> GPU:
    """A GPU with ``memory_gib`` of device memory.

    With ``base``, everything else (throughput, bandwidth, links) is copied from it; without, only
    the memory is known and the other figures are None.
    """
    memory_gib = float(memory_gib)
    if not (memory_gib > 0 and math.isfinite(memory_gib)):
        raise ValueError(f"GPU memory must be a positive number of GiB, got {memory_gib!r}")
    size = f"{memory_gib:g}"
    if base is not None:
        return dataclasses.replace(
            base,
            key=f"{base.key}-custom-{size}gib",
            name=f"{base.name} ({size} GiB usable)",
            aliases=(),
            memory_gib=memory_gib,
            source=f"{base.source}; memory overridden by the user",
        )
    return GPU(
        key=f"custom-{size}gib",
        name=f"Custom GPU ({size} GiB)",
        aliases=(),
        memory_gib=memory_gib,
        bf16_tflops=None,
        fp16_tflops=None,
        fp32_tflops=None,
        tf32_tflops=None,
        mem_bandwidth_gbs=None,
        interconnect="unknown",
        interconnect_gbs=None,
        source="user-supplied memory (--gpu-memory); no throughput figures",
    )


def _size_from_tokens(tokens: list[str]) -> Optional[int]:
    for t in tokens:
        m = re.fullmatch(r"(\d+)gb", t)
        if m:
            return int(m.group(1))
    return None


def detect_gpu(device_name: str, total_memory_bytes: int | None = None) -> GPU | None:
    """Map a ``torch.cuda.get_device_name()`` string to a catalog entry, or None when unknown.

    The size printed in the name (``A100-SXM4-40GB``) decides between memory variants; when the
    name has none, ``total_memory_bytes`` (``get_device_properties().total_memory``) does, and with
    neither the smaller variant is assumed. MIG slices and models not in the catalog (V100 PCIe,
    L40, RTX 6000 Ada, ...) give None, so the caller falls back to ``--gpu`` / ``--gpu-memory``
    rather than planning with wrong figures.
    """
    return _detect(device_name, total_memory_bytes, guess_size=True)


def _detect(device_name: str, total_memory_bytes: int | None, guess_size: bool) -> GPU | None:
    tokens = [t for t in re.split(r"[^a-z0-9]+", device_name.lower()) if t]
    if not tokens or "mig" in tokens:
        return None
    words = set(tokens)
    mem_gib = total_memory_bytes / _GIB if total_memory_bytes else None
    named_size = _size_from_tokens(tokens)
    any(t.startswith("sxm") for t in tokens)
    has_pcie = any(t.startswith("pcie") for t in tokens)

    def pick(small: str, large: str, threshold_gib: float) -> GPU | None:
        if named_size is not None:
            return CATALOG[large if named_size > threshold_gib else small]
        if mem_gib is not None:
            return CATALOG[large if mem_gib > threshold_gib else small]
        # No size at all: the smaller card is the safe guess for planning (find_gpu won't guess).
        return CATALOG[small] if guess_size else None

    if "gh200" in words:
        # Only the 96 GB HBM3 superchip is in the catalog; the 144 GB HBM3e one is not.
        if mem_gib is not None and mem_gib > 120:
            return None
        return CATALOG["gh200-96gb"]
    if "b200" in words:
        return CATALOG["b200-180gb"]
    if "h200" in words:
        return CATALOG["h200-nvl-141gb" if "nvl" in words else "h200-sxm-141gb"]
    if "h100" in words:
        if "nvl" in words:
            return CATALOG["h100-nvl-94gb"]
        if has_pcie:
            return CATALOG["h100-pcie-80gb"]
        if named_size == 94 or (named_size is None and mem_gib is not None and mem_gib > 85):
            # 94/96 GB SXM and PCIe variants exist but are not catalogued; don't call them 80 GB.
            return None
        return CATALOG["h100-sxm-80gb"]
    if "a100" in words:
        if has_pcie:
            return pick("a100-pcie-40gb", "a100-pcie-80gb", 60)
        return pick("a100-sxm-40gb", "a100-sxm-80gb", 60)
    if "v100" in words or "v100s" in words:
        if has_pcie or "v100s" in words:
            return None  # PCIe V100s have lower clocks than the SXM2 entries.
        return pick("v100-sxm2-16gb", "v100-sxm2-32gb", 24)
    if "t4" in words:
        return CATALOG["t4-16gb"]
    if "a10g" in words:
        return CATALOG["a10g-24gb"]
    if "a10" in words:
        return CATALOG["a10-24gb"]
    if "l40s" in words:
        return CATALOG["l40s-48gb"]
    if "l4" in words:
        return CATALOG["l4-24gb"]
    if "a6000" in words:
        return CATALOG["rtx-a6000-48gb"]
    # GeForce: other chips share these numbers (Ti, D, laptop parts), so demand the plain card.
    if words & {"ti", "d", "laptop", "mobile", "super"}:
        return None
    if "4090" in words:
        return CATALOG["rtx-4090-24gb"]
    if "3090" in words:
        return CATALOG["rtx-3090-24gb"]
    return None


_PRECISION_FIELD = {
    "bf16-true": "bf16",
    "bf16-mixed": "bf16",
    "bf16": "bf16",
    "16-true": "fp16",
    "16-mixed": "fp16",
    "16": "fp16",
    "fp16": "fp16",
    "32-true": "fp32",
    "32": "fp32",
    "fp32": "fp32",
    "64-true": None,
    "64": None,  # no FP64 figures in the catalog
}


def peak_flops(gpu: GPU, precision: str, allow_tf32: bool = False) -> float | None:
    """Dense peak matmul throughput in FLOP/s for a Lightning precision string, or None if unknown.

    * ``bf16-true`` / ``bf16-mixed``: the bf16 tensor-core peak (None on V100/T4, which lack bf16).
    * ``16-true`` / ``16-mixed``: the fp16 tensor-core peak (FP32 accumulation).
    * ``32-true``: float32 matmuls use TF32 tensor cores only when PyTorch is told to
      (``torch.backends.cuda.matmul.allow_tf32 = True``, or
      ``torch.set_float32_matmul_precision("high")``); both are off by default. So with
      ``allow_tf32=False`` (the default) this is the CUDA-core FP32 peak, and with
      ``allow_tf32=True`` it is the TF32 peak where the GPU has TF32 (FP32 otherwise).

    Mixed precision is counted at the low-precision rate because the matmuls, which dominate the
    FLOPs, run in it.
    """
    key = precision.strip().lower()
    if key not in _PRECISION_FIELD:
        known = ", ".join(p for p in _PRECISION_FIELD if "-" in p)
        raise ValueError(f"Unknown precision {precision!r}; expected one of {known}")
    kind = _PRECISION_FIELD[key]
    if kind is None:
        tflops = None
    elif kind == "bf16":
        tflops = gpu.bf16_tflops
    elif kind == "fp16":
        tflops = gpu.fp16_tflops
    else:
        tflops = gpu.tf32_tflops if (allow_tf32 and gpu.tf32_tflops) else gpu.fp32_tflops
    return None if tflops is None else tflops * 1e12


def cublas_workspace_bytes(gpu: GPU | None) -> int:
    """Bytes of one cuBLAS workspace as PyTorch sizes it (no CUBLAS_WORKSPACE_CONFIG set).

    PyTorch takes each (cuBLAS handle, stream) pair's workspace from its caching allocator, so it
    counts in ``memory_allocated`` and stays cached for the run: ``:4096:8`` (32 MiB) on Hopper
    (sm90: H100, H200, GH200), ``:4096:2:16:8`` (8 MiB + 128 KiB) elsewhere.
    """
    hopper = gpu is not None and re.match(r"g?h(100|200)", gpu.key) is not None
    return 4096 * 1024 * 8 if hopper else 4096 * 1024 * 2 + 16 * 1024 * 8


# CUDA compute capability per catalog entry (NVIDIA's "CUDA GPUs" table): it decides which fused
# attention kernels exist (flash needs 8.0+, bf16 in the memory-efficient kernel too).
_COMPUTE_CAPABILITY = {
    "v100-sxm2-16gb": (7, 0),
    "v100-sxm2-32gb": (7, 0),
    "t4-16gb": (7, 5),
    "rtx-2080-ti-11gb": (7, 5),
    "a10-24gb": (8, 6),
    "a10g-24gb": (8, 6),
    "rtx-a6000-48gb": (8, 6),
    "rtx-3090-24gb": (8, 6),
    "rtx-4090-24gb": (8, 9),
    "l4-24gb": (8, 9),
    "l40s-48gb": (8, 9),
    "a100-sxm-40gb": (8, 0),
    "a100-pcie-40gb": (8, 0),
    "a100-sxm-80gb": (8, 0),
    "a100-pcie-80gb": (8, 0),
    "h100-pcie-80gb": (9, 0),
    "h100-sxm-80gb": (9, 0),
    "h100-nvl-94gb": (9, 0),
    "h200-sxm-141gb": (9, 0),
    "h200-nvl-141gb": (9, 0),
    "gh200-96gb": (9, 0),
    "b200-180gb": (10, 0),
}


def compute_capability(gpu: GPU | None) -> tuple[int, int]:
    """(major, minor) of a catalog GPU (a custom GPU inherits its base's); a GPU known only by its
    memory is taken to be Ampere or newer (8.0), as any card rented for fine-tuning today is."""
    if gpu is None:
        return (8, 0)
    return _COMPUTE_CAPABILITY.get(gpu.key.split("-custom-")[0], (8, 0))
