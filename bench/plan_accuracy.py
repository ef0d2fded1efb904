"""Planner accuracy on the GPU this runs on: measured memory and step time vs `bigtune plan`.

    python bench/plan_accuracy.py [--budget-s 510] [--only NAME ...] [--resume FILE] [--out DIR]
    python bench/plan_accuracy.py --smoke [--out DIR]          # CPU, tiny presets (CI: tests/test_bench_smoke.py)
    python bench/plan_accuracy.py --list                       # the case matrix, in run order
    python bench/plan_accuracy.py --check-plans [--gpu h100-80gb]   # CPU: plan every GPU case, check `expect`

Each case trains a real architecture with random weights (model.init=random: no download, no hub: the
bundled configs, bigtune's tiny tokenizer, BLIP's image processor at the model's image size) for a few
steps on full-length synthetic data (LLMs: text longer than max_seq_length; BLIP-2: the bundled photos
with captions longer than max_seq_length, so no batch is padded), in its own process (an OOM or a hang
is a result, not the end of the run), with a time limit per case. It then reads the run's summary.json
and metrics.jsonl: per phase and category measured vs predicted, peak allocated, peak reserved and the
device's memory in use (cudaMemGetInfo, what nvidia-smi shows) beside the plan's allocated, reserved
and total, and the measured step time and tokens/s beside the plan's roofline time.

Cases run in the order of CASES (most informative first). ``--budget-s`` stops starting cases whose
estimated time no longer fits (they are written as ``skipped``); the JSON is rewritten atomically after
every case, so a command killed at its limit keeps every finished row. ``--resume FILE`` keeps the rows
of an earlier result file and runs only the cases it has not finished.

Writes <out>/plan_accuracy-<gpu>.json (<out> defaults to bench/results). Without a CUDA GPU (and
without --smoke) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINYLLAMA = "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T"
OPENLLAMA3B, OPENLLAMA7B = "openlm-research/open_llama_3b", "openlm-research/open_llama_7b"
LLAMA31_8B, LLAMA32_3B = "meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.2-3B"
BLIP2_RECIPE = "recipes/blip2-opt-2.7b.yaml"  # the lab's BLIP-2 recipe (every part trained, as the lab's script)
LLAMA_CHAT_RECIPE = "recipes/llama-3.1-8b-chat-lora.yaml"  # LoRA all-linear, llama-3 template, chunked loss
MOE_RECIPE = "recipes/qwen3-30b-a3b-chat-lora.yaml"  # Qwen3-30B-A3B LoRA on attention, qwen template
GEMMA3_RECIPE = "recipes/gemma-3-4b-chat-qlora.yaml"  # Gemma 3 4B's text model, gemma template
VLM_RECIPE = "recipes/qwen2.5-vl-3b-alt-text.yaml"  # Qwen2.5-VL-3B LoRA, alt text for photos
LORA = {"peft.method": "lora", "peft.r": 16, "peft.alpha": 32, "peft.dropout": 0.05}
# Local inputs some cases name as "@<name>" in their overrides (written by write_data, see there).
QWEN_VL_PROCESSOR = "qwen2.5-vl-processor"
MOE_8_LAYERS = "qwen3-30b-a3b-8-layers"

# One case: recipe overrides (over), the base recipe (None: the built-in defaults; BLIP2_RECIPE for the
# lab's), the kind of data it needs (llm, blip2, chat, vlm: see write_data), what `bigtune plan --gpu
# h100-80gb` predicts (expect: fit | oom; checked by --check-plans), an estimated and a maximum time on an
# H100 (seconds, process start included), and the optional libraries it needs (needs: a case whose library
# does not import here is written as skipped, with the library's name, and the run goes on).
# Every case adds: random init, data.max_seq_length (LLM 512, BLIP-2 50 as the lab, chat 2048 as the chat
# recipes, chat VLM 96 text tokens as its recipe), memory every step.
# Order = run order: the first cases are the ones the planner is judged on most (lab rungs, the largest
# models near capacity), then what the project added since (never measured: chat, QLoRA, VLM, MoE, ...),
# then the rest of the matrix, then OOM checks.
CASES: dict[str, dict] = {
    "tinyllama-bf16true-adamw-b4": {
        "over": {"model.name": TINYLLAMA, "precision": "bf16-true", "train.micro_batch_size": 4},
        "note": "baseline: the smallest real LLM; checks the whole path first",
        "est": 45,
        "timeout": 150,
    },
    "blip2opt2.7b-bf16true-adamw-b16-acc4": {
        "recipe": BLIP2_RECIPE,
        "kind": "blip2",
        "over": {"precision": "bf16-true", "train.micro_batch_size": 16, "train.accumulate_grad_batches": 4},
        "note": "lab rung 5 (bs 16/4, bf16-true)",
        "est": 75,
        "timeout": 240,
    },
    "openllama7b-bf16true-adamw-ckpt-b4": {
        "over": {
            "model.name": OPENLLAMA7B,
            "precision": "bf16-true",
            "train.activation_checkpointing": True,
            "train.micro_batch_size": 4,
        },
        "note": "7B full fine-tune, AdamW, near capacity (reserved/fragmentation matter here)",
        "est": 90,
        "timeout": 300,
    },
    # What the project added since the cases above were written (each needs its own measurement): chat
    # data, QLoRA, a chat VLM, 8-bit AdamW, a CPU-held optimizer, QDoRA, Gemma 3, mixture of experts.
    # Random init runs on the CPU, single-threaded (torch's normal_): 0.12 G parameters/s on the 2-core
    # machine here, so an 8B model takes about a minute before its first step and the 30B MoE about four.
    "llama3.1-8b-bf16true-lora-ckpt-b2-chat": {
        "recipe": LLAMA_CHAT_RECIPE,
        "kind": "chat",
        "over": {"train.micro_batch_size": 2, "train.global_batch_size": None},
        "note": "a chat model on chat data: the recipe's LoRA all-linear, llama-3 template, assistant-only loss, "
        "chunked loss, b2 x 2048, checkpointing",
        "est": 100,
        "timeout": 300,
    },
    "llama3.1-8b-nf4-bnb-qlora-b4": {
        "over": {
            "model.name": LLAMA31_8B,
            "model.quantize": "nf4",
            "model.quant_backend": "bitsandbytes",
            "precision": "bf16-true",
            "train.micro_batch_size": 4,
            **LORA,
            "peft.target_modules": "all-linear",
        },
        "needs": ["bitsandbytes"],
        "note": "QLoRA: bitsandbytes NF4 base (double quant, fp32 norms and head as peft prepares it), LoRA r16 "
        "all-linear; the random base is written to disk and loaded back quantized (drawn on the GPU since the "
        "first H200 session, where drawing it on one CPU core and the round trip outlasted a 247 s limit)",
        "est": 200,
        "timeout": 420,
    },
    "qwen2.5-vl-3b-bf16true-lora-ckpt-b8-acc2": {
        "recipe": VLM_RECIPE,
        "kind": "vlm",
        # the plan's worst case is the largest image the processor allows (1280 image tokens, a slow plan):
        # capped at the photos' own size, the plan before training is the measured shape
        "over": {"model.tokenizer": "@" + QWEN_VL_PROCESSOR, "data.image_max_pixels": 448 * 448},
        "note": "a chat vision-language model at real size: its recipe (LoRA, b8/2, checkpointing) on 448 px "
        "photos (256 image tokens each) with captions past the 96 text tokens (its plan takes about a minute "
        "of CPU, twice: before training and again at the measured image grids; the first H200 session's 195 s "
        "limit ended it in the first plan)",
        "est": 240,
        "timeout": 400,
    },
    "tinyllama-bf16true-adamw8bit-b4": {
        "over": {
            "model.name": TINYLLAMA,
            "precision": "bf16-true",
            "optim.name": "adamw8bit",
            "train.micro_batch_size": 4,
        },
        "needs": ["bitsandbytes"],
        "note": "8-bit AdamW (bitsandbytes, 1 byte per moment): the baseline case with its optimizer swapped",
        "est": 45,
        "timeout": 150,
    },
    "qwen3-moe-8l-bf16mixed-lora-ckpt-b2-chat": {
        "recipe": MOE_RECIPE,
        "kind": "chat",
        "over": {
            "model.name": "@" + MOE_8_LAYERS,
            "precision": "bf16-mixed",
            "train.micro_batch_size": 2,
            "train.global_batch_size": None,
        },
        "note": "mixture of experts in bf16-mixed (fp32 experts: the per-expert matmuls of the non-bf16 path), "
        "Qwen3-30B-A3B's first 8 of 48 layers (5.6 B; the whole model in fp32 would not fit), the recipe's b2",
        "est": 80,
        "timeout": 240,
    },
    "openllama3b-bf16true-cpuoffload-adamw-b4": {
        "over": {
            "model.name": OPENLLAMA3B,
            "precision": "bf16-true",
            "optim.name": "cpu_offload_adamw",
            "train.micro_batch_size": 4,
        },
        "note": "optimizer state in CPU RAM on one GPU without DeepSpeed (cpu_offload_adamw: fp32 master weights "
        "and moments on the host, torch's CPU Adam; bf16 weights and gradients on the GPU)",
        "est": 90,
        "timeout": 300,
    },
    "llama3.2-3b-nf4-torchao-qdora-b4": {
        "over": {
            "model.name": LLAMA32_3B,
            "model.quantize": "nf4",
            "model.quant_backend": "torchao",
            "precision": "bf16-true",
            "train.micro_batch_size": 4,
            **LORA,
            "peft.method": "dora",
            "peft.target_modules": "all-linear",
        },
        "needs": ["torchao"],
        "note": "QDoRA on torchao's NF4 base on one GPU (DoRA's dequantized weight copy, torchao's dequantization "
        "temporaries, the tied head filled once), all-linear, no checkpointing",
        "est": 75,
        "timeout": 240,
    },
    "gemma3-4b-text-bf16true-lora-ckpt-b4-chat": {
        "recipe": GEMMA3_RECIPE,
        "kind": "chat",
        "over": {"model.quantize": "none", "train.micro_batch_size": 4, "train.global_batch_size": None},
        "note": "Gemma 3 4B's text model alone (the vision tower never built), LoRA all-linear on a bf16 base, "
        "262k-token vocabulary through the chunked loss, gemma template, b4 x 2048",
        "est": 70,
        "timeout": 240,
    },
    "qwen3-30b-a3b-bf16true-lora-ckpt-b2-chat": {
        "recipe": MOE_RECIPE,
        "kind": "chat",
        "over": {"train.micro_batch_size": 2, "train.global_batch_size": None},
        "note": "mixture of experts at full size (30.5 B, 128 experts, 8 active) on chat data, the recipe's "
        "b2 x 2048 with checkpointing (planned at 83% of the card, weights most of it); random init ~4 min",
        "est": 250,
        "timeout": 300,
    },
    "openllama7b-bf16true-adamw-ckpt-b4-expseg": {
        "over": {
            "model.name": OPENLLAMA7B,
            "precision": "bf16-true",
            "train.activation_checkpointing": True,
            "train.micro_batch_size": 4,
            "train.cuda_alloc_conf": "expandable_segments:True",
        },
        "note": "the 7B case above with expandable segments (train.cuda_alloc_conf): reserved and the least "
        "capacity as the allocator replay models that setting, against the default run beside it",
        "est": 90,
        "timeout": 300,
    },
    "blip2opt2.7b-32true-adamw-b16": {
        "recipe": BLIP2_RECIPE,
        "kind": "blip2",
        "over": {"precision": "32-true", "train.micro_batch_size": 16, "train.accumulate_grad_batches": 1},
        "note": "lab rung 2 (bs 16/1, fp32)",
        "est": 75,
        "timeout": 240,
    },
    "openllama7b-bf16true-lora-b4": {
        "over": {"model.name": OPENLLAMA7B, "precision": "bf16-true", "train.micro_batch_size": 4, **LORA},
        "note": "7B LoRA r16 (q, v), frozen bf16 base",
        "est": 75,
        "timeout": 240,
    },
    "openllama7b-bf16true-adamw-inbwd-ckpt-b4": {
        "over": {
            "model.name": OPENLLAMA7B,
            "precision": "bf16-true",
            "train.activation_checkpointing": True,
            "train.micro_batch_size": 4,
            "optim.in_backward": True,
            "optim.grad_clip": None,
        },
        "note": "the 7B checkpointed case with the optimizer stepped in the backward (optim.in_backward: no full "
        "set of gradients; it cannot clip)",
        "est": 90,
        "timeout": 300,
    },
    "blip2opt2.7b-bf16mixed-adamw-b8-acc8": {
        "recipe": BLIP2_RECIPE,
        "kind": "blip2",
        "over": {"precision": "bf16-mixed", "train.micro_batch_size": 8, "train.accumulate_grad_batches": 8},
        "note": "lab rung 6 at half its micro batch (bf16-mixed: fp32 weights, autocast; 16/4 is planned OOM "
        "on 80 GB with full-length captions)",
        "est": 80,
        "timeout": 240,
    },
    "blip2opt2.7b-bf16true-adamw-ckpt-b16": {
        "recipe": BLIP2_RECIPE,
        "kind": "blip2",
        "over": {
            "precision": "bf16-true",
            "train.micro_batch_size": 16,
            "train.accumulate_grad_batches": 1,
            "train.activation_checkpointing": True,
        },
        "note": "lab rung 5 shape + activation checkpointing",
        "est": 70,
        "timeout": 240,
    },
    "blip2flant5xxl-bf16true-sgd-b16-acc4": {
        "recipe": BLIP2_RECIPE,
        "kind": "blip2",
        "over": {
            "model.name": "Salesforce/blip2-flan-t5-xxl",
            "precision": "bf16-true",
            "optim.name": "sgd",
            "train.micro_batch_size": 16,
            "train.accumulate_grad_batches": 4,
        },
        "note": "lab rung 10 as the lab ran it on its A100 (flan-t5-xxl, SGD, bs 16/4): encoder-decoder",
        "est": 110,
        "timeout": 300,
    },
    "openllama7b-bf16true-sgd-b2": {
        "over": {"model.name": OPENLLAMA7B, "precision": "bf16-true", "optim.name": "sgd", "train.micro_batch_size": 2},
        "note": "7B, SGD (no optimizer state), no checkpointing",
        "est": 80,
        "timeout": 240,
    },
    "blip2opt6.7b-bf16true-adamw-b16-acc4": {
        "recipe": BLIP2_RECIPE,
        "kind": "blip2",
        "over": {
            "model.name": "Salesforce/blip2-opt-6.7b",
            "precision": "bf16-true",
            "train.micro_batch_size": 16,
            "train.accumulate_grad_batches": 4,
        },
        "note": "lab rung 7 as the lab ran it on its A100 (opt-6.7b, bs 16/4, bf16-true)",
        "est": 100,
        "timeout": 300,
    },
    "tinyllama-32true-adamw-b4": {
        "over": {"model.name": TINYLLAMA, "precision": "32-true", "train.micro_batch_size": 4},
        "note": "fp32 weights, gradients, AdamW state",
        "est": 45,
        "timeout": 150,
    },
    "tinyllama-bf16mixed-adamw-b4": {
        "over": {"model.name": TINYLLAMA, "precision": "bf16-mixed", "train.micro_batch_size": 4},
        "note": "fp32 weights with bf16 autocast copies",
        "est": 45,
        "timeout": 150,
    },
    "openllama3b-32true-sgd-b2": {
        "over": {"model.name": OPENLLAMA3B, "precision": "32-true", "optim.name": "sgd", "train.micro_batch_size": 2},
        "note": "3B in fp32 (SGD: fp32 AdamW state would not fit)",
        "est": 70,
        "timeout": 240,
    },
    "openllama7b-bf16true-adamw-b8": {
        "over": {"model.name": OPENLLAMA7B, "precision": "bf16-true", "train.micro_batch_size": 8},
        "note": "7B AdamW without checkpointing at batch 8 (planned at 83% of the card)",
        "est": 100,
        "timeout": 300,
    },
    "openllama3b-bf16true-adamw-b2": {
        "over": {"model.name": OPENLLAMA3B, "precision": "bf16-true", "train.micro_batch_size": 2},
        "note": "3B full fine-tune",
        "est": 60,
        "timeout": 200,
    },
    "tinyllama-bf16true-sgd-b8": {
        "over": {"model.name": TINYLLAMA, "precision": "bf16-true", "optim.name": "sgd", "train.micro_batch_size": 8},
        "note": "SGD, larger batch (activations dominate)",
        "est": 45,
        "timeout": 150,
    },
    "tinyllama-bf16true-adamw-ckpt-b8": {
        "over": {
            "model.name": TINYLLAMA,
            "precision": "bf16-true",
            "train.activation_checkpointing": True,
            "train.micro_batch_size": 8,
        },
        "note": "activation checkpointing",
        "est": 45,
        "timeout": 150,
    },
    "tinyllama-bf16true-adamw-b4-acc2": {
        "over": {
            "model.name": TINYLLAMA,
            "precision": "bf16-true",
            "train.micro_batch_size": 4,
            "train.accumulate_grad_batches": 2,
        },
        "note": "gradient accumulation",
        "est": 45,
        "timeout": 150,
    },
    "opt1.3b-bf16true-adamw-b4": {
        "over": {"model.name": "facebook/opt-1.3b", "precision": "bf16-true", "train.micro_batch_size": 4},
        "note": "another architecture (OPT, learned positions, tied output layer)",
        "est": 45,
        "timeout": 150,
    },
    "openllama7b-32true-lora-b2": {
        "over": {"model.name": OPENLLAMA7B, "precision": "32-true", "train.micro_batch_size": 2, **LORA},
        "note": "7B LoRA on an fp32 base",
        "est": 80,
        "timeout": 240,
    },
    "blip2opt2.7b-32true-adamw-b64": {
        "recipe": BLIP2_RECIPE,
        "kind": "blip2",
        "over": {"precision": "32-true", "train.micro_batch_size": 64, "train.accumulate_grad_batches": 1},
        "note": "OOM check: lab rung 1 (bs 64/1, fp32; the lab reports OOM even on a 94 GB H100)",
        "expect": "oom",
        "est": 90,
        "timeout": 300,
    },
    "blip2flant5xxl-32true-lora-b32-acc2": {
        "recipe": BLIP2_RECIPE,
        "kind": "blip2",
        "over": {
            "model.name": "Salesforce/blip2-flan-t5-xxl",
            "precision": "32-true",
            "train.micro_batch_size": 32,
            "train.accumulate_grad_batches": 2,
            **LORA,
        },
        "note": "lab rung 14 (flan-t5-xxl LoRA r16 on q, v, fp32, bs 32/2): the lab says it fits easily on an "
        "A100 80 GB with its captions; full 50-token captions are planned tight, near the card",
        "est": 120,
        "timeout": 300,
    },
    "blip2flant5xxl-bf16true-adamw-b32-acc2": {
        "recipe": BLIP2_RECIPE,
        "kind": "blip2",
        "over": {
            "model.name": "Salesforce/blip2-flan-t5-xxl",
            "precision": "bf16-true",
            "train.micro_batch_size": 32,
            "train.accumulate_grad_batches": 2,
        },
        "note": "OOM check: lab rung 8 (flan-t5-xxl, AdamW, bs 32/2, bf16-true)",
        "expect": "oom",
        "est": 120,
        "timeout": 300,
    },
}

# --smoke: the same machinery on the CPU with tiny presets (seconds per case). The last one must run
# out of memory (memory.cap_gib below what step 0 needs): the OOM row is part of what CI checks.
SMOKE_CASES: dict[str, dict] = {
    "smoke-tiny-llama-32true-adamw-b4": {
        "over": {"model.name": "tiny-llama", "precision": "32-true", "train.micro_batch_size": 4},
        "note": "smoke: causal LM",
        "est": 20,
        "timeout": 120,
    },
    "smoke-tiny-opt-bf16true-sgd-ckpt-b4": {
        "over": {
            "model.name": "tiny-opt",
            "precision": "bf16-true",
            "optim.name": "sgd",
            "train.activation_checkpointing": True,
            "train.micro_batch_size": 4,
        },
        "note": "smoke: OPT, SGD, checkpointing",
        "est": 20,
        "timeout": 120,
    },
    "smoke-tiny-blip2-opt-32true-adamw-b4-acc2": {
        "recipe": BLIP2_RECIPE,
        "kind": "blip2",
        "over": {
            "model.name": "tiny-blip2-opt",
            "precision": "32-true",
            "train.micro_batch_size": 4,
            "train.accumulate_grad_batches": 2,
        },
        "note": "smoke: BLIP-2 on the lab's recipe",
        "est": 25,
        "timeout": 120,
    },
    "smoke-tiny-llama-oom": {
        "over": {
            "model.name": "tiny-llama",
            "precision": "32-true",
            "train.micro_batch_size": 4,
            "memory.cap_gib": 0.0005,
        },
        "note": "smoke: an out-of-memory row (memory.cap_gib 0.5 MiB)",
        "expect": "oom",
        "est": 20,
        "timeout": 120,
    },
}

SEQ = {"llm": 512, "blip2": 50, "chat": 2048, "vlm": 96}
SMOKE_SEQ = {"llm": 64, "blip2": 12, "chat": 128, "vlm": 48}
PROBE_EVERY = 4  # memory.every_steps: with 8 steps, steps 0, 1 and 4 are measured and 2, 3, 5, 6, 7 timed
_clock = time.perf_counter  # the budget's clock (tests replace it)


# -- data ---------------------------------------------------------------------------------------------


def write_data(work: Path, names=None) -> dict[str, Path]:
    """The inputs the cases read, written under ``work``: the data of each kind (llm, blip2, chat, vlm) and
    the local folders cases name as "@<name>" (``names``: only these; None: all). Every record is longer
    than any max_seq_length used here, so no batch is padded. An input that fails is an InputError in its
    place, not the end of the run."""
    sys.path.insert(0, str(ROOT / "src"))
    writers = {
        "llm": _long_text,
        "blip2": _long_captions,
        "chat": _long_chats,
        "vlm": _photo_captions,
        QWEN_VL_PROCESSOR: _qwen_vl_processor,
        MOE_8_LAYERS: _moe_8_layers,
    }
    out: dict = {}
    for name, write in writers.items():
        if names is None or name in names:
            try:
                out[name] = write(work)
            except Exception as e:  # noqa: BLE001 - only the cases that read it fail (see input_errors)
                out[name] = InputError(f"{type(e).__name__}: {e}")
    return out


class InputError(str):
    """An input write_data could not write (its message): the cases that read it are skipped rows saying so
    (a --resume tries them again), the others run."""


def input_errors(case: dict, data: dict) -> list[str]:
    return [f"input {n} could not be written: {data[n]}" for n in inputs_of([case]) if isinstance(data[n], InputError)]


def inputs_of(cases: list[dict]) -> set[str]:
    """The data kinds and "@" folders these cases read (what write_data must write for them)."""
    out = set()
    for case in cases:
        out.add(case.get("kind", "llm"))
        out.update(v[1:] for v in case["over"].values() if isinstance(v, str) and v.startswith("@"))
    return out


def _long_text(work: Path) -> Path:
    text = work / "long.jsonl"
    text.write_text(
        "".join(
            json.dumps({"text": f"sample {i}: " + "a plate of tomato soup with basil. " * 120}) + "\n"
            for i in range(256)
        )
    )
    return text


def _caption_lines(images: list[Path], n: int) -> str:
    return "".join(
        json.dumps(
            {
                "image": str(images[i % len(images)]),
                "text": f"a plate {i} of tomato soup with basil and bread on a wooden table " * 4,
            }
        )
        + "\n"
        for i in range(n)
    )


def _long_captions(work: Path) -> Path:
    from bigtune.data.images import DEMO_IMAGES

    captions = work / "long_captions.jsonl"
    captions.write_text(_caption_lines(sorted((DEMO_IMAGES / "images").glob("*.png")), 512))
    return captions


def _long_chats(work: Path) -> Path:
    """Conversations of the bundled chat demo strung together (the turns of 40 demo conversations each; their
    system turns dropped, the ShareGPT-style and bad records left out; user and assistant alternate): each is
    past 2048 tokens, so every row is full length and carries assistant tokens in its first 2048."""
    from bigtune.core.presets import DEMO_CHAT_DATA

    demo = [json.loads(x) for x in DEMO_CHAT_DATA.read_text().splitlines() if x.strip()]
    turns = [[m for m in d["messages"] if m["role"] != "system"] for d in demo if "messages" in d]
    # whole exchanges only (the demo holds a few bad records on purpose: empty turns, wrong order)
    turns = [t for t in turns if t and t[0]["role"] == "user" and t[-1]["role"] == "assistant"]
    turns = [t for t in turns if all(m.get("content") for m in t)]
    chats = work / "long_chats.jsonl"
    chats.write_text(
        "".join(
            json.dumps({"messages": [m for k in range(40) for m in turns[(i * 40 + k) % len(turns)]]}) + "\n"
            for i in range(64)
        )
    )
    return chats


def _photo_captions(work: Path) -> Path:
    """The bundled 32 px photos at a real photo size (448 px: Qwen2-VL's processor keeps it, 32 x 32 patches,
    256 image tokens), with captions longer than the text budget."""
    from PIL import Image

    from bigtune.data.images import DEMO_IMAGES

    folder = work / "photos-448"
    folder.mkdir(exist_ok=True)
    images = []
    for src in sorted((DEMO_IMAGES / "images").glob("*.png"))[:32]:
        dst = folder / src.name
        Image.open(src).convert("RGB").resize((448, 448), Image.BICUBIC).save(dst)
        images.append(dst)
    captions = work / "photo_captions.jsonl"
    captions.write_text(_caption_lines(images, 256))
    return captions


def _qwen_vl_processor(work: Path) -> Path:
    """A Qwen2.5-VL processor folder for the random-init model (set as model.tokenizer): Qwen's image
    processor at its published defaults, bigtune's tiny tokenizer with Qwen's chat and vision tokens at the
    model config's ids (the model finds the image by those ids) and Qwen2-VL's chat template.

    Why here: a random-init chat VLM gets BLIP-2's processor from bigtune (load_processor), which fails on a
    Qwen2.5-VL config (no vision_config.image_size); the hub processor cannot be fetched on the GPU machine."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from bigtune.core.presets import QWEN2_VL_CHAT_TEMPLATE, TOKENIZER_FILE
    from bigtune.core.processors import chat_vlm_processor

    cfg = json.loads((ROOT / "src/bigtune/assets/configs/Qwen--Qwen2.5-VL-3B-Instruct.json").read_text())
    ids = {
        "<|endoftext|>": cfg["bos_token_id"],
        "<|im_start|>": 151644,  # between the two in Qwen2's tokenizer; the config does not name it
        "<|im_end|>": cfg["eos_token_id"],
        "<|vision_start|>": cfg["vision_start_token_id"],
        "<|vision_end|>": cfg["vision_end_token_id"],
        "<|image_pad|>": cfg["image_token_id"],
        "<|video_pad|>": cfg["video_token_id"],
    }
    spec = json.loads(TOKENIZER_FILE.read_text())
    for token, i in ids.items():  # in the vocabulary at the config's id, matched whole as a special token
        spec["model"]["vocab"][token] = i
        spec["added_tokens"].append(
            {
                "id": i,
                "content": token,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )
    folder = work / QWEN_VL_PROCESSOR
    folder.mkdir(exist_ok=True)
    (folder / "spec.json").write_text(json.dumps(spec))
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "spec.json"),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=32768,
        padding_side="right",
    )
    images = Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2)
    # image-only, as bigtune builds and loads every chat-VLM processor (core/processors.py), with or
    # without torchvision: the GPU machine has it, this machine does not, and the case behaves the same
    proc = chat_vlm_processor("Qwen2_5_VLProcessor", images, tok, QWEN2_VL_CHAT_TEMPLATE)
    proc.save_pretrained(folder)
    return folder


def _moe_8_layers(work: Path) -> Path:
    """Qwen3-30B-A3B's published config cut to its first 8 of 48 layers (every layer's shape kept: 128
    experts, 8 active), as a model folder with bigtune's tiny tokenizer (model.init random reads it)."""
    from bigtune.core.presets import tiny_tokenizer

    cfg = json.loads((ROOT / "src/bigtune/assets/configs/Qwen--Qwen3-30B-A3B.json").read_text())
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")} | {"num_hidden_layers": 8, "max_window_layers": 8}
    folder = work / MOE_8_LAYERS
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    tiny_tokenizer().save_pretrained(folder)
    return folder


def case_recipe(
    case: dict, data: dict[str, Path], out_dir: Path, name: str, steps: int, accelerator: str, smoke: bool
) -> tuple[str | None, dict]:
    """(base recipe path or None, overrides) for one case, as `bigtune train` gets them."""
    kind = case.get("kind", "llm")
    over = {
        "model.init": "random",
        "data.source": str(data[kind]),
        "data.val_fraction": 0.0,
        "data.max_seq_length": (SMOKE_SEQ if smoke else SEQ)[kind],
        "train.max_steps": steps,
        "train.max_epochs": None,
        # memory measured at steps 0, 1 and every PROBE_EVERY: a measured step synchronises at each phase and
        # reads the allocator four times, which the plan's step time does not price; the others are timed
        "memory.every_steps": PROBE_EVERY,
        "memory.plan": True,
        # an OOM is a result here; the in-process search for fitting variants would hold the GPU for minutes
        "memory.oom_alternatives": False,
        "checkpoint.enabled": False,
        "checkpoint.save_model": False,
        "accelerator": accelerator,
        "output_dir": str(out_dir),
        "name": name,
        "train.log_every_steps": 1,
    }
    if kind in ("blip2", "vlm") and not smoke:
        # images are decoded and resized per sample (BLIP-2: to 224 px): in the training process that would add
        # to the measured step time what the time model does not plan (the lab sets num_workers too)
        over["data.num_workers"] = 4
    # "@<name>": a folder write_data wrote (a processor, a cut-down model)
    over.update(
        {k: str(data[v[1:]]) if isinstance(v, str) and v.startswith("@") else v for k, v in case["over"].items()}
    )
    recipe = case.get("recipe")
    return (str(ROOT / recipe) if recipe else None), over


def missing_libraries(case: dict) -> list[str]:
    """The case's optional libraries (``needs``) that do not import here."""
    import importlib.util

    return [lib for lib in case.get("needs", ()) if importlib.util.find_spec(lib) is None]


def skipped_row(name: str, case: dict, reason: str) -> dict:
    return {
        "case": name,
        "note": case.get("note"),
        "expect": case.get("expect", "fit"),
        "status": "skipped",
        "reason": reason,
    }


def _value(v) -> str:
    return json.dumps(v) if v is None or isinstance(v, bool) else str(v)


# -- one case -----------------------------------------------------------------------------------------


def run_process(args: list[str], timeout: float, env: dict | None = None, cwd: str | None = None) -> dict:
    """Run a command in its own process group; on timeout kill the whole group (DataLoader workers,
    compile workers) so the GPU memory is released. Returns returncode, stdout, stderr, timed_out."""
    p = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd, start_new_session=True
    )
    try:
        out, err = p.communicate(timeout=timeout)
        return {"returncode": p.returncode, "stdout": out, "stderr": err, "timed_out": False}
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = p.communicate()
        return {"returncode": p.returncode, "stdout": out, "stderr": err, "timed_out": True}


def run_case(
    name: str,
    case: dict,
    data: dict[str, Path],
    work: Path,
    steps: int,
    timeout: float,
    accelerator: str,
    smoke: bool,
    log: Path | None = None,
) -> dict:
    out_dir = work / name
    recipe, over = case_recipe(case, data, out_dir, name, steps, accelerator, smoke)
    args = [sys.executable, "-m", "bigtune", "train"] + ([recipe] if recipe else [])
    for k, v in over.items():
        args += ["--set", f"{k}={_value(v)}"]
    # A random-init base that is quantized is written to a temporary folder first (16 GB for an 8B model)
    # and bigtune leaves it there: each case gets its own, removed when it ends, so the disk does not fill.
    tmp = work / f"{name}.tmp"
    tmp.mkdir(exist_ok=True)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(x for x in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if x),
        PYTHONUNBUFFERED="1",
        TMPDIR=str(tmp),
    )
    t0 = time.perf_counter()
    try:
        res = run_process(args, timeout, env=env, cwd=str(work))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if log is not None:  # every case's own output, for reading what a surprising number came from
        with open(log, "a") as f:
            f.write(
                f"\n===== {name}: {'TIMED OUT' if res['timed_out'] else 'finished'} (limit {timeout:.0f} s), "
                f"exit {res['returncode']}\n$ {' '.join(args)}\n{res['stdout']}\n----- stderr\n"
                f"{res['stderr'][-20000:]}\n"
            )
    row: dict = {
        "case": name,
        "note": case.get("note"),
        "expect": case.get("expect", "fit"),
        "recipe": case.get("recipe"),
        "overrides": case["over"],
        "max_seq_length": over["data.max_seq_length"],
        "exit_code": res["returncode"],
        "seconds": round(time.perf_counter() - t0, 2),
        "timeout_s": round(timeout, 1),
    }
    summary_path = out_dir / "summary.json"
    if res["timed_out"]:
        row["status"] = "timeout"
    elif not summary_path.exists():
        row["status"] = "no-summary"
    if "status" in row:
        row["stdout_tail"] = res["stdout"][-1500:]
        row["stderr_tail"] = res["stderr"][-2500:]
        return row
    s = json.loads(summary_path.read_text())
    metrics = (
        [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
        if (out_dir / "metrics.jsonl").exists()
        else []
    )
    row.update(row_from_summary(s, metrics))
    if row["status"] == "error":
        row["stderr_tail"] = res["stderr"][-2500:]
    return row


def row_from_summary(s: dict, metrics: list[dict]) -> dict:
    """The measured and predicted numbers of one run, and the errors computed from them."""
    plan = s.get("plan") or {}
    row: dict = {
        "status": s["status"],
        "steps": s.get("steps"),
        "device": (s.get("device") or {}).get("name"),
        "parameters": s.get("parameters"),
    }
    row["measured_peak_allocated"] = plan.get("measured_peak_allocated")
    row["predicted_peak_allocated"] = plan.get("predicted_peak_allocated_like_for_like")
    row["predicted_peak_allocated_worst_case"] = plan.get("predicted_peak_allocated")
    row["measured_peak_reserved"] = plan.get("measured_peak_reserved")
    row["predicted_peak_reserved"] = plan.get("predicted_peak_reserved_like_for_like")
    row["measured_device_used"] = plan.get("measured_device_used")
    row["predicted_peak_total"] = plan.get("predicted_peak_total_like_for_like", plan.get("predicted_peak_total"))
    row["predicted_fits"] = plan.get("predicted_fits")
    row["replanned_at_batch_shape"] = plan.get("replanned_at_batch_shape")
    row["peak_error_pct"] = error_pct(row["predicted_peak_allocated"], row["measured_peak_allocated"])
    row["reserved_error_pct"] = error_pct(row["predicted_peak_reserved"], row["measured_peak_reserved"])
    row["total_error_pct"] = error_pct(row["predicted_peak_total"], row["measured_device_used"])
    # checks of the planner's CUDA side: the measured reserved/allocated ratio (the plan replays the allocator)
    # and what the device holds outside the allocator (CUDA_CONTEXT_BYTES, assumed)
    row["measured_reserved_over_allocated"] = ratio(row["measured_peak_reserved"], row["measured_peak_allocated"])
    row["measured_outside_allocator"] = (
        row["measured_device_used"] - row["measured_peak_reserved"]
        if row["measured_device_used"] is not None and row["measured_peak_reserved"] is not None
        else None
    )
    row["phases"] = plan.get("phases")
    # Time: the steady steps only (the first ones include cuBLAS/allocator warm-up and the first snapshot).
    timed = steady_steps(metrics)
    if timed:
        seconds = sum(m["step_time_s"] for m in timed)
        row["timed_steps"] = [m["step"] for m in timed]
        row["measured_step_time_s"] = statistics.median(m["step_time_s"] for m in timed)
        row["measured_tokens_per_s"] = sum(m["tokens_per_s"] * m["step_time_s"] for m in timed) / seconds
        mfus = [m["mfu"] for m in timed if m.get("mfu") is not None]
        row["measured_mfu"] = statistics.median(mfus) if mfus else None
    else:
        row["measured_step_time_s"] = row["measured_tokens_per_s"] = row["measured_mfu"] = None
    row["predicted_step_time_s"] = plan.get("predicted_step_time_s")
    row["predicted_tokens_per_s"] = plan.get("predicted_tokens_per_s")
    row["step_time_error_pct"] = error_pct(row["predicted_step_time_s"], row["measured_step_time_s"])
    row["run_step_time_s"] = s.get("step_time_s")  # the engine's own mean over all steps (warm-up included)
    if s["status"] == "oom":
        oom = dict(s.get("oom") or {})
        oom["alternatives"] = (oom.get("alternatives") or [])[:5]
        row["oom"] = oom
    if s.get("error"):
        row["error"] = s["error"]
    return row


def probed(step: int, every: int | None = None) -> bool:
    """Whether metrics row ``step`` (1-based: the count after the step) was a memory-measured step, as the
    engine picks them (0-based step in (0, 1) or a multiple of memory.every_steps)."""
    every = every or PROBE_EVERY
    return step - 1 in (0, 1) or (step - 1) % every == 0


def steady_steps(metrics: list[dict]) -> list[dict]:
    """metrics.jsonl rows (one per step when log_every_steps is 1) after the first two steps and not
    memory-measured (``probed``), or the last row when the run has none such."""
    rows = [m for m in metrics if m.get("step_time_s")]
    if not rows:
        return []
    steady = [m for m in rows if m["step"] > 2 and not probed(m["step"])]
    return steady or rows[-1:]


def retry_timeout(row: dict, cases: dict) -> bool:
    """A timed-out row whose limit was below its case's own (``timeout``) now."""
    case = cases.get(row["case"])
    return row["status"] == "timeout" and case is not None and row.get("timeout_s", 0) < case["timeout"]


def error_pct(predicted, measured):
    if predicted is None or not measured:
        return None
    return 100.0 * (predicted - measured) / measured


def ratio(a, b):
    return a / b if a is not None and b else None


# -- the run ------------------------------------------------------------------------------------------


def stats(values: list[float]) -> dict:
    if not values:
        return {"cases": 0, "median_abs_pct": None, "worst_abs_pct": None, "mean_pct": None}
    return {
        "cases": len(values),
        "median_abs_pct": statistics.median(abs(v) for v in values),
        "worst_abs_pct": max(abs(v) for v in values),
        "mean_pct": statistics.fmean(values),
    }


def result_record(rows: list[dict], device: str, argv: list[str], started: float) -> dict:
    import torch

    def col(key):
        return [r[key] for r in rows if r.get(key) is not None]

    errors = {
        "peak_allocated": stats(col("peak_error_pct")),
        "peak_reserved": stats(col("reserved_error_pct")),
        "device_total": stats(col("total_error_pct")),
        "step_time": stats(col("step_time_error_pct")),
    }
    cal = {
        "reserved_over_allocated_median": _median(col("measured_reserved_over_allocated")),
        "outside_allocator_bytes_median": _median(col("measured_outside_allocator")),
        "mfu_median": _median(col("measured_mfu")),
    }
    versions = {"torch": torch.__version__}
    for mod in ("transformers", "lightning", "peft"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            versions[mod] = None
    status_counts: dict[str, int] = {}
    for r in rows:
        status_counts[r["status"]] = status_counts.get(r["status"], 0) + 1
    return {
        "device": device,
        **versions,
        "date": datetime.date.today().isoformat(),
        "command": "python bench/plan_accuracy.py " + " ".join(argv),
        "elapsed_s": round(time.time() - started, 1),
        # peak allocated: kept at the top level as before
        "median_abs_error_pct": errors["peak_allocated"]["median_abs_pct"],
        "worst_abs_error_pct": errors["peak_allocated"]["worst_abs_pct"],
        "cases_compared": errors["peak_allocated"]["cases"],
        "errors": errors,
        "calibration": cal,
        "status_counts": status_counts,
        "expectation_mismatches": [
            r["case"]
            for r in rows
            if r["status"] in ("ok", "oom") and (r["status"] == "oom") != (r.get("expect") == "oom")
        ],
        "cases": rows,
    }


def _median(values):
    return statistics.median(values) if values else None


def write_json(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)


def slug(device: str) -> str:
    s = re.sub(r"[^a-z0-9._-]+", "-", device.lower().replace("nvidia", "")).strip("-._")
    return s or "device"


def print_row(row: dict) -> None:
    """One line per case: measured / predicted (error) for peak allocated, peak reserved, the device's
    memory in use (nvidia-smi) against the plan's total, and the steady step time."""
    sizes = [
        row.get(k)
        for k in (
            "measured_peak_allocated",
            "predicted_peak_allocated",
            "measured_peak_reserved",
            "predicted_peak_reserved",
            "measured_device_used",
            "predicted_peak_total",
        )
    ]
    unit, div = ("GiB", 2**30) if max((x for x in sizes if x is not None), default=0) >= 2**30 else ("MiB", 2**20)

    def mem(n):
        return "      -" if n is None else f"{n / div:7.2f}"

    def pct(x):
        return "     -" if x is None else f"{x:+6.1f}"

    def sec(x):
        return "     -" if x is None else f"{x:6.3f}"

    expect = "" if row.get("expect", "fit") == "fit" else f" (expect {row['expect']})"
    if row["status"] == "skipped":
        print(f"{row['case']:<42} skipped: {row.get('reason', '')}", flush=True)
        return
    print(
        f"{row['case']:<42} {row['status']:<8} alloc {mem(row.get('measured_peak_allocated'))} / "
        f"{mem(row.get('predicted_peak_allocated'))} {pct(row.get('peak_error_pct'))}%  reserved "
        f"{mem(row.get('measured_peak_reserved'))} / {mem(row.get('predicted_peak_reserved'))} "
        f"{pct(row.get('reserved_error_pct'))}%  device {mem(row.get('measured_device_used'))} / "
        f"{mem(row.get('predicted_peak_total'))} {pct(row.get('total_error_pct'))}% {unit}  step "
        f"{sec(row.get('measured_step_time_s'))} / {sec(row.get('predicted_step_time_s'))} s  "
        f"[{row['seconds']:.0f}s]{expect}",
        flush=True,
    )


def print_summary(record: dict) -> None:
    for key, label in (
        ("peak_allocated", "peak allocated"),
        ("peak_reserved", "peak reserved"),
        ("device_total", "device total"),
        ("step_time", "step time"),
    ):
        e = record["errors"][key]
        if e["cases"]:
            print(
                f"{label} error over {e['cases']} cases: median |err| {e['median_abs_pct']:.2f}%, worst "
                f"{e['worst_abs_pct']:.2f}%, mean {e['mean_pct']:+.2f}%"
            )
        else:
            print(f"{label} error: no case compared")
    print(f"statuses: {record['status_counts']}; expectation mismatches: {record['expectation_mismatches'] or 'none'}")


def check_plans(names: list[str], cases: dict, gpu_name: str, smoke: bool) -> int:
    """Plan each case for the GPU here on the CPU (what the GPU run will predict) and check `expect`."""
    sys.path.insert(0, str(ROOT / "src"))
    from bigtune.core.gpus import find_gpu
    from bigtune.plan.base.target import Target
    from bigtune.plan.planner import plan
    from bigtune.recipe import load_recipe

    gpu = find_gpu(gpu_name)
    bad = 0
    with tempfile.TemporaryDirectory() as d:
        data = write_data(Path(d), inputs_of([cases[n] for n in names]))
        for name in names:
            case = cases[name]
            missing = missing_libraries(case)
            if missing:  # its recipe does not validate without the library: the GPU run skips it the same way
                print(f"{name:<42} skipped: {', '.join(missing)} not installed", flush=True)
                continue
            if input_errors(case, data):
                print(f"{name:<42} {'; '.join(input_errors(case, data))}  MISMATCH", flush=True)
                bad += 1
                continue
            recipe, over = case_recipe(case, data, Path(d) / name, name, 4, "auto", smoke)
            t0 = time.perf_counter()
            p = plan(load_recipe(recipe, over), Target("cuda", gpu))
            verdict = "fit" if p.fits else "oom"
            ok = verdict == case.get("expect", "fit")
            bad += not ok
            step = f"{p.step_time_s:.3f}" if p.step_time_s else "-"
            print(
                f"{name:<42} allocated {p.peak_allocated / 2**30:6.2f} total {p.peak_total / 2**30:6.2f} of "
                f"{p.capacity / 2**30:.2f} GiB -> {verdict:<3} (expect {case.get('expect', 'fit')}) step {step} s"
                f"{'' if ok else '  MISMATCH'}  [{time.perf_counter() - t0:.1f}s]",
                flush=True,
            )
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny presets (CI)")
    ap.add_argument("--only", nargs="*", help="case names to run (in the given order)")
    ap.add_argument("--skip", nargs="*", default=[], help="case names not to run")
    ap.add_argument("--steps", type=int, help="optimizer steps per case (default 8; --smoke 3)")
    ap.add_argument(
        "--budget-s",
        type=float,
        help="start no case whose estimate would end past this many seconds "
        "from the start (the rest are written as skipped)",
    )
    ap.add_argument("--case-timeout-s", type=float, help="override every case's own time limit")
    ap.add_argument("--resume", help="an earlier result JSON: keep its finished rows, run only the other cases")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"), help="folder for plan_accuracy-<gpu>.json")
    ap.add_argument("--case-log", help="append every case's stdout and stderr to this file")
    ap.add_argument("--list", action="store_true", help="print the cases in run order and exit")
    ap.add_argument("--check-plans", action="store_true", help="plan every case on this CPU for --gpu, check expect")
    ap.add_argument("--gpu", default="h100-80gb", help="catalog GPU for --check-plans")
    args = ap.parse_args(argv)
    cases = SMOKE_CASES if args.smoke else CASES
    unknown = [n for n in (args.only or []) + args.skip if n not in cases]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; --list shows them")
    names = [n for n in (args.only or list(cases)) if n not in args.skip]
    if args.list:
        for i, n in enumerate(names, 1):
            c = cases[n]
            print(
                f"{i:>2} {n:<42} expect {c.get('expect', 'fit'):<3} est {c['est']:>3}s max {c['timeout']:>3}s  "
                f"{c.get('note', '')}"
            )
        return 0
    if args.check_plans:
        return check_plans(names, cases, args.gpu, args.smoke)

    import torch

    if args.smoke:
        accelerator, device = "cpu", "cpu"
    elif torch.cuda.is_available():
        accelerator, device = "cuda", torch.cuda.get_device_name(0)
    else:
        print(
            "plan_accuracy: no CUDA GPU here; nothing measured (use --smoke for the CPU path, --check-plans for "
            "the plans)"
        )
        return 0
    steps = args.steps or (3 if args.smoke else 8)
    path = Path(args.out) / f"plan_accuracy-{slug(device)}{'-smoke' if args.smoke else ''}.json"
    started = time.time()
    t0 = _clock()
    spent = {"s": 0.0, "est": 0.0}  # wall seconds and estimates of the cases run by this command
    rows: list[dict] = []
    done: set[str] = set()
    if args.resume:
        prev = json.loads(Path(args.resume).read_text())
        # a case that timed out under a shorter limit than its own now (the budget cut it, or the limit was
        # raised since) is tried again, after the cases never tried
        retry = [r["case"] for r in prev["cases"] if retry_timeout(r, cases)]
        rows = [r for r in prev["cases"] if r["status"] != "skipped" and r["case"] not in retry]
        done = {r["case"] for r in rows}
        names = [n for n in names if n not in retry] + [n for n in names if n in retry]
        print(
            f"resume: {len(done)} finished case(s) from {args.resume}"
            + (f"; timed out before, tried again last: {', '.join(retry)}" if retry else ""),
            flush=True,
        )
    print(
        f"plan_accuracy on {device}: {len(names)} cases, {steps} steps each, budget "
        f"{args.budget_s or 'none'} s; writing {path}",
        flush=True,
    )
    print(
        "per case: measured / predicted (error) for peak allocated, peak reserved, device memory in use "
        "(nvidia-smi) vs the plan's total; steady step time; [wall seconds]",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        data = write_data(work, inputs_of([cases[n] for n in names if n not in done]))
        for name in names:
            if name in done:
                continue
            case = cases[name]
            timeout = args.case_timeout_s or case["timeout"]
            missing = missing_libraries(case)
            why = [f"{', '.join(missing)} not installed (carry the wheel)"] if missing else input_errors(case, data)
            if why:  # a row that says so (a later --resume tries it again), and the next case
                rows.append(skipped_row(name, case, "; ".join(why)))
                print_row(rows[-1])
                write_json(path, result_record(rows, device, argv, started))
                continue
            if args.budget_s is not None:
                left = args.budget_s - (_clock() - t0)
                # the estimates scaled by how long this machine took for the cases so far (within 0.5-1.5x)
                pace = min(1.5, max(0.5, spent["s"] / spent["est"])) if spent["est"] else 1.0
                need = case["est"] * pace
                if left < need:
                    rows.append(skipped_row(name, case, f"time budget: {left:.0f} s left, estimate {need:.0f} s"))
                    print_row(rows[-1])
                    write_json(path, result_record(rows, device, argv, started))
                    continue
                timeout = min(timeout, left)
            c0 = _clock()
            row = run_case(
                name,
                case,
                data,
                work,
                steps,
                timeout,
                accelerator,
                args.smoke,
                Path(args.case_log) if args.case_log else None,
            )
            spent["s"] += _clock() - c0
            spent["est"] += case["est"]
            rows.append(row)
            write_json(path, result_record(rows, device, argv, started))  # after every case: a kill loses nothing
            print_row(row)
    record = result_record(rows, device, argv, started)
    write_json(path, record)
    print_summary(record)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
