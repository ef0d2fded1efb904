"""The planner against PUBLISHED GPU memory measurements (litgpt, torchtune, HF docs, the course lab).

    python bench/published.py                      # plan every row (about 10-20 min on 2 cores), print, write JSON
    python bench/published.py --only R6 L1 ...     # some rows
    python bench/published.py --list               # the table and the skipped data points, nothing planned
    python bench/published.py --json OUT           # write the JSON here instead of bench/results/published-cpu-<date>.json

No GPU needed: each row is planned with the real planner (``bigtune.plan.planner.plan`` on a CUDA target from the
catalog) in its own process with a time limit, and compared like with like:

  metric kind              published counter                                    planned quantity
  peak_allocated           torch.cuda.max_memory_allocated (litgpt "GB" = 1e9)  peak allocated
  after_forward_allocated  torch.cuda.memory_allocated inside training_step     allocated after forward (the
                           (the lab's LitGPT prints: after forward, before       previous step's gradients are
                           backward, previous step's grads still alive)          still held there, as in the lab)
  reserved                 torch.cuda.max_memory_reserved (torchtune), or       reserved (allocator replay)
                           memory_reserved mid-step (the lab; reserved only
                           grows, so after step 1 it is the peak)
  device_used              nvidia-smi / pynvml used (CUDA context included)     reserved + the planner's CUDA context
  fit                      "OOM" / "fits" stated by the source                  FITS/OOM on that GPU

Rows with a published rate (``speed``) also show the step-time error beside the memory error, and the plan's
dense-peak floor: the step's matmul and attention FLOPs at the card's catalog peak with no efficiency. A
published step faster than that floor cannot be the stated setup; such rows are named and kept out of the
step_time statistic.

Every number is cited to the notes in bench/research/published-notes.md (source repo, path, commit). Rows whose
implementation differs materially from bigtune's engine carry a flag (``impl``): those gaps are what a user
comparing with the source sees, not errors of the planner for bigtune's own engine. Nothing here is tuned:
a row states the published setup as a recipe, and the planner's answer is printed as it is.

Writes bench/results/published-cpu-<date>.json atomically (every row, published and planned numbers, the
command, the date); rows are written as they finish, so an interrupted run keeps what it has.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3

# -- sources (as recorded in bench/research/published-notes.md) -------------------------------------------
LAB_A100 = "teaching-on-testbeds/llm-chi: snippets/multi_gpu_a100.md @5bb926bb0ac9d95ac6aa7901762b4a9825d2cd4e"
LAB_V100 = "teaching-on-testbeds/llm-chi: snippets/multi_gpu_v100.md @5bb926bb0ac9d95ac6aa7901762b4a9825d2cd4e"
LAB_SINGLE = "teaching-on-testbeds/llm-chi: snippets/single_gpu_a100.md (commit not recorded in the notes)"
LAB_BLIP = "teaching-on-testbeds/llm-chi: single/snippets/single_gpu.md (commit not recorded in the notes)"
RESOURCE = "Lightning-AI/litgpt: tutorials/resource-tables.md @4839345a (prefix as recorded)"
HUB = "Lightning-AI/litgpt: config_hub/finetune/README.md @03ffc551 (prefix as recorded)"
TORCHTUNE = "pytorch/torchtune: README.md @0031bfb0 (prefix as recorded)"
HF_PERF = (
    "huggingface/transformers: docs perf_train_gpu_one / model_memory_anatomy, older version "
    "(stored Korean translation, id 37018384513; English identical for these rows)"
)
PEFT_DS = "huggingface/peft: docs/source/accelerate/deepspeed.md (commit not recorded in the notes)"
FMS = (
    "foundation-model-stack/fms-acceleration: scripts/benchmarks/refs/a100_80gb.csv "
    "@0aab2c6f64e3e19d137efe2b8f7a4c65c23a2059"
)
# The CSV keeps only the columns that differ between its rows (benchmark.py gather_report(raw=False)); the rest
# are benchmark.py's defaults and defaults.yaml (stored versions @0055a36b and @1adc652c, not at the CSV's
# commit): packing on at 4096 tokens (the CSV's own tokens/s over samples/s is 4095-4098 per sample),
# gradient checkpointing on, flash-attn 2, accumulation 1, HF's default optimizer (adamw_torch). Versions:
# refs/requirements.txt (torch 2.4.1, transformers 4.45.2, peft 0.13.2, trl 0.11.4, flash-attn 2.6.3).
FMS_IMPL = (
    "HF Trainer (transformers 4.45) + PEFT 0.13 + TRL packing: flash-attn 2 over each packed 4096-token row "
    "(bigtune plans SDPA, whose flash kernel keeps the same output and log-sum-exp); that transformers' loss "
    "keeps fp32 logits and a shifted fp32 copy (logits.float(), then logits[..., :-1, :].contiguous()), where "
    "transformers 5 casts once inside the loss and shifts the labels instead"
)
FMS_NOTE = (
    "peak_allocated: HF Trainer's memory metrics summed (before_init + init + train deltas: "
    "torch.cuda.max_memory_allocated over train()); device_used: nvidia-smi memory.used sampled every second, "
    "peak minus the first reading (taken before the run started), so reserved + the CUDA context, planned with "
    "the planner's assumed context; the GPU is named only by the file name"
)
FMS_LORA = {
    "peft.method": "lora",
    "peft.r": 16,
    "peft.alpha": 16,
    "peft.dropout": 0.1,
    "peft.target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
}
# litgpt config_hub/finetune/<model>/*.yaml as stored (the table's commit 03ffc551 is not stored for them):
# the setup of the HUB rows below is read from these versions, named per row.
HUB_YAML = "Lightning-AI/litgpt: config_hub/finetune/{} @{} (stored version)"

# Sources that ran a Hugging Face transformers model in an eager training loop (statistics_of: hf_eager_reserved)
HF_EAGER_SOURCES = (HF_PERF, PEFT_DS, FMS)

# -- implementation flags: how the source's engine differs from bigtune's ----------------------------------
LITGPT = (
    "litgpt's own GPT model code (fused qkv, its own attention/MLP) and chunked cross-entropy, "
    "Lightning; not HF transformers"
)
LITGPT_LORA = LITGPT + "; LoRA forward with lm_head_chunk_size=128 (the full logits are never held)"
LITGPT_QLORA = LITGPT_LORA + (
    "; bnb.nf4 through Fabric replaces every Linear, the output head too (planned so: litgpt-nf4-head; "
    "bigtune, like HF loading, keeps the head 16-bit); bitsandbytes < 0.43.2 of its day kept each "
    "4-bit layer's input (planned so: legacy_bnb); bnb's PagedAdamW (finetune/lora.py under bnb precision) "
    "keeps the adapters' moments in CUDA managed memory, outside the allocator's counter (planned as torch "
    "AdamW: the plan holds them)"
)
# torchtune's CEWithChunkedOutputLoss: the output projection and the loss in 8 chunks of the 2 × 2048 tokens;
# bigtune's nearest setting (its chunks are also checkpointed, so even their logits are not kept).
TT_CHUNKED_CE = {"train.loss_chunk_tokens": 512}
TORCHTUNE_IMPL = (
    "torchtune: torch.compile, chunked cross-entropy (8 output chunks), its own model code (LoRA "
    "weights in bf16, as peft.adapter_dtype=bfloat16); the planner plans bigtune's eager step"
)
# Lightning's automatic optimization zeroes gradients after training_step, so the lab's mid-step print still
# holds the previous step's gradients; bigtune's engine frees them at its optimizer step (set_to_none).
# The lab's 4-GPU runs: Lightning's DDPStrategy() keeps gradient_as_bucket_view=False, so DDP's reducer buckets
# hold a second copy of the gradients beside .grad (bigtune's default is true: ddp_bucket_view).
LIGHTNING_DDP_KEYS = {"devices": 4, "strategy": "ddp", "ddp_bucket_view": False}
HF_TRAINER = (
    "HF Trainer on an older transformers (eager attention); nvidia-smi total: reserved + the 1343 MB the "
    "source measured after its first tiny tensor (its CUDA context then; planned so: src-context); the "
    "Trainer's model.zero_grad() (set_to_none defaulted to False before PyTorch 2.0) kept every gradient "
    "allocated, also through forward at acc 1 (planned so: kept-grads); the run (January 2022: PyTorch < "
    "1.11) kept each softmax input for backward (planned so: legacy_softmax)"
)
# The doc's print_gpu_utilization (pynvml used // 1024**2, so MiB) read 1343 after torch.ones((1, 1)).to("cuda"):
# the CUDA context and kernels of that 2022 stack plus the 2 MiB small-pool segment of that one tensor. The
# rows' totals are reserved + context, so the context is 1343 - 2 MiB; the planner's own 0.5 GiB is an
# assumption for today's stacks (CUDA loads kernels lazily since 11.7), not for this one.
HF_PERF_CONTEXT_MIB = 1343 - 2
# Why legacy_softmax (the doc's nvidia-smi printout is dated 11 January 2022, before PyTorch 1.11), per
# BERT-large layer and sample at 512 tokens: the planner's simulation of today's
# eager BertLayer holds 69 MiB (fp32) / 49 MiB (fp16 AMP) after forward, the same tensors as transformers 4.x
# (same ops; fused dropout's uint8 mask then, a bool mask now, both 1 byte), except that PyTorch < 1.11's
# SoftmaxBackward also saved the softmax input (pytorch issue #64000; 1.11 passes only its dtype to
# _softmax_backward_data, see transformers' is_torch_less_than_1_11 branch). That input is the scores plus
# the fp32 extended mask: 16 heads × 512 × 512 fp32 = 16 MiB, in fp32 and in fp16 AMP (the fp32 mask
# promoted the fp16 scores), 24 layers × 16 MiB = 0.375 GiB per sample.
# litgpt's model and loss, from its source (litgpt/model.py CausalSelfAttention.forward; litgpt/utils.py
# chunked_cross_entropy as finetune/full.py and the LLM API call it):
# - attention: with fewer key/value heads than query heads, k and v are repeat_interleave'd to every query
#   head before SDPA in training, and SDPA saves those copies for backward. Transformers hands SDPA the
#   grouped k and v (enable_gqa) when there is no mask, so bigtune's step saves n_kv/n_head of that. On
#   TinyLlama (4 of 32 heads) at fp32 that is 14 KiB more per token and layer: 4.8 GiB at 32 × 512 × 22.
# - full fine-tune loss: chunked_cross_entropy(logits[..., :-1, :], targets[..., 1:]) reshapes the sliced
#   logits (a copy, the slice is not contiguous) and takes cross-entropy per 128 rows; bigtune's loss shifts
#   the labels and copies nothing: one logits-sized tensor more from the loss through the backward.
LITGPT_GELU_NOTE = (
    "and its MLP's fused tanh GELU where transformers writes gelu_new out (phi-1.5, phi-2: one saved "
    "tensor per MLP element instead of several)"
)
LITGPT_ATTENTION_NOTE = (
    "planned with litgpt's attention: k and v repeated to every query head before SDPA, which saves "
    "those copies (no change where every head has its own k and v)"
)
LITGPT_FULL_LOSS_NOTE = (
    "planned with litgpt's full fine-tune loss: a copy of the sliced logits, cross-entropy per 128 rows"
)
# - output head: litgpt's GPT builds lm_head as its own nn.Linear beside transformer.wte and never ties the two
#   (litgpt/model.py); its checkpoint conversion fills the head from the embeddings where a checkpoint has none
#   (Gemma). So a Gemma model holds the vocabulary × hidden matrix twice, trains both in a full fine-tune, and
#   under bnb.nf4 Fabric's BitsandbytesPrecision swaps every nn.Linear, the head too, for a 4-bit layer.
LITGPT_UNTIED_HEAD_NOTE = (
    "planned with litgpt's output head, its own weight beside the embeddings (transformers ties the two for Gemma)"
)
LITGPT_NF4_HEAD_NOTE = "planned with the output head in 4 bits, as Fabric's bnb.nf4 quantizes every Linear"
LEGACY_SOFTMAX_NOTE = (
    "planned with PyTorch < 1.11's softmax, which saved its 16 MiB fp32 input per layer and sample "
    "(0.375 GiB per sample over 24 layers); today's PyTorch does not"
)

# -- base settings shared by rows -------------------------------------------------------------------------
OPENLLAMA7B, OPENLLAMA3B, OPENLLAMA13B = (
    "openlm-research/open_llama_7b",
    "openlm-research/open_llama_3b",
    "openlm-research/open_llama_13b",
)
TINYLLAMA = "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T"
LLAMA2_7B, LLAMA2_13B, LLAMA2_70B = (
    "meta-llama/Llama-2-7b-hf",
    "meta-llama/Llama-2-13b-hf",
    "meta-llama/Llama-2-70b-hf",
)
LLAMA3_8B, LLAMA31_8B = "meta-llama/Meta-Llama-3-8B", "meta-llama/Llama-3.1-8B"
# litgpt/lab full fine-tunes: bf16-true weights, torch AdamW with the lab's betas.
LIT_FULL = {"precision": "bf16-true", "optim.name": "adamw", "optim.betas": [0.9, 0.95]}
# PyTorch Lightning's Trainer (the lab's scripts) frees the gradients after the next training_step, just
# before its backward: the recipe key that runs (and plans) the same order.
PL_ORDER = {"optim.zero_grad": "before_backward"}

# The lab's fine-tune-blip.py (single/workspace, stored @5488cf1c) builds its text with the processor's tokenizer
# alone: processor.tokenizer(captions, padding=True, truncation=True, max_length=50) and labels=input_ids, so
# no <image> placeholders. The checkpoints' configs name image_token_index (50265 for OPT, 32100 for Flan-T5; the
# bundled configs), and with it Blip2ForConditionalGeneration masked_scatters the Q-Former's 32 outputs into
# the placeholders' positions: with none there, the language model reads the caption alone (the vision encoder
# and Q-Former still run forward and backward). bigtune's collator puts 32 placeholders first (OPT: 32 + the
# caption; Flan-T5: the encoder 32 + EOS, the decoder the caption). Planned at the 50-token cap, since
# padding=True pads each batch to its longest caption and the captions' lengths are not published.
LAB_BLIP_INPUTS_NOTE = (
    "planned with the lab script's inputs (lab-blip-inputs): the tokenizer's captions without <image> placeholders, "
    "so the language model reads the caption alone (OPT: the caption; Flan-T5: the caption into the encoder and as "
    "labels), at the 50-token cap"
)


# litgpt LoRA: r, alpha, targets per row; dropout 0.05 (litgpt's default in every config cited).
def lit_lora(r: int, alpha: int, targets: list[str], quantize: str = "none", double_quant: bool = False) -> dict:
    # litgpt creates its LoRA weights in the model's dtype (bf16 under bf16-true), as peft.adapter_dtype=bfloat16
    over = {
        **LIT_FULL,
        "peft.method": "lora",
        "peft.r": r,
        "peft.alpha": alpha,
        "peft.dropout": 0.05,
        "peft.target_modules": targets,
        "peft.adapter_dtype": "bfloat16",
    }
    if quantize != "none":  # litgpt bnb.nf4 / bnb.nf4-dq: 4-bit base, bf16 compute (bf16-true)
        # Fabric's BitsandbytesPrecision swaps the Linear classes and builds everything else in bf16 (its
        # tensor_init_context): no fp32 cast of norms/embeddings as peft's k-bit preparation does.
        over.update({"model.quantize": quantize, "model.double_quant": double_quant, "model.upcast_unquantized": False})
    return over


# lit-gpt's 2023 multi-GPU lora.py: FSDP1 (per Block, use_orig_params) over a batch of 128 in micro-batches,
# accumulated under Fabric's no_backward_sync (FSDP1's no_sync: every rank keeps the unsharded gradients
# through the window; any window longer than one needs the same memory).
LIT_FSDP1 = (
    "FSDP1 per Block (lit-gpt 2023), not FSDP2: each Block is one flat unit holding the frozen weights "
    "and the LoRA ones, so it keeps a gradient for all of them (planned so: fsdp1_units)"
)


def LIT_FSDP_ACCUMULATION(devices: int, micro_batch: int) -> dict:  # noqa: N802 (a table constant)
    return {"train.accumulate_grad_batches": max(1, 128 // devices // micro_batch), "fsdp_grad_sync": "step"}


QV = ["q_proj", "v_proj"]
# litgpt lora_query/key/value/projection/mlp/head all on, in HF module names (phi-2 and Phi-3 name theirs apart)
PHI2_ALL_AND_HEAD = ["q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2", "lm_head"]
PHI3_ALL_AND_HEAD = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"]
LLAMA_ALL_AND_HEAD = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
# The longest Alpaca sample decides litgpt's resource-table peak (batches padded to the longest):
ALPACA_LONGEST_LLAMA2, ALPACA_LONGEST_PHI15 = 1304, 1044

BLIP_OPT27, BLIP_OPT67, BLIP_XXL = (
    "recipes/blip2-opt-2.7b.yaml",
    "recipes/blip2-opt-6.7b.yaml",
    "recipes/blip2-flan-t5-xxl.yaml",
)
BERT_BASE = "recipes/distilbert-sst2.yaml"  # a sequence-classification recipe; the model is overridden
BERT = {
    "model.name": "bert-large-uncased",
    "data.max_seq_length": 512,
    "model.attn_implementation": "eager",
    "optim.implementation": "for-loop",
}  # transformers' adamw_hf steps parameter by parameter
TT_LORA = ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # q,v,output_proj + MLP


@dataclass(frozen=True)
class Row:
    """One published data point and how to state it as a bigtune recipe."""

    id: str
    source: str
    setup: str  # one line: model, method, batch × tokens, GPU(s)
    metric: str  # peak_allocated | after_forward_allocated | reserved | device_used | fit
    value: Optional[float]  # the published number in `unit` (None for fit rows)
    unit: str  # GB (1e9 bytes) | GiB | MiB | - (fit rows)
    gpu: str  # catalog name (bigtune.gpus.find_gpu)
    over: dict = field(default_factory=dict)  # recipe overrides (dotted keys)
    recipe: Optional[str] = None  # base recipe under recipes/ (None: bigtune's built-in defaults)
    gpus: int = 1
    strategy: str = "single"  # single | ddp | fsdp | deepspeed_* (the planner's Target strategy)
    expect: Optional[str] = None  # fit rows: "fit" | "oom"
    impl: str = ""  # material implementation difference from bigtune's engine ("" = none)
    note: str = ""  # what else a reader must know (ranks shown, assumptions)
    # Published speed where the rows have FIXED lengths (packed or synthetic data), so the planned step time
    # answers the same batch: (value, "tokens/s" | "samples/s"). Sources whose batches are padded to a
    # varying longest sample (LitGPT's Alpaca, the lab) are left out: their mean length is not published.
    speed: Optional[tuple] = None
    # bitsandbytes before 0.43.2 (July 2024, bitsandbytes PR #1270) kept each 4-bit layer's input for a
    # backward that never used it; bigtune's bitsandbytes does not. Such rows are planned with that input
    # kept (the source's library, emulated in the planner's 4-bit stand-in; the engine is not involved).
    legacy_bnb: bool = False
    # FSDP1 flat units with use_orig_params (litgpt 2023): a unit with any trainable weight holds gradients
    # for all of its weights (PyTorch's FSDP docs warn of it; litgpt issue #1417)
    fsdp1_units: bool = False
    # PyTorch before 1.11 (March 2022) saved each softmax's input for a backward that only needs the output
    # (pytorch issue #64000); rows measured on it are planned with that input kept (bench-only emulation).
    legacy_softmax: bool = False
    # Optimizer.zero_grad(set_to_none=False), PyTorch's default before 2.0 and what HF Trainer's
    # model.zero_grad() did then: every gradient stays allocated (zeroed in place) across steps, also through
    # the forward after an optimizer step, where bigtune's engine frees them (bench-only emulation).
    keep_gradients: bool = False
    # The CUDA context the source itself measured (nvidia-smi after its first tiny tensor, in MiB): a
    # device_used row is then planned as reserved + this, not + the planner's assumed context.
    context_mib: Optional[float] = None

    def lab_blip_inputs(self) -> bool:
        """Rows of the lab's fine-tune-blip.py are planned with the inputs that script builds (LAB_BLIP_INPUTS_NOTE,
        bench-only ``_lab_blip_inputs``), not with the image placeholders bigtune's collator puts first."""
        return self.source == LAB_BLIP

    def shortest_over(self) -> Optional[dict]:
        """The overrides of the shortest batch the source admits, for a fit row whose run's longest batch is not
        published (None: the row's lengths are the run's). The lab's BLIP-2 script pads each batch to its
        longest caption, truncated at 50 tokens, and the captions' lengths are not published: its rows are
        planned at the cap and, where the cap does not settle the verdict, at 2 tokens (BOS or EOS and one word,
        the shortest a longest caption can be). Memory grows with the length, so the source's verdict is
        determined by its stated setup only where both ends agree (fit_outcome)."""
        return {"data.max_seq_length": 2} if self.metric == "fit" and self.source == LAB_BLIP else None

    def litgpt_emulations(self) -> list[str]:
        """What of litgpt's own code the row is planned with (rows whose impl is litgpt's model), bench-only
        emulations like legacy_softmax: its attention (LITGPT_ATTENTION_NOTE) and its fused GELU
        (LITGPT_GELU_NOTE) on every litgpt row, its full fine-tune loss (LITGPT_FULL_LOSS_NOTE) where no
        adapter is trained, its own output head where transformers ties it to the embeddings
        (LITGPT_UNTIED_HEAD_NOTE), and that head in 4 bits where the base is (LITGPT_NF4_HEAD_NOTE)."""
        if not self.impl.startswith(LITGPT):
            return []
        out = ["litgpt-attention", "litgpt-gelu"] + ([] if "peft.method" in self.over else ["litgpt-full-loss"])
        if _ties_head(self.over["model.name"]):
            out.append("litgpt-untied-head")
        if self.over.get("model.quantize", "none") != "none":
            out.append("litgpt-nf4-head")
        return out

    def value_gib(self) -> Optional[float]:
        if self.value is None:
            return None
        return self.value * {"GB": 1e9 / GIB, "GiB": 1.0, "MiB": 1 / 1024}[self.unit]

    def plan_key(self) -> str:
        """Rows that differ only in the published counter share one plan."""
        # The emulation changes the plan, so it is part of the key (absent when off: other keys unchanged).
        legacy = ["legacy_softmax"] if self.legacy_softmax else []
        legacy += ["keep_gradients"] if self.keep_gradients else []
        legacy += self.litgpt_emulations()
        legacy += ["lab-blip-inputs"] if self.lab_blip_inputs() else []
        return json.dumps([self.recipe, self.over, self.gpu, self.gpus, self.strategy, *legacy], sort_keys=True)


def _lab7b(**over) -> dict:
    return {
        "model.name": OPENLLAMA7B,
        **LIT_FULL,
        **PL_ORDER,
        "data.max_seq_length": 512,
        "train.micro_batch_size": 4,
        **over,
    }


def _tiny_lab(**over) -> dict:
    return {
        "model.name": TINYLLAMA,
        **LIT_FULL,
        **PL_ORDER,
        "data.max_seq_length": 512,
        "train.micro_batch_size": 8,
        "train.accumulate_grad_batches": 4,
        **over,
    }


# The lab's FSDPStrategy(sharding_strategy="FULL_SHARD") names no auto_wrap_policy: one flat unit.
LAB_FSDP_KEYS = {"devices": 4, "strategy": "fsdp", "fsdp_wrap": "none"}
LAB_FSDP_IMPL = (
    "; Lightning FSDPStrategy (FSDP1, one flat parameter, gradients reduced every micro-batch), "
    "planned as bigtune's FSDP2 with the root as its only unit"
)
LAB_NOTE = (
    "Alpaca2k truncated at 512 and padded to the batch's longest; planned at full 512-token rows "
    "(the printed step's batch may be shorter)"
)
RANKS = "max of the ranks shown"

ROWS: list[Row] = [
    # ---- the course lab, LitGPT Python API under Lightning (mid-step prints, GiB) ----
    Row(
        "L1",
        LAB_A100,
        "OpenLLaMA-7B full, bf16-true, AdamW, 4×≤512, acc 4, 1×A100-80",
        "after_forward_allocated",
        61.99,
        "GiB",
        "a100-80gb",
        _lab7b(**{"train.accumulate_grad_batches": 4}),
        impl=LITGPT,
        note=LAB_NOTE,
    ),
    Row(
        "L1.res",
        LAB_A100,
        "as L1: reserved",
        "reserved",
        73.30,
        "GiB",
        "a100-80gb",
        _lab7b(**{"train.accumulate_grad_batches": 4}),
        impl=LITGPT,
        note=LAB_NOTE,
    ),
    Row(
        "L2",
        LAB_A100,
        "OpenLLaMA-7B full, bf16-true, AdamW, 4×≤512, 1×A100-80",
        "after_forward_allocated",
        61.97,
        "GiB",
        "a100-80gb",
        _lab7b(),
        impl=LITGPT,
        note=LAB_NOTE,
    ),
    Row(
        "L2.res",
        LAB_A100,
        "as L2: reserved",
        "reserved",
        71.35,
        "GiB",
        "a100-80gb",
        _lab7b(),
        impl=LITGPT,
        note=LAB_NOTE,
    ),
    Row(
        "L3",
        LAB_A100,
        "OpenLLaMA-7B full, bf16-true, AdamW, 4×≤512, 4×A100-80 DDP",
        "after_forward_allocated",
        73.98,
        "GiB",
        "a100-80gb",
        _lab7b(**LIGHTNING_DDP_KEYS),
        gpus=4,
        strategy="ddp",
        impl=LITGPT,
        note=f"{RANKS} (70.44 / 69.62 / 73.98); " + LAB_NOTE,
    ),
    Row(
        "L3.res",
        LAB_A100,
        "as L3: reserved",
        "reserved",
        78.30,
        "GiB",
        "a100-80gb",
        _lab7b(**LIGHTNING_DDP_KEYS),
        gpus=4,
        strategy="ddp",
        impl=LITGPT,
        note=f"{RANKS} (78.06 / 78.12 / 78.30)",
    ),
    Row(
        "L6",
        LAB_V100,
        "TinyLlama-1.1B full, bf16-true, AdamW, 8×≤512, acc 4, 1×V100-32",
        "after_forward_allocated",
        23.92,
        "GiB",
        "v100-32gb",
        _tiny_lab(),
        impl=LITGPT,
        note=LAB_NOTE,
    ),
    Row(
        "L6.res",
        LAB_V100,
        "as L6: reserved",
        "reserved",
        25.16,
        "GiB",
        "v100-32gb",
        _tiny_lab(),
        impl=LITGPT,
        note=LAB_NOTE,
    ),
    Row(
        "L7",
        LAB_V100,
        "TinyLlama-1.1B full, bf16-true, AdamW, 8×≤512, acc 4, 4×V100-32 DDP",
        "after_forward_allocated",
        25.27,
        "GiB",
        "v100-32gb",
        _tiny_lab(**LIGHTNING_DDP_KEYS),
        gpus=4,
        strategy="ddp",
        impl=LITGPT,
        note=f"{RANKS} (23.75 / 23.10 / 25.27); " + LAB_NOTE,
    ),
    Row(
        "L7.res",
        LAB_V100,
        "as L7: reserved",
        "reserved",
        31.22,
        "GiB",
        "v100-32gb",
        _tiny_lab(**LIGHTNING_DDP_KEYS),
        gpus=4,
        strategy="ddp",
        impl=LITGPT,
        note=f"{RANKS} (31.22 / 27.19 / 28.74)",
    ),
    *[
        Row(
            i,
            LAB_A100,
            f"OpenLLaMA-7B full, bf16-true, AdamW, {b}×≤512, 4×A100-80 FSDP, no wrap policy",
            m,
            v,
            "GiB",
            "a100-80gb",
            _lab7b(**LAB_FSDP_KEYS, **{"train.micro_batch_size": b}),
            gpus=4,
            strategy="fsdp",
            impl=LITGPT + LAB_FSDP_IMPL,
            note=f"{RANKS} ({ranks})" + ("; " + LAB_NOTE if m != "reserved" else ""),
        )
        for i, b, m, v, ranks in (
            ("L4", 4, "after_forward_allocated", 36.33, "31.96 / 32.79 / 36.33"),
            ("L4.res", 4, "reserved", 56.00, "56.00 / 55.98 / 55.76"),
            ("L5", 8, "after_forward_allocated", 62.95, "62.95 / 59.51 / 62.95"),
            ("L5.res", 8, "reserved", 67.67, "67.67 / 62.71 / 64.74"),
        )
    ],
    *[
        Row(
            i,
            LAB_V100,
            "TinyLlama-1.1B full, bf16-true, AdamW, 8×≤512, acc 4, 4×V100-32 FSDP, no wrap policy",
            m,
            v,
            "GiB",
            "v100-32gb",
            _tiny_lab(**LAB_FSDP_KEYS),
            gpus=4,
            strategy="fsdp",
            impl=LITGPT + LAB_FSDP_IMPL,
            note=f"{RANKS} ({ranks})" + ("; " + LAB_NOTE if m != "reserved" else ""),
        )
        for i, m, v, ranks in (
            ("L8", "after_forward_allocated", 21.35, "19.13 / 20.65 / 21.35"),
            ("L8.res", "reserved", 26.12, "26.12 / 25.27 / 24.99"),
        )
    ],
    *[
        Row(
            i,
            LAB_V100,
            "OpenLLaMA-3B full, bf16-true, AdamW, 1×≤512, 4×V100-32 FSDP, no wrap policy",
            m,
            v,
            "GiB",
            "v100-32gb",
            {
                "model.name": OPENLLAMA3B,
                **LIT_FULL,
                **PL_ORDER,
                "data.max_seq_length": 512,
                "train.micro_batch_size": 1,
                **LAB_FSDP_KEYS,
            },
            gpus=4,
            strategy="fsdp",
            impl=LITGPT + LAB_FSDP_IMPL,
            note=f"{RANKS} ({ranks})" + ("; " + LAB_NOTE if m != "reserved" else ""),
        )
        for i, m, v, ranks in (
            ("L9", "after_forward_allocated", 13.27, "13.12 / 13.26 / 13.27"),
            ("L9.res", "reserved", 28.35, "28.35 / 27.56 / 27.54"),
        )
    ],
    Row(
        "L9.1dev",
        LAB_V100,
        "OpenLLaMA-3B full, bf16-true, AdamW, 1×≤512, 1×V100-32",
        "fit",
        None,
        "-",
        "v100-32gb",
        {"model.name": OPENLLAMA3B, **LIT_FULL, **PL_ORDER, "data.max_seq_length": 512, "train.micro_batch_size": 1},
        expect="oom",
        impl=LITGPT,
        note="v100_llama3b_1device.py is stated to run out of memory",
    ),
    # older LitGPT-CLI lab (litgpt finetune_full, 1×A100 80GB, Alpaca2k max_seq_length 512)
    Row(
        "LF1",
        LAB_SINGLE,
        "TinyLlama-1.1B full, 32-true, AdamW, 32×≤512, 1×A100-80",
        "fit",
        None,
        "-",
        "a100-80gb",
        {
            "model.name": TINYLLAMA,
            **LIT_FULL,
            "precision": "32-true",
            "data.max_seq_length": 512,
            "train.micro_batch_size": 32,
        },
        expect="oom",
        impl=LITGPT,
    ),
    Row(
        "LF2",
        LAB_SINGLE,
        "TinyLlama-1.1B full, 32-true, AdamW, 8×≤512, 1×A100-80",
        "fit",
        None,
        "-",
        "a100-80gb",
        {
            "model.name": TINYLLAMA,
            **LIT_FULL,
            "precision": "32-true",
            "data.max_seq_length": 512,
            "train.micro_batch_size": 8,
        },
        expect="fit",
        impl=LITGPT,
        note="stated to fit easily",
    ),
    Row(
        "LF3",
        LAB_SINGLE,
        "OpenLLaMA-13B full, bf16-true, AdamW, 1×≤512, 1×A100-80",
        "fit",
        None,
        "-",
        "a100-80gb",
        {"model.name": OPENLLAMA13B, **LIT_FULL, "data.max_seq_length": 512, "train.micro_batch_size": 1},
        expect="oom",
        impl=LITGPT,
    ),
    Row(
        "LF4",
        LAB_SINGLE,
        "OpenLLaMA-13B full, bf16-true, SGD, 1×≤512, 1×A100-80",
        "fit",
        None,
        "-",
        "a100-80gb",
        {
            "model.name": OPENLLAMA13B,
            **LIT_FULL,
            "optim.name": "sgd",
            "data.max_seq_length": 512,
            "train.micro_batch_size": 1,
        },
        expect="fit",
        impl=LITGPT,
    ),
    Row(
        "LF5",
        LAB_SINGLE,
        "OpenLLaMA-7B full, bf16-true, AdamW, 4×≤512, 1×A100-80",
        "fit",
        None,
        "-",
        "a100-80gb",
        _lab7b(**{"optim.zero_grad": "after_step"}),
        expect="fit",
        impl=LITGPT,
    ),  # LitGPT's CLI: Fabric's order
    # ---- the lab's BLIP-2 fine-tune (HF Blip2ForConditionalGeneration under Lightning, as bigtune; captions
    # ≤ 50 tokens, planned at 50; every part trained, as the recipes) ----
    Row(
        "B1a",
        LAB_BLIP,
        "BLIP-2 OPT-2.7b all parts, 32-true, AdamW, bs 32, 1×A100-80",
        "fit",
        None,
        "-",
        "a100-80gb",
        {**PL_ORDER, "train.micro_batch_size": 32},
        BLIP_OPT27,
        expect="oom",
    ),
    Row(
        "B1b",
        LAB_BLIP,
        "BLIP-2 OPT-2.7b all parts, 32-true, AdamW, bs 64, 1×H100 94GB",
        "fit",
        None,
        "-",
        "h100-nvl-94gb",
        {**PL_ORDER, "train.micro_batch_size": 64},
        BLIP_OPT27,
        expect="oom",
        note="the lab's H100 is described as 94 GB VRAM (g1.h100.pci.1); planned on the catalog's H100 NVL 94GB",
    ),
    Row(
        "B2",
        LAB_BLIP,
        "BLIP-2 OPT-2.7b all parts, 32-true, AdamW, bs 16, 1×A100-80",
        "fit",
        None,
        "-",
        "a100-80gb",
        {**PL_ORDER, "train.micro_batch_size": 16},
        BLIP_OPT27,
        expect="fit",
    ),
    Row(
        "B3",
        LAB_BLIP,
        "BLIP-2 OPT-6.7b all parts, bf16-true, AdamW, 16/4, 1×A100-80",
        "fit",
        None,
        "-",
        "a100-80gb",
        {**PL_ORDER, "precision": "bf16-true", "train.micro_batch_size": 16, "train.accumulate_grad_batches": 4},
        BLIP_OPT67,
        expect="fit",
    ),
    Row(
        "B4a",
        LAB_BLIP,
        "BLIP-2 Flan-T5-XXL all parts, bf16-true, AdamW, bs 1, 1×A100-80",
        "fit",
        None,
        "-",
        "a100-80gb",
        {**PL_ORDER, "train.micro_batch_size": 1, "train.accumulate_grad_batches": 1},
        BLIP_XXL,
        expect="oom",
    ),
    Row(
        "B4b",
        LAB_BLIP,
        "BLIP-2 Flan-T5-XXL all parts, bf16-true, AdamW, bs 1, 1×H100 94GB",
        "fit",
        None,
        "-",
        "h100-nvl-94gb",
        {**PL_ORDER, "train.micro_batch_size": 1, "train.accumulate_grad_batches": 1},
        BLIP_XXL,
        expect="oom",
    ),
    Row(
        "B5",
        LAB_BLIP,
        "BLIP-2 Flan-T5-XXL all parts, bf16-true, SGD, 16/4, 1×A100-80",
        "fit",
        None,
        "-",
        "a100-80gb",
        {**PL_ORDER, "optim.name": "sgd", "train.micro_batch_size": 16, "train.accumulate_grad_batches": 4},
        BLIP_XXL,
        expect="fit",
    ),
    Row(
        "B6a",
        LAB_BLIP,
        "BLIP-2 Flan-T5-XXL all parts, bf16-true, Adam8bit, 2/2, 1×A100-80",
        "fit",
        None,
        "-",
        "a100-80gb",
        {**PL_ORDER, "optim.name": "adam8bit", "train.micro_batch_size": 2, "train.accumulate_grad_batches": 2},
        BLIP_XXL,
        expect="fit",
    ),
    Row(
        "B6b",
        LAB_BLIP,
        "as B6a + activation checkpointing",
        "fit",
        None,
        "-",
        "a100-80gb",
        {
            **PL_ORDER,
            "optim.name": "adam8bit",
            "train.micro_batch_size": 2,
            "train.accumulate_grad_batches": 2,
            "train.activation_checkpointing": True,
        },
        BLIP_XXL,
        expect="fit",
    ),
    Row(
        "B7",
        LAB_BLIP,
        "BLIP-2 Flan-T5-XXL all parts, bf16-true, ZeRO-2 offload (CPU Adam), 16/4, 1×A100-80",
        "fit",
        None,
        "-",
        "a100-80gb",
        {"strategy": "deepspeed_stage_2_offload", "train.micro_batch_size": 16, "train.accumulate_grad_batches": 4},
        BLIP_XXL,
        strategy="deepspeed_stage_2_offload",
        expect="fit",
    ),
    Row(
        "B8",
        LAB_BLIP,
        "BLIP-2 Flan-T5-XXL LoRA r16/α32, 32-true, AdamW, 32/2, 1×A100-80",
        "fit",
        None,
        "-",
        "a100-80gb",
        {
            **PL_ORDER,
            "precision": "32-true",
            "peft.method": "lora",
            "peft.r": 16,
            "peft.alpha": 32,
            "peft.dropout": 0.05,
            "train.micro_batch_size": 32,
            "train.accumulate_grad_batches": 2,
        },
        BLIP_XXL,
        expect="fit",
        note="stated to fit easily; the lab's captions are shorter than 50 tokens",
    ),
    Row(
        "B9",
        LAB_BLIP,
        "BLIP-2 Flan-T5-XXL QLoRA (nf4) r16/α32, 32-true, AdamW, bs 64, checkpointed (peft k-bit prep), 1×A100-80",
        "fit",
        None,
        "-",
        "a100-80gb",
        {
            **PL_ORDER,
            "precision": "32-true",
            "model.quantize": "nf4",
            "peft.method": "lora",
            "peft.r": 16,
            "peft.alpha": 32,
            "peft.dropout": 0.05,
            "train.micro_batch_size": 64,
            "train.accumulate_grad_batches": 1,
            # fine-tune-blip-lora.py calls prepare_model_for_kbit_training(model) with peft's defaults, and
            # use_gradient_checkpointing=True is one: the 4-bit run checkpoints every layer though its cfg
            # says act_ckpt False (that key only drives gradient_checkpointing_enable() further down)
            "train.activation_checkpointing": True,
        },
        BLIP_XXL,
        expect="fit",
        note="act_ckpt False in the cfg, yet peft's prepare_model_for_kbit_training turns checkpointing on",
    ),
    # ---- litgpt tutorials/resource-tables.md (A100-SXM4-40GB, Alpaca padded to the longest sample) ----
    Row(
        "R1",
        RESOURCE,
        "phi-1.5 LoRA r8 q,v, bf16-true, 1×1044, 1×A100-40",
        "peak_allocated",
        4.82,
        "GB",
        "a100-sxm-40gb",
        {
            "model.name": "microsoft/phi-1_5",
            **lit_lora(8, 16, QV),
            "train.micro_batch_size": 1,
            "data.max_seq_length": ALPACA_LONGEST_PHI15,
        },
        impl=LITGPT_LORA,
    ),
    Row(
        "R2",
        RESOURCE,
        "phi-1.5 LoRA r8 q,v, bf16-true, 4×1044, 1×A100-40",
        "peak_allocated",
        10.68,
        "GB",
        "a100-sxm-40gb",
        {
            "model.name": "microsoft/phi-1_5",
            **lit_lora(8, 16, QV),
            "train.micro_batch_size": 4,
            "data.max_seq_length": ALPACA_LONGEST_PHI15,
        },
        impl=LITGPT_LORA,
    ),
    Row(
        "R3",
        RESOURCE,
        "phi-1.5 QLoRA nf4 r8 q,v, bf16-true, 1×1044, 1×A100-40",
        "peak_allocated",
        3.78,
        "GB",
        "a100-sxm-40gb",
        {
            "model.name": "microsoft/phi-1_5",
            **lit_lora(8, 16, QV, "nf4"),
            "train.micro_batch_size": 1,
            "data.max_seq_length": ALPACA_LONGEST_PHI15,
        },
        impl=LITGPT_QLORA,
        legacy_bnb=True,
    ),
    Row(
        "R6",
        RESOURCE,
        "Llama-2-7B LoRA r8 q,v, bf16-true, 1×1304, 1×A100-40",
        "peak_allocated",
        21.30,
        "GB",
        "a100-sxm-40gb",
        {
            "model.name": LLAMA2_7B,
            **lit_lora(8, 16, QV),
            "train.micro_batch_size": 1,
            "data.max_seq_length": ALPACA_LONGEST_LLAMA2,
        },
        impl=LITGPT_LORA,
    ),
    Row(
        "R7",
        RESOURCE,
        "Llama-2-7B LoRA r8 q,v, bf16-true, 2×1304, 1×A100-40",
        "peak_allocated",
        29.07,
        "GB",
        "a100-sxm-40gb",
        {
            "model.name": LLAMA2_7B,
            **lit_lora(8, 16, QV),
            "train.micro_batch_size": 2,
            "data.max_seq_length": ALPACA_LONGEST_LLAMA2,
        },
        impl=LITGPT_LORA,
    ),
    Row(
        "R8",
        RESOURCE,
        "Llama-2-7B LoRA r8 q,v, bf16-true, 4×1304, 1×A100-40",
        "fit",
        None,
        "-",
        "a100-sxm-40gb",
        {
            "model.name": LLAMA2_7B,
            **lit_lora(8, 16, QV),
            "train.micro_batch_size": 4,
            "data.max_seq_length": ALPACA_LONGEST_LLAMA2,
        },
        expect="oom",
        impl=LITGPT_LORA,
    ),
    Row(
        "R9a",
        RESOURCE,
        "Llama-2-7B QLoRA nf4 r8 q,v, bf16-true, 1×1304, 1×A100-40",
        "peak_allocated",
        14.14,
        "GB",
        "a100-sxm-40gb",
        {
            "model.name": LLAMA2_7B,
            **lit_lora(8, 16, QV, "nf4"),
            "train.micro_batch_size": 1,
            "data.max_seq_length": ALPACA_LONGEST_LLAMA2,
        },
        impl=LITGPT_QLORA,
        legacy_bnb=True,
    ),
    Row(
        "R9b",
        RESOURCE,
        "Llama-2-7B QLoRA nf4-dq r8 q,v, bf16-true, 1×1304, 1×A100-40",
        "peak_allocated",
        13.84,
        "GB",
        "a100-sxm-40gb",
        {
            "model.name": LLAMA2_7B,
            **lit_lora(8, 16, QV, "nf4", double_quant=True),
            "train.micro_batch_size": 1,
            "data.max_seq_length": ALPACA_LONGEST_LLAMA2,
        },
        impl=LITGPT_QLORA,
        legacy_bnb=True,
    ),
    Row(
        "R10",
        RESOURCE,
        "Llama-2-13B LoRA r8 q,v, bf16-true, 1×1304, 1×A100-40",
        "peak_allocated",
        38.12,
        "GB",
        "a100-sxm-40gb",
        {
            "model.name": LLAMA2_13B,
            **lit_lora(8, 16, QV),
            "train.micro_batch_size": 1,
            "data.max_seq_length": ALPACA_LONGEST_LLAMA2,
        },
        impl=LITGPT_LORA,
    ),
    Row(
        "R11",
        RESOURCE,
        "Llama-2-13B QLoRA nf4 r8 q,v, bf16-true, 1×1304, 1×A100-40",
        "peak_allocated",
        23.14,
        "GB",
        "a100-sxm-40gb",
        {
            "model.name": LLAMA2_13B,
            **lit_lora(8, 16, QV, "nf4"),
            "train.micro_batch_size": 1,
            "data.max_seq_length": ALPACA_LONGEST_LLAMA2,
        },
        impl=LITGPT_QLORA,
        legacy_bnb=True,
    ),
    *[
        Row(
            f"R12{s}",
            RESOURCE,
            f"Llama-2-7B LoRA r8 q,v, bf16-true, {b}×1304, 2×A100-40 FSDP + act. ckpt",
            "peak_allocated",
            v,
            "GB",
            "a100-sxm-40gb",
            {
                "model.name": LLAMA2_7B,
                **lit_lora(8, 16, QV),
                "train.micro_batch_size": b,
                "data.max_seq_length": ALPACA_LONGEST_LLAMA2,
                "train.activation_checkpointing": True,
                "devices": 2,
                "strategy": "fsdp",
                **LIT_FSDP_ACCUMULATION(2, b),
            },
            gpus=2,
            strategy="fsdp",
            impl=LITGPT_LORA + "; " + LIT_FSDP1,
            fsdp1_units=True,
            note="multi-GPU lora.py: FSDP wrapping and checkpointing each Block (litgpt's devices>1 setup)",
        )
        for s, b, v in (("a", 1, 22.18), ("b", 2, 22.47), ("c", 4, 23.39))
    ],
    Row(
        "R13",
        RESOURCE,
        "Llama-2-13B LoRA r8 q,v, bf16-true, 1×1304, 4×A100-40 FSDP + act. ckpt",
        "peak_allocated",
        35.57,
        "GB",
        "a100-sxm-40gb",
        {
            "model.name": LLAMA2_13B,
            **lit_lora(8, 16, QV),
            "train.micro_batch_size": 1,
            "data.max_seq_length": ALPACA_LONGEST_LLAMA2,
            "train.activation_checkpointing": True,
            "devices": 4,
            "strategy": "fsdp",
            **LIT_FSDP_ACCUMULATION(4, 1),
        },
        gpus=4,
        strategy="fsdp",
        impl=LITGPT_LORA + "; " + LIT_FSDP1,
        fsdp1_units=True,
    ),
    # ---- litgpt config_hub/finetune/README.md (A10G 24GB, Alpaca2k max_seq_length 512) ----
    Row(
        "R22",
        HUB,
        "TinyLlama-1.1B full, bf16-true, AdamW, 4×512, 1×A10G",
        "peak_allocated",
        14.10,
        "GB",
        "a10g",
        {
            "model.name": TINYLLAMA,
            **LIT_FULL,
            "train.micro_batch_size": 4,
            "train.accumulate_grad_batches": 8,
            "data.max_seq_length": 512,
        },
        impl=LITGPT,
        note="config_hub tiny-llama/full.yaml: global_batch_size 32, micro_batch_size 4, 1 device: 8 micro-batches "
        "per step, so the gradients are alive through every later forward",
    ),
    Row(
        "R23",
        HUB,
        "TinyLlama-1.1B LoRA r32 all linear + head, bf16-true, 8×512, 1×A10G",
        "peak_allocated",
        13.50,
        "GB",
        "a10g",
        {
            "model.name": TINYLLAMA,
            **lit_lora(32, 16, LLAMA_ALL_AND_HEAD),
            "train.micro_batch_size": 8,
            "data.max_seq_length": 512,
        },
        impl=LITGPT_LORA,
    ),
    Row(
        "R24",
        HUB,
        "TinyLlama-1.1B QLoRA nf4 r32 all linear + head, bf16-true, 8×512, 1×A10G",
        "peak_allocated",
        16.24,
        "GB",
        "a10g",
        {
            "model.name": TINYLLAMA,
            **lit_lora(32, 16, LLAMA_ALL_AND_HEAD, "nf4"),
            "train.micro_batch_size": 8,
            "data.max_seq_length": 512,
        },
        impl=LITGPT_QLORA,
        legacy_bnb=True,
        note="tiny-llama/qlora.yaml (stored version): lora.yaml's adapters + quantize bnb.nf4",
    ),
    Row(
        "R25",
        HUB,
        "Llama-2-7B LoRA r32 q,v, bf16-true, 2×512, 1×A10G",
        "peak_allocated",
        19.77,
        "GB",
        "a10g",
        {"model.name": LLAMA2_7B, **lit_lora(32, 16, QV), "train.micro_batch_size": 2, "data.max_seq_length": 512},
        impl=LITGPT_LORA,
    ),
    Row(
        "R26",
        HUB,
        "Llama-2-7B QLoRA nf4 r32 q,v, bf16-true, 2×512, 1×A10G",
        "peak_allocated",
        13.68,
        "GB",
        "a10g",
        {
            "model.name": LLAMA2_7B,
            **lit_lora(32, 16, QV, "nf4"),
            "train.micro_batch_size": 2,
            "data.max_seq_length": 512,
        },
        impl=LITGPT_QLORA,
        legacy_bnb=True,
        note="assumed: qlora.yaml = lora.yaml + bnb.nf4 (as the stored tiny-llama pair)",
    ),
    Row(
        "R27",
        HUB,
        "Llama-2-7B full, bf16-true, AdamW, 4×512, 1×A10G",
        "fit",
        None,
        "-",
        "a10g",
        {"model.name": LLAMA2_7B, **LIT_FULL, "train.micro_batch_size": 4, "data.max_seq_length": 512},
        expect="oom",
        impl=LITGPT,
        note="table says 4xA10G; the README says all runs are single-GPU",
    ),
    Row(
        "R28",
        HUB,
        "Llama-3-8B LoRA r32 q,v, bf16-true, 1×512, 1×A10G",
        "peak_allocated",
        19.73,
        "GB",
        "a10g",
        {"model.name": LLAMA3_8B, **lit_lora(32, 16, QV), "train.micro_batch_size": 1, "data.max_seq_length": 512},
        impl=LITGPT_LORA,
        note="llama-3-8b/lora.yaml (stored version): r32 α16 q,v, mbs 1",
    ),
    Row(
        "R29",
        HUB,
        "Llama-3-8B QLoRA nf4 r32 q,v, bf16-true, 2×512, 1×A10G",
        "peak_allocated",
        17.41,
        "GB",
        "a10g",
        {
            "model.name": LLAMA3_8B,
            **lit_lora(32, 16, QV, "nf4"),
            "train.micro_batch_size": 2,
            "data.max_seq_length": 512,
        },
        impl=LITGPT_QLORA,
        legacy_bnb=True,
        note="assumed: qlora.yaml = lora.yaml + bnb.nf4, mbs 2 as the table",
    ),
    Row(
        "R30",
        HUB,
        "Llama-3.1-8B full, bf16-true, AdamW, 4×512, 1×A10G",
        "fit",
        None,
        "-",
        "a10g",
        {"model.name": LLAMA31_8B, **LIT_FULL, "train.micro_batch_size": 4, "data.max_seq_length": 512},
        expect="oom",
        impl=LITGPT,
    ),
    Row(
        "R31",
        HUB,
        "phi-2 full, bf16-true, AdamW, 4×512, 2×A10G FSDP + act. ckpt",
        "peak_allocated",
        14.44,
        "GB",
        "a10g",
        {
            "model.name": "microsoft/phi-2",
            **LIT_FULL,
            "train.micro_batch_size": 4,
            "data.max_seq_length": 512,
            "train.activation_checkpointing": True,
            "devices": 2,
            "strategy": "fsdp",
        },
        gpus=2,
        strategy="fsdp",
        impl=LITGPT + "; FSDP1 per Block",
        note="planned on the 2 devices of the stored phi-2/full.yaml (global "
        "batch 8 = 2 × 4: no accumulation). The table's GPU column names the machine (4xA10G; an older version "
        "1xA10G): its LoRA configs (devices 1) print the same memory on 1xA10G and 4xA10G, and 2.78 B × 8 bytes "
        "of states cannot fit one 24 GB card",
    ),
    Row(
        "R34a",
        HUB,
        "Mistral-7B LoRA r32 q,v, bf16-true, 2×512, 1×A10G",
        "peak_allocated",
        20.66,
        "GB",
        "a10g",
        {
            "model.name": "mistralai/Mistral-7B-v0.1",
            **lit_lora(32, 16, QV),
            "train.micro_batch_size": 2,
            "data.max_seq_length": 512,
        },
        impl=LITGPT_LORA,
        note="mistral-7b/lora.yaml (stored version)",
    ),
    Row(
        "R34b",
        HUB,
        "Mistral-7B QLoRA nf4 r32 q,v, bf16-true, 2×512, 1×A10G",
        "peak_allocated",
        14.29,
        "GB",
        "a10g",
        {
            "model.name": "mistralai/Mistral-7B-v0.1",
            **lit_lora(32, 16, QV, "nf4"),
            "train.micro_batch_size": 2,
            "data.max_seq_length": 512,
        },
        impl=LITGPT_QLORA,
        legacy_bnb=True,
        note="assumed: qlora.yaml = lora.yaml + bnb.nf4",
    ),
    # ---- torchtune README (current): bs 2, packed 2048, compile, GiB. Checkpointing is not in the table's
    # note; the 4090 rows must have it (the step without it is planned at 40-45 GiB), so they are planned so. ----
    *[
        Row(
            f"T{n}",
            TORCHTUNE,
            f"Llama-3.1-8B full, bf16, PagedAdamW8bit, 2×2048 packed, ckpt, 1×{g}",
            "reserved",
            v,
            "GiB",
            gpu,
            {
                "model.name": LLAMA31_8B,
                "precision": "bf16-true",
                "optim.name": "paged_adamw8bit",
                "train.micro_batch_size": 2,
                "data.max_seq_length": 2048,
                "train.activation_checkpointing": True,
                "optim.in_backward": True,
                **TT_CHUNKED_CE,
            },
            impl=TORCHTUNE_IMPL,
            note="optimizer_in_bwd=True in the config: optim.in_backward; "
            "paged optimizer state lives in CUDA managed memory, outside the "
            "allocator's counters (so outside max_memory_reserved) - planned likewise",
            speed=(tok, "tokens/s"),
        )
        for n, g, gpu, v, tok in ((8, "4090", "rtx-4090", 18.9, 1650),)
    ],
    *[
        Row(
            f"T{n}",
            TORCHTUNE,
            f"Llama-3.1-8B LoRA r8 q,v,o + MLP, bf16, AdamW, 2×2048 packed, ckpt, 1×{g}",
            "reserved",
            v,
            "GiB",
            gpu,
            {
                "model.name": LLAMA31_8B,
                "precision": "bf16-true",
                "optim.name": "adamw",
                "peft.method": "lora",
                "peft.r": 8,
                "peft.alpha": 16,
                "peft.dropout": 0.0,
                "peft.target_modules": TT_LORA,
                "peft.adapter_dtype": "bfloat16",
                "train.micro_batch_size": 2,
                "data.max_seq_length": 2048,
                "train.activation_checkpointing": True,
                **TT_CHUNKED_CE,
            },
            impl=TORCHTUNE_IMPL,
            note="config llama3_1/8B_lora_single_device (adapters, dropout 0 as recalled, not re-read)",
            speed=(tok, "tokens/s"),
        )
        for n, g, gpu, v, tok in ((10, "4090", "rtx-4090", 16.2, 3083),)
    ],
    Row(
        "T12",
        TORCHTUNE,
        "Llama-3.1-8B QLoRA nf4 r8 q,v,o + MLP, bf16, AdamW, 2×2048 packed, ckpt, 1×4090",
        "reserved",
        7.4,
        "GiB",
        "rtx-4090",
        {
            "model.name": LLAMA31_8B,
            "precision": "bf16-true",
            "optim.name": "adamw",
            "peft.method": "lora",
            "peft.r": 8,
            "peft.alpha": 16,
            "peft.dropout": 0.0,
            "peft.target_modules": TT_LORA,
            "peft.adapter_dtype": "bfloat16",
            "model.quantize": "nf4",
            "model.double_quant": True,
            "model.upcast_unquantized": False,
            "train.micro_batch_size": 2,
            "data.max_seq_length": 2048,
            "train.activation_checkpointing": True,
            **TT_CHUNKED_CE,
        },
        impl=TORCHTUNE_IMPL + "; torchao NF4 tensors, not bitsandbytes",
        speed=(2413, "tokens/s"),
    ),
    # ---- HF transformers perf docs: bert-large-uncased, seq 512, V100 16GB, nvidia-smi (MiB) ----
    *[
        Row(
            f"H{n}",
            HF_PERF,
            f"BERT-large classifier full, {prec_label}, {opt_label}, {b}×512 acc {acc}"
            + (", ckpt" if ckpt else "")
            + ", 1×V100-16",
            "device_used",
            v,
            "MiB",
            "v100-16gb",
            {
                **BERT,
                "precision": prec,
                "optim.name": opt,
                "train.micro_batch_size": b,
                "train.accumulate_grad_batches": acc,
                "train.activation_checkpointing": ckpt,
            },
            BERT_BASE,
            impl=HF_TRAINER,
            note=LEGACY_SOFTMAX_NOTE,
            speed=(sps, "samples/s"),
            legacy_softmax=True,
            keep_gradients=True,
            context_mib=HF_PERF_CONTEXT_MIB,
        )
        for n, b, acc, ckpt, prec, prec_label, opt, opt_label, v, sps in (
            (1, 4, 1, False, "32-true", "fp32", "adamw", "AdamW", 14949, 8.86),
            (2, 1, 4, False, "32-true", "fp32", "adamw", "AdamW", 8681, 7.75),
            (3, 1, 4, True, "32-true", "fp32", "adamw", "AdamW", 6775, 5.99),
            (4, 4, 1, False, "16-mixed", "fp16 amp", "adamw", "AdamW", 13939, 18.64),
            (5, 1, 4, True, "16-mixed", "fp16 amp", "adamw", "AdamW", 7275, 10.09),
            (8, 4, 1, False, "32-true", "fp32", "adam8bit", "Adam8bit", 13085, 9.15),
            (9, 1, 4, True, "16-mixed", "fp16 amp", "adam8bit", "Adam8bit", 5363, 10.35),
        )
    ],
    # ---- PEFT docs: Llama-2-70B LoRA under DeepSpeed ZeRO-3, 8×H100 80GB (TRL SFTTrainer) ----
    Row(
        "P5",
        PEFT_DS,
        "Llama-2-70B LoRA r8 all-linear, bf16, ZeRO-3, 8×2048 packed, ckpt, 8×H100-80",
        "device_used",
        64.0,
        "GiB",
        "h100-80gb",
        {
            "model.name": LLAMA2_70B,
            "precision": "bf16-mixed",
            "optim.name": "adamw",
            "peft.method": "lora",
            "peft.r": 8,
            "peft.alpha": 16,
            "peft.dropout": 0.1,
            "peft.target_modules": ["all-linear"],
            "train.micro_batch_size": 8,
            "train.accumulate_grad_batches": 4,
            "data.max_seq_length": 2048,
            "train.activation_checkpointing": True,
            "devices": 8,
            "strategy": "deepspeed_stage_3",
        },
        gpus=8,
        strategy="deepspeed_stage_3",
        impl="TRL SFTTrainer + flash-attn 2 + DeepSpeed ZeRO-3 (HF Trainer integration)",
        note="'64 GB (80%)' read off an nvidia-smi-style screenshot: 80% of an 80 GB H100 is 64 GiB, so read as "
        "GiB; LoRA dropout 0.1 as the doc's script (assumed)",
    ),
    # ---- issue #25: more of litgpt config_hub/finetune/README.md @03ffc551 (A10G 24GB, Alpaca2k max_seq_length
    # 512, bf16-true, torch AdamW betas 0.9/0.95, one device unless named; accumulation = global / micro batch).
    # Gemma: litgpt's GPT holds lm_head and wte as two parameters, never tied (litgpt/model.py; HF ties them), and
    # its bnb.nf4 quantizes that head too; planned with HF's tied head, so the LoRA rows lack ~1 GB (2B) and
    # ~1.8 GB (9B) of bf16 head the source held. ----
    *[
        Row(
            i,
            HUB,
            setup,
            "peak_allocated",
            v,
            "GB",
            "a10g",
            {
                "model.name": model,
                **lit_lora(r, 16, targets, quant),
                "peft.dropout": dropout,
                "train.micro_batch_size": mbs,
                "train.accumulate_grad_batches": acc,
                "data.max_seq_length": 512,
            },
            impl=LITGPT_QLORA if quant != "none" else LITGPT_LORA,
            legacy_bnb=quant != "none",
            note=HUB_YAML.format(yaml, commit) + f": r{r} α16 dropout {dropout}, every linear + head, "
            f"micro-batch {mbs}, global batch {mbs * acc}",
        )
        for i, setup, model, r, targets, quant, dropout, mbs, acc, v, yaml, commit in (
            (
                "R35a",
                "Gemma-2B LoRA r8 all linear + head, bf16-true, 2×512 acc 3, 1×A10G",
                "google/gemma-2b",
                8,
                LLAMA_ALL_AND_HEAD,
                "none",
                0.1,
                2,
                3,
                12.62,
                "gemma-2b/lora.yaml",
                "3352a7aa",
            ),
            (
                "R35b",
                "Gemma-2B QLoRA nf4 r16 all linear + head, bf16-true, 2×512 acc 3, 1×A10G",
                "google/gemma-2b",
                16,
                LLAMA_ALL_AND_HEAD,
                "nf4",
                0.1,
                2,
                3,
                11.58,
                "gemma-2b/qlora.yaml",
                "0077627d",
            ),
            (
                "R36a",
                "Gemma-2-9B QLoRA nf4 r16 all linear + head, bf16-true, 1×512 acc 6, 1×A10G",
                "google/gemma-2-9b",
                16,
                LLAMA_ALL_AND_HEAD,
                "nf4",
                0.1,
                1,
                6,
                20.92,
                "gemma2-9b/qlora.yaml",
                "3fae864c",
            ),
            (
                "R37a",
                "phi-2 LoRA r8 all linear + head, bf16-true, 4×512 acc 2, 1×A10G",
                "microsoft/phi-2",
                8,
                PHI2_ALL_AND_HEAD,
                "none",
                0.05,
                4,
                2,
                13.98,
                "phi-2/lora.yaml",
                "14db26be",
            ),
            (
                "R37b",
                "phi-2 QLoRA nf4 r8 all linear + head, bf16-true, 4×512 acc 2, 1×A10G",
                "microsoft/phi-2",
                8,
                PHI2_ALL_AND_HEAD,
                "nf4",
                0.05,
                4,
                2,
                14.27,
                "phi-2/qlora.yaml",
                "3352a7aa",
            ),
            (
                "R38a",
                "Phi-3-mini-4k LoRA r8 all linear + head, bf16-true, 4×512 acc 2, 1×A10G",
                "microsoft/Phi-3-mini-4k-instruct",
                8,
                PHI3_ALL_AND_HEAD,
                "none",
                0.05,
                4,
                2,
                19.75,
                "phi-3/lora.yaml",
                "6ec34633",
            ),
            (
                "R38b",
                "Phi-3-mini-4k QLoRA nf4 r8 all linear + head, bf16-true, 4×512 acc 2, 1×A10G",
                "microsoft/Phi-3-mini-4k-instruct",
                8,
                PHI3_ALL_AND_HEAD,
                "nf4",
                0.05,
                4,
                2,
                19.13,
                "phi-3/qlora.yaml",
                "6ec34633",
            ),
        )
    ],
    Row(
        "R36b",
        HUB,
        "Gemma-2-9B LoRA r16 all linear + head, bf16-true, 1×512 acc 6, 1×A10G",
        "fit",
        None,
        "-",
        "a10g",
        {
            "model.name": "google/gemma-2-9b",
            **lit_lora(16, 16, LLAMA_ALL_AND_HEAD),
            "peft.dropout": 0.1,
            "train.micro_batch_size": 1,
            "train.accumulate_grad_batches": 6,
            "data.max_seq_length": 512,
        },
        expect="oom",
        impl=LITGPT_LORA,
        note=HUB_YAML.format("gemma2-9b/lora.yaml", "524bbb9e") + "; the table reports OOM on 1xA10G",
    ),
    Row(
        "R35c",
        HUB,
        "Gemma-2B full, bf16-true, AdamW, 1×512 acc 4, 4×A10G FSDP + act. ckpt",
        "peak_allocated",
        17.43,
        "GB",
        "a10g",
        {
            "model.name": "google/gemma-2b",
            **LIT_FULL,
            "train.micro_batch_size": 1,
            "train.accumulate_grad_batches": 4,
            "data.max_seq_length": 512,
            "train.activation_checkpointing": True,
            "devices": 4,
            "strategy": "fsdp",
            "fsdp_grad_sync": "step",
        },
        gpus=4,
        strategy="fsdp",
        impl=LITGPT + "; FSDP1 per Block",
        note=HUB_YAML.format("gemma-2b/full.yaml", "0fe99f85") + ": devices 4, global batch 16, micro-batch 1, "
        "so 4 micro-batches per step under Fabric's no_backward_sync (unsharded gradients kept through the "
        "window: fsdp_grad_sync step); litgpt's multi-device full.py wraps and checkpoints each Block",
    ),
    # ---- fms-acceleration's reference benchmark: HF Trainer + PEFT, Mistral-7B, one A100 80GB ----
    *[
        Row(
            f"F{n}{suffix}",
            FMS,
            f"Mistral-7B {label}, bf16, AdamW, {b}×4096 packed, ckpt, 1×A100-80",
            metric,
            value,
            unit,
            "a100-80gb",
            {
                "model.name": "mistralai/Mistral-7B-v0.1",
                "precision": "bf16-true",
                "optim.name": "adamw",
                "train.micro_batch_size": b,
                "data.max_seq_length": 4096,
                "train.activation_checkpointing": True,
                **over,
            },
            impl=FMS_IMPL,
            note=FMS_NOTE,
            speed=(tok, "tokens/s") if metric == "peak_allocated" else None,
        )
        for n, label, b, over, alloc_b, smi_mib, tok in (
            (1, "full", 4, {}, 72434853376, 76045, 3013.697),
            (2, "full", 8, {}, 72435246592, 72725, 3090.877),
            (3, "LoRA r16 q,k,v,o", 4, FMS_LORA, 25653881344, 28071, 3319.225),
            (4, "LoRA r16 q,k,v,o", 8, FMS_LORA, 36643613184, 41407, 3352.459),
        )
        for suffix, metric, value, unit in (
            ("", "peak_allocated", alloc_b / 1e9, "GB"),
            (".smi", "device_used", float(smi_mib), "MiB"),
        )
    ],
]

# Published data points not planned, and why (ids as in the notes).
SKIPPED: dict[str, str] = {
    "R4, R5, R15-R18, R32, R33": "StableLM-Alpha 3B (GPT-NeoX) config not bundled",
    "R14": "LLaMA-Adapter is not a bigtune method",
    "R19": "bf16-mixed LoRA OOM on a GPU the doc does not name (fit/OOM needs the card)",
    "R20, R21": "old lit-gpt finetune_lora.md: the sequence length that decides the peak (prepare_alpaca's "
    "truncation at that commit) is not stated; 20.60 GB at mbs 4 vs 21.30 GB at mbs 1 × 1304 in R6 "
    "implies much shorter rows than the longest sample",
    "T1-T7": "older torchtune README: unit and counter not stated, whether the 2048 rows were packed or padded "
    "not stated, compile/checkpointing per config at that commit unknown, paged optimizer on a 24 GB "
    "card reported at 24.1 GB",
    "T9, T11": "torchtune README's A6000 rows (full 37.4 GiB, LoRA 30.3 GiB): the table states batch, packing "
    "and compile but not activation checkpointing, and on a 48 GB card both settings fit (planned 21.0 / 18.1 GiB "
    "with it, -44 / -40 %; 44.6 / 39.7 GiB without, +19 / +31 %), so the setup is not stated exactly; their "
    "4090 twins (T8, T10) are, since only the checkpointed step fits 24 GB. T11's 4699 tokens/s also needs "
    "about 100 % of the A6000's dense bf16 peak even without checkpointing",
    "T13": "70B full fine-tune with CPU offload and the optimizer fused into backward: not expressible",
    "T14": "Llama-3.1-70B config not bundled (FSDP2 + LoRA across 8 GPUs)",
    "T15": "Llama-3.1-405B config not bundled; QLoRA under FSDP is refused by bigtune",
    "T16-T20": "A100 runs capped with set_per_process_memory_fraction to stand in for the named card: their "
    "reserved depends on the cap (the allocator frees cached blocks near it), so not the uncapped "
    "reserved the planner predicts",
    "H6, H7": "Adafactor is not a bigtune optimizer",
    "P1-P3": "T0_3B and mt0-xxl are seq2seq LLMs (bigtune trains causal LMs and BLIP-2 only); bloomz-7b1 config "
    "not bundled; the 'GB' rows' batch shapes (short tweets padded per batch) are not stated",
    "P4": "model ambiguous (the doc's script names bart-large, the number matches T0_3B)",
    "P6": "QLoRA under ZeRO-3: bigtune refuses model.quantize with DeepSpeed",
    "B10": "qualitative (DDP per-GPU memory larger than single-GPU, FSDP smaller): no number or fit boundary",
    "lab 13B DeepSpeed": "torch/a100_llama13b_deepspeed.py: no recorded numbers",
    # issue #25 (sources searched for fixed-shape HF + PEFT measurements; ids continue the notes' R series)
    "R35-R38 siblings (config_hub falcon-7b, gemma-7b)": "falcon-7b and gemma-7b configs not bundled",
    "R39 (config_hub phi-3/full.yaml)": "17.01 GB on 1xA10G cannot be the stated setup: the stored yaml trains "
    "all 3.8 B weights on one device with AdamW under bf16-true, whose weights, gradients and two moments "
    "alone are ~30 GB",
    "R40 (config_hub llama-3.1-8b lora/qlora)": "the same numbers (19.73 / 17.41 GB), micro-batches and "
    "adapters as R28/R29 on an architecture of the same shapes: a duplicate, not new evidence",
    "R41 (config_hub gemma2-2b)": "the table's rows are placeholders (xxxxx), no number",
    "PEFT MetaMathQA": "huggingface/peft method_comparison/MetaMathQA results: reserved is read after each "
    "optimizer step and averaged over bucketed variable-length batches up to 768 tokens, and cuda_memory_max "
    "includes generation-time evaluation: no counter answers one stated batch shape",
    "PEFT DoRA optimization": "huggingface/peft docs developer_guides/lora.md (dora_finetuning.py on a 4090, "
    "batch 16, padded to max_length 512): only runtimes are published, no memory; the script's default model "
    "(huggyllama/llama-7b) is not bundled",
    "PEFT EuroPython 2024 slides": "BenjaminBossan/presentations 2024-07-11-europython: the memory tables are "
    "computed by its utils.py from parameter counts (weights + 3× trainable, no activations), not measured",
    "peft #1142": "huggingface/peft issue #1142 (Llama-2-7B LoRA, 8×1024, checkpointing reentrant vs not): "
    "the memory is shown only in chart images, no number to read",
    "peft #1469": "huggingface/peft issue #1469: bert-base-uncased and ESM models, configs not bundled",
    "unsloth context table": "unslothai/unsloth README (Llama 3.1 8B QLoRA r32, batch 1, padded to the "
    "length, max length per VRAM size for 'HF + FA2'): the baseline's checkpointing, optimizer and counter "
    "are not stated, and flash-attn 2 is not a bigtune attention; unsloth's own column uses its kernels",
    "universal-llm-trainer": "ljm565/universal-llm-trainer README (H100, batch 2 × 8192 'fully filled', "
    "checkpointing): the counter behind 'Peak Mem.' is not named, values are whole GiB, the note says both "
    "torch and HF checkpointing were tested without saying which row used which, and the configs' data "
    "(ai2_arc QA) is far shorter than 8192 tokens; the Phi-3 rows use the 128k model (not bundled)",
}


def row_recipe(row: Row, check: bool = True):
    """The row's bigtune Recipe (accelerator=cpu: the planner simulates on this machine). ``check`` runs the
    cross-field rules too, except those about this machine's hardware and installs (recipe.HOST_ONLY_RULES)."""
    from bigtune.recipe import RecipeError, gpu_plan_problems, load_recipe

    base = str(ROOT / row.recipe) if row.recipe else {}
    r = load_recipe(base, {**row.over, "accelerator": "cpu"}, check=False)
    if check:
        problems = gpu_plan_problems(r)
        if problems:
            raise RecipeError(problems, row.id)
    return r


def _keep_4bit_inputs() -> None:
    """Make the planner's 4-bit matmul also save its input, as bitsandbytes < 0.43.2 did (Row.legacy_bnb),
    and dequantize the weight into a temporary in every forward, as its MatMul4Bit did whatever the shape
    (``F.linear(A, dequantize_4bit(B, state).to(A.dtype).t(), bias)``; no fused 4-bit training kernel)."""
    import torch

    from bigtune.plan.step import quantized

    class Legacy4bitMatmul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias):
            ctx.save_for_backward(weight, x)
            return torch.nn.functional.linear(x, weight.clone(), bias)

        @staticmethod
        def backward(ctx, grad):
            weight, _ = ctx.saved_tensors
            return grad @ weight.clone(), None, None

    quantized._Fake4bitMatmul = Legacy4bitMatmul


def _keep_softmax_inputs() -> None:
    """Make F.softmax also save its input for backward, as PyTorch < 1.11 did (Row.legacy_softmax).

    A 16-bit input is saved as fp32: the 4.x BERT rows this serves added an fp32 extended mask to the fp16
    scores, so under AMP the tensor the old softmax held was fp32 (today's BERT hands it a 16-bit one)."""
    import torch

    functional = torch.nn.functional
    plain = functional.softmax

    class LegacySoftmax(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, dim, dtype):
            x = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
            y = plain(x, dim, dtype=dtype)
            ctx.save_for_backward(x, y)  # x is kept only to hold its memory, as the old autograd did
            ctx.dim = dim
            return y

        @staticmethod
        def backward(ctx, grad):
            x, y = ctx.saved_tensors
            return torch._softmax_backward_data(grad, y, ctx.dim, x.dtype), None, None

    def softmax(input, dim=None, _stacklevel=3, dtype=None):
        if torch.is_grad_enabled() and input.requires_grad:
            return LegacySoftmax.apply(input, dim, dtype)
        return plain(input, dim, _stacklevel, dtype)

    functional.softmax = softmax


def _keep_gradients() -> None:
    """Make every optimizer's zero_grad zero the gradients in place instead of freeing them
    (Row.keep_gradients): set_to_none=False, PyTorch's default before 2.0. The next backward then
    accumulates into the held gradients (AccumulateGrad adds each new gradient in place and frees it)."""
    import torch

    plain = torch.optim.Optimizer.zero_grad

    def zero_grad(self, set_to_none: bool = True) -> None:
        plain(self, set_to_none=False)

    torch.optim.Optimizer.zero_grad = zero_grad


def _lab_blip_inputs() -> None:
    """Make the planner's BLIP-2 micro-batches the lab script's (Row.lab_blip_inputs, LAB_BLIP_INPUTS_NOTE): input_ids
    the caption's tokens alone (no image_token_index among them), attention mask all ones, labels the input_ids;
    Flan-T5's decoder reads the labels shifted right, as T5 builds decoder_input_ids from them."""
    import torch

    from bigtune.plan.step import simulate

    plain = simulate._synthetic_batch

    def batch(recipe, cfg, family, b_size, padded, images=None):
        out = plain(recipe, cfg, family, b_size, padded, images)
        if family != "image-to-text" or getattr(cfg, "model_type", "") != "blip-2":
            return out
        g = torch.Generator().manual_seed(0)
        top = min(cfg.text_config.vocab_size, int(cfg.image_token_index))
        ids = torch.randint(3, top, (b_size, recipe.data.max_seq_length), generator=g)
        out.update(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids.clone())
        if "decoder_input_ids" in out:
            out["decoder_input_ids"] = torch.cat([torch.zeros(b_size, 1, dtype=torch.long), ids[:, :-1]], 1)
        return out

    simulate._synthetic_batch = batch


def _litgpt_gelu() -> None:
    """Make transformers' gelu_new (phi-1.5, phi-2) one fused tanh GELU, as litgpt's MLP calls it
    (``F.gelu(x, approximate="tanh")``, the same function): the written-out formula keeps its input,
    its cube and its tanh for backward, the fused kernel its input alone."""
    import torch
    from transformers import activations

    activations.NewGELUActivation.forward = lambda self, x: torch.nn.functional.gelu(x, approximate="tanh")


def _fsdp1_flat_streams() -> None:
    """Plan FSDP1's side-stream pools for one flat unit (rows with LAB_FSDP_IMPL): FSDP1 all-gathers into the
    padded unsharded flat parameter itself (FlatParamHandle.unshard, in its unshard stream), in use from the
    forward through the backward, so no all-gather buffer is left cached beside the peak as FSDP2's is; its
    sharded gradients are allocated in its post-backward stream as FSDP2's in its reduce-scatter stream."""
    import functools as ft

    from bigtune.plan import planner, sharding

    planner.side_stream_cache = ft.partial(sharding.side_stream_cache, gather_buffers=False)


@functools.lru_cache(maxsize=None)
def _ties_head(model_name: str) -> bool:
    """Whether transformers ties the model's output head to its input embeddings (one weight for both)."""
    from types import SimpleNamespace

    from bigtune.models.configs import resolve_config_name

    config = resolve_config_name(SimpleNamespace(name=model_name, family="causal-lm", trust_remote_code=False))
    return bool(getattr(config, "tie_word_embeddings", False))


def _litgpt_untied_head() -> None:
    """Make every model config untie the output head from the embeddings (Row.litgpt_emulations): the
    head becomes a weight of its own, as litgpt's GPT holds it."""
    from bigtune.models import configs

    plain = configs.text_model_of

    def text_model_of(config, family):
        built, mapping = plain(config, family)
        built.tie_word_embeddings = False
        return built, mapping

    configs.text_model_of = text_model_of


def _litgpt_nf4_head() -> None:
    """Make the 4-bit stand-in quantize the output head too (Row.litgpt_emulations), as Fabric's
    BitsandbytesPrecision replaces every nn.Linear; bitsandbytes loading in transformers keeps it 16-bit."""
    from bigtune.plan.step import quantized

    quantized.OUTPUT_HEADS = tuple(h for h in quantized.OUTPUT_HEADS if h != "lm_head")


def _litgpt_attention() -> None:
    """Make transformers repeat k and v to every query head before SDPA, as litgpt's attention does in
    training (Row.litgpt_emulations): its repeat_kv path, taken when grouped SDPA is not used."""
    from transformers.integrations import sdpa_attention

    sdpa_attention.use_gqa_in_sdpa = lambda *args, **kwargs: False


def _litgpt_full_loss() -> None:
    """Make the engine's loss litgpt's full fine-tune loss (Row.litgpt_emulations): the shifted logits
    copied by a reshape of their non-contiguous slice, then cross-entropy per 128 rows."""
    import torch

    from bigtune.core.stepmath import IGNORE_INDEX
    from bigtune.engine import loop

    def litgpt_loss_sum(logits, labels, shift=True, class_weights=None):
        rows = logits[..., :-1, :].reshape(-1, logits.size(-1))
        targets = labels[..., 1:].reshape(-1)
        parts = [
            torch.nn.functional.cross_entropy(x, t, ignore_index=IGNORE_INDEX, reduction="none")
            for x, t in zip(rows.split(128), targets.split(128))
        ]
        return torch.cat(parts).sum()

    loop.causal_lm_loss_sum = litgpt_loss_sum


def plan_row(row: Row, shortest: bool = False, length: Optional[int] = None) -> dict:
    """Plan one row with the real planner (``shortest``: at Row.shortest_over; ``length``: with that
    data.max_seq_length); returns Plan.to_dict() (bytes)."""
    from bigtune.core.gpus import find_gpu
    from bigtune.plan.base.target import Target
    from bigtune.plan.planner import plan

    if shortest:
        row = dataclasses.replace(row, over={**row.over, **row.shortest_over()})
    if length is not None:
        row = dataclasses.replace(row, over={**row.over, "data.max_seq_length": length})
    r = row_recipe(row, check=False)  # validated by tests/test_published.py; here only plan
    target = Target("cuda", find_gpu(row.gpu), row.gpus, row.strategy)
    emulated = (row.legacy_bnb, row.legacy_softmax, row.keep_gradients, row.lab_blip_inputs(), row.litgpt_emulations())
    if any(emulated) or LAB_FSDP_IMPL in row.impl or row.fsdp1_units:
        # The patches below change what a simulated step runs, which the simulation cache's key does not see.
        os.environ["BIGTUNE_SIM_CACHE"] = "off"
    if row.legacy_bnb:
        _keep_4bit_inputs()
    if row.legacy_softmax:
        _keep_softmax_inputs()
    if row.keep_gradients:
        _keep_gradients()
    if row.lab_blip_inputs():
        _lab_blip_inputs()
    if "litgpt-attention" in row.litgpt_emulations():
        _litgpt_attention()
    if "litgpt-gelu" in row.litgpt_emulations():
        _litgpt_gelu()
    if "litgpt-full-loss" in row.litgpt_emulations():
        _litgpt_full_loss()
    if "litgpt-untied-head" in row.litgpt_emulations():
        _litgpt_untied_head()
    if "litgpt-nf4-head" in row.litgpt_emulations():
        _litgpt_nf4_head()
    if LAB_FSDP_IMPL in row.impl:
        _fsdp1_flat_streams()
    if row.fsdp1_units:
        from bigtune.plan.layout import sharding

        sharding.fsdp_unit_grad_elements = lambda sim, trainable: sim.block_numel if trainable else 0
    return plan(r, target, workers=min(2, os.cpu_count() or 1)).to_dict()


def planned_gib(row: Row, p: dict) -> Optional[float]:
    """The planned quantity that matches the row's published counter, in GiB."""
    if row.metric == "peak_allocated":
        b = p["peak_allocated"]
    elif row.metric == "after_forward_allocated":
        b = p["phases"]["after_forward"]["allocated"]
    elif row.metric == "reserved":
        b = p["peak_reserved"]
    elif row.metric == "device_used" and row.context_mib is not None:
        b = p["peak_reserved"] + row.context_mib * 2**20  # reserved + the context the source measured
    elif row.metric == "device_used":
        b = p["peak_total"]  # reserved + the assumed CUDA context
    else:
        return None
    return None if b is None else b / GIB


# -- running ----------------------------------------------------------------------------------------------


def _plan_in_subprocess(row: Row, timeout_s: int, shortest: bool = False, length: Optional[int] = None) -> dict:
    """One plan in its own process: a hang or a crash is that row's result, and the time limit holds."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    try:
        p = subprocess.run(
            [
                sys.executable,
                __file__,
                "--plan-one",
                row.id,
                *(["--shortest"] if shortest else []),
                *(["--length", str(length)] if length is not None else []),
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s} s", "seconds": round(time.perf_counter() - t0, 1)}
    secs = round(time.perf_counter() - t0, 1)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {p.returncode}: " + " | ".join(tail)[:400], "seconds": secs}
    return {"plan": json.loads(lines[-1]), "seconds": secs}


_PEAK_FLOOR = re.compile(r"^time: [\d.e+-]+ TFLOP of matmuls and attention per device and step, ([\d.e+-]+) s at")


def peak_floor_s(notes: list[str]) -> Optional[float]:
    """The plan's dense-peak floor of the step (time.step_time's note): its matmul and attention FLOPs at the
    card's catalog peak, no efficiency; None where the plan has no step time."""
    for n in notes:
        m = _PEAK_FLOOR.match(n)
        if m:
            return float(m.group(1))
    return None


def longest_fitting(row: Row, timeout_s: int, plans: dict, key: str) -> Optional[int]:
    """For a row the stated setup leaves open (fits at the shortest batch, OOM at the cap): the longest length
    cap (data.max_seq_length) at which the plan still fits, by bisection between the two (memory grows with
    the length), so the row says which unpublished lengths would settle it. None where a plan failed."""
    lo = row.shortest_over()["data.max_seq_length"]
    hi = row_recipe(row, check=False).data.max_seq_length
    while hi - lo > 1:
        mid = (lo + hi) // 2
        k = f"{key}|length={mid}"
        if k not in plans:
            print(f"      {row.id} at data.max_seq_length={mid} ...", end=" ", flush=True)
            plans[k] = _plan_in_subprocess(row, timeout_s, length=mid)
            print(f"{plans[k]['seconds']} s" + (f" ERROR {plans[k]['error']}" if "error" in plans[k] else ""))
        if "error" in plans[k]:
            return None
        lo, hi = (mid, hi) if plans[k]["plan"]["fits"] else (lo, mid)
    return lo


def fit_outcome(expect: str, fits_at_cap: bool, fits_shortest: Optional[bool]) -> Optional[bool]:
    """Whether the plan agrees with a published fit/OOM outcome; None where the stated setup does not settle it.

    ``fits_shortest``: the verdict at the shortest batch the source admits (Row.shortest_over; None where the
    row's lengths are the run's). Memory grows with the length: a plan that fits at the cap fits every
    shorter run, and one that is OOM at the shortest is OOM at every longer one. A published fit is thus
    contradicted only by an OOM at the shortest, a published OOM only by a fit at the cap; where the two ends
    differ, the outcome depends on the lengths the source did not publish."""
    if fits_shortest is None or fits_at_cap == fits_shortest:
        return fits_at_cap == (expect == "fit")
    return None


def compare(row: Row, plan: Optional[dict], shortest: Optional[dict] = None) -> dict:
    """The row against its plan (and, for rows with Row.shortest_over, the plan at the shortest batch)."""
    out: dict[str, Any] = {**dataclasses.asdict(row), "published_gib": row.value_gib()}
    out["litgpt"] = row.litgpt_emulations()
    out["lab_blip_inputs"] = row.lab_blip_inputs()
    if plan is None:
        return out
    out["plan_fits"] = plan["fits"]
    out["plan_tight"] = plan.get("tight")  # within the planner's typical error of the FITS line
    out["plan_needed_gib"] = (plan["needed_total"] or plan["peak_total"]) / GIB
    out["plan_capacity_gib"] = plan["capacity"] / GIB if plan["capacity"] else None
    out["plan_peak_allocated_gib"] = plan["peak_allocated"] / GIB
    out["plan_reserved_gib"] = plan["peak_reserved"] / GIB if plan["peak_reserved"] is not None else None
    out["plan_after_forward"] = {
        k: v / GIB for k, v in plan["phases"].get("after_forward", {}).items() if isinstance(v, int)
    }
    out["plan_model_states_gib"] = {
        k: plan["phases"]["after_backward"].get(k, 0) / GIB
        for k in ("parameters", "gradients", "optimizer_device", "optimizer_cpu")
    }
    out["plan_notes"] = plan["notes"]
    out["plan_step_time_s"], out["plan_tokens_per_step"] = plan.get("step_time_s"), plan.get("tokens_per_step")
    if row.speed and plan.get("step_time_s"):
        value, unit = row.speed
        r = row_recipe(row, check=False)
        # the published rate as seconds per optimizer step of the planned batch
        per_step = plan["tokens_per_step"] if unit == "tokens/s" else r.train.micro_batch_size * r.accumulate * row.gpus
        out["published_step_s"] = per_step / value
        out["time_error_pct"] = 100 * (plan["step_time_s"] - out["published_step_s"]) / out["published_step_s"]
        floor = peak_floor_s(plan["notes"])
        if floor is not None:
            # The step's matmul and attention FLOPs at the card's dense peak over the published step: above
            # 100 % the published rate is faster than the card can multiply, so it was not the stated setup.
            out["plan_peak_floor_s"] = floor
            out["implied_peak_pct"] = 100 * floor / out["published_step_s"]
    if row.metric == "fit":
        fits_shortest = None
        if shortest is not None:
            fits_shortest = shortest["fits"] is True
            out["shortest_over"] = row.shortest_over()
            out["plan_fits_shortest"] = fits_shortest
            out["plan_needed_shortest_gib"] = (shortest["needed_total"] or shortest["peak_total"]) / GIB
        out["agree"] = fit_outcome(row.expect, plan["fits"] is True, fits_shortest)
    else:
        got = planned_gib(row, plan)
        out["planned_gib"] = got
        if got is not None and row.value_gib():
            out["error_pct"] = 100 * (got - row.value_gib()) / row.value_gib()
    return out


def print_table(results: list[dict]) -> None:
    print(
        f"\n{'id':<8} {'setup':<74} {'metric':<13} {'published':>16} {'GiB':>7} {'planned':>8} {'err %':>7} "
        f"{'time %':>7}  flag"
    )
    for x in results:
        short = {
            "peak_allocated": "peak alloc",
            "after_forward_allocated": "alloc mid",
            "reserved": "reserved",
            "device_used": "device used",
            "fit": "fit/OOM",
        }[x["metric"]]
        flag = ("impl" if x["impl"] else "") + (" legacy-softmax" if x.get("legacy_softmax") else "")
        flag += " kept-grads" if x.get("keep_gradients") else ""
        flag += " src-context" if x.get("context_mib") is not None else ""
        flag += " litgpt" if x.get("litgpt") else ""
        flag += " lab-blip-inputs" if x.get("lab_blip_inputs") else ""
        # the step-time error of rows with a published rate, beside the memory error (details: the time table)
        t_err = f"{x['time_error_pct']:>+7.1f}" if "time_error_pct" in x else f"{'':>7}"
        if "error" in x:
            print(f"{x['id']:<8} {x['setup'][:74]:<74} {short:<13} {'':>16} {'':>7} {'ERROR':>8}  {x['error'][:60]}")
            continue
        if x["metric"] == "fit":
            plan_v = "FITS" if x.get("plan_fits") else "OOM"
            mark = {True: "agree", False: "DISAGREE", None: "open"}[x.get("agree")] + (
                "~" if x.get("plan_tight") else ""
            )
            ends = ""
            if "plan_fits_shortest" in x:  # the verdict at the shortest batch the source admits
                short_v = "fits" if x["plan_fits_shortest"] else "OOM"
                ends = f"; {short_v} at the shortest, {x['plan_needed_shortest_gib']:.1f} GiB"
                if x.get("plan_fits_up_to_length"):
                    ends += f", up to {x['plan_fits_up_to_length']} tokens"
            print(
                f"{x['id']:<8} {x['setup'][:74]:<74} {short:<13} {x['expect'].upper():>16} {'':>7} {plan_v:>8} "
                f"{mark:>7} {t_err}  {flag} (needs {x['plan_needed_gib']:.1f} of {x['plan_capacity_gib']:.1f} GiB{ends})"
            )
            continue
        pub = f"{x['value']:g} {x['unit']}"
        print(
            f"{x['id']:<8} {x['setup'][:74]:<74} {short:<13} {pub:>16} {x['published_gib']:>7.2f} "
            f"{x['planned_gib']:>8.2f} {x['error_pct']:>+7.1f} {t_err}  {flag}"
        )
    legacy = [x["id"] for x in results if x.get("legacy_softmax")]
    if legacy:  # the emulation changes these rows' planned numbers: say so where they are read
        print(f"legacy-softmax ({', '.join(legacy)}): {LEGACY_SOFTMAX_NOTE}")
    blip = [x["id"] for x in results if x.get("lab_blip_inputs")]
    if blip:
        print(f"lab-blip-inputs ({', '.join(blip)}): {LAB_BLIP_INPUTS_NOTE}")
    lit = [x["id"] for x in results if x.get("litgpt")]
    if lit:
        full = [i for i in lit if "litgpt-full-loss" in next(x["litgpt"] for x in results if x["id"] == i)]
        print(
            f"litgpt ({len(lit)} rows): {LITGPT_ATTENTION_NOTE}, {LITGPT_GELU_NOTE}; "
            f"{', '.join(full)} also {LITGPT_FULL_LOSS_NOTE}"
        )
        for emulation, note in (
            ("litgpt-untied-head", LITGPT_UNTIED_HEAD_NOTE),
            ("litgpt-nf4-head", LITGPT_NF4_HEAD_NOTE),
        ):
            ids = [i for i in lit if emulation in next(x["litgpt"] for x in results if x["id"] == i)]
            if ids:
                print(f"{', '.join(ids)}: {note}")


def print_time_table(results: list[dict]) -> None:
    timed = [x for x in results if "time_error_pct" in x]
    if not timed:
        return
    print(
        f"\n{'id':<8} {'setup':<74} {'published':>18} {'s/step':>8} {'planned':>8} {'err %':>7} "
        f"{'floor s':>8} {'peak %':>7}"
    )
    for x in timed:
        pub = f"{x['speed'][0]:g} {x['speed'][1]}"
        floor = f"{x['plan_peak_floor_s']:>8.3f} {x['implied_peak_pct']:>7.0f}" if "implied_peak_pct" in x else ""
        beyond = "  faster than the card's dense peak: not the stated setup" if _beyond_peak(x) else ""
        print(
            f"{x['id']:<8} {x['setup'][:74]:<74} {pub:>18} {x['published_step_s']:>8.3f} "
            f"{x['plan_step_time_s']:>8.3f} {x['time_error_pct']:>+7.1f} {floor}{beyond}"
        )
    print(
        "floor s: the planned step's matmul and attention FLOPs at the card's dense peak (no efficiency); "
        "peak %: that floor over the published step, the share of the peak the published rate implies"
    )


def _beyond_peak(x: dict) -> bool:
    """A published rate faster than the step's FLOPs allow at the card's dense peak: not the stated setup,
    so not evidence about the time model (kept out of the step_time statistic, listed beside it)."""
    return x.get("implied_peak_pct", 0) > 100


def statistics_of(results: list[dict]) -> dict:
    """Median and worst absolute error, overall, per metric kind, and for rows without an implementation flag."""

    def stats(xs: list[dict]) -> Optional[dict]:
        errs = [abs(x["error_pct"]) for x in xs if "error_pct" in x]
        if not errs:
            return None
        worst = max((x for x in xs if "error_pct" in x), key=lambda x: abs(x["error_pct"]))
        return {
            "n": len(errs),
            "median_abs_pct": statistics.median(errs),
            "worst_abs_pct": abs(worst["error_pct"]),
            "worst_id": worst["id"],
            "mean_signed_pct": statistics.fmean(x["error_pct"] for x in xs if "error_pct" in x),
        }

    numeric = [x for x in results if x["metric"] != "fit"]
    out: dict[str, Any] = {
        "overall": stats(numeric),
        "same_engine_family": stats([x for x in numeric if not x["impl"]]),
    }
    for kind in ("peak_allocated", "after_forward_allocated", "reserved", "device_used"):
        out[kind] = stats([x for x in numeric if x["metric"] == kind])
    # Issue #25's check: reserved (torch.cuda.max_memory_reserved, or nvidia-smi = reserved + the context) where
    # the source ran a Hugging Face model in an eager loop (HF Trainer, TRL, PEFT's scripts; no torch.compile)
    out["hf_eager_reserved"] = stats(
        [x for x in numeric if x["metric"] in ("reserved", "device_used") and x.get("source") in HF_EAGER_SOURCES]
    )
    timed = [{**x, "error_pct": x["time_error_pct"]} for x in results if "time_error_pct" in x]
    out["step_time"] = stats([x for x in timed if not _beyond_peak(x)])
    fit = [x for x in results if x["metric"] == "fit" and x.get("agree") is not None]
    out["step_time_beyond_peak"] = [x["id"] for x in timed if _beyond_peak(x)]
    out["fit"] = {
        "agree": sum(x["agree"] for x in fit),
        "of": len(fit),
        "disagree": [x["id"] for x in fit if not x["agree"]],
        # the stated setup does not settle these: fits at the shortest batch the source admits, OOM at its cap
        "open": [x["id"] for x in results if x["metric"] == "fit" and "agree" in x and x["agree"] is None],
        # of those, the longest length cap at which the plan fits (longest_fitting)
        "open_fits_up_to_length": {
            x["id"]: x.get("plan_fits_up_to_length")
            for x in results
            if x["metric"] == "fit" and "agree" in x and x["agree"] is None
        },
        "tight": [x["id"] for x in fit if x.get("plan_tight")],
    }
    return out


def print_statistics(s: dict) -> None:
    print(
        "\nabsolute error of the planned vs the published quantity (like with like; step_time: the plan's "
        "roofline step vs the published rate, fixed-length rows only):"
    )
    for k, v in s.items():
        if k in ("fit", "step_time_beyond_peak") or v is None:
            continue
        print(
            f"  {k:<24} n={v['n']:<3} median {v['median_abs_pct']:5.1f} %  worst {v['worst_abs_pct']:5.1f} % "
            f"({v['worst_id']})  mean signed {v['mean_signed_pct']:+5.1f} %"
        )
    if s.get("step_time_beyond_peak"):
        print(
            f"  step_time leaves out {', '.join(s['step_time_beyond_peak'])}: their published rates are faster than "
            "the step's matmuls and attention at the card's dense peak (not the stated setup)"
        )
    f = s["fit"]
    up = f.get("open_fits_up_to_length") or {}
    print(
        f"fit/OOM: plan agrees with the source on {f['agree']} of {f['of']}"
        + (f" (disagree: {', '.join(f['disagree'])})" if f["disagree"] else "")
        + (
            "; open, settled by the unpublished lengths (fits at the shortest batch, OOM at the cap): "
            + ", ".join(
                i + (f" (fits while every batch's longest is ≤ {n} tokens)" if (n := up.get(i)) else "")
                for i in f["open"]
            )
            if f.get("open")
            else ""
        )
        + (f"; called tight by the plan (~): {', '.join(f['tight'])}" if f.get("tight") else "")
    )


def write_json(path: Path, doc: dict) -> None:
    """Atomic: a temp file in the same folder, then rename (a killed run never leaves half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", metavar="ID", help="plan only these rows (ids as in --list)")
    ap.add_argument("--list", action="store_true", help="print the rows and the skipped data points; plan nothing")
    ap.add_argument(
        "--json", metavar="OUT", help="write the results here (default bench/results/published-cpu-<date>.json)"
    )
    ap.add_argument("--timeout-s", type=int, default=300, help="time limit per plan (default 300)")
    ap.add_argument(
        "--refresh",
        metavar="FILE",
        help="re-read each row's citation, flags and notes from this table "
        "into an earlier result file (same ids and recipes; the planned numbers are kept), reprint, rewrite",
    )
    ap.add_argument(
        "--merge-into",
        metavar="FILE",
        help="with --only: the result is this earlier complete result file with the --only rows planned again "
        "(for rows whose setup changed; the file records both commands and dates)",
    )
    ap.add_argument("--plan-one", metavar="ID", help=argparse.SUPPRESS)  # the per-row subprocess
    ap.add_argument("--shortest", action="store_true", help=argparse.SUPPRESS)  # with --plan-one: Row.shortest_over
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)  # with --plan-one: data.max_seq_length
    args = ap.parse_args(argv)
    by_id = {r.id: r for r in ROWS}

    if args.plan_one:
        print(json.dumps(plan_row(by_id[args.plan_one], shortest=args.shortest, length=args.length)))
        return 0
    if args.list:
        for r in ROWS:
            pub = f"{r.value:g} {r.unit}" if r.value is not None else r.expect.upper()
            print(
                f"{r.id:<8} {r.metric:<24} {pub:>12}  {r.gpus}× {r.gpu:<14} {r.setup}" + ("  [impl]" if r.impl else "")
            )
        print("\nskipped:")
        for k, why in SKIPPED.items():
            print(f"  {k}: {why}")
        return 0

    if args.refresh:
        # Flags and notes are prose about the sources: editing them must not cost a re-plan. The recipe,
        # GPU and published value must be unchanged, or the stored planned numbers would answer another row.
        path = Path(args.refresh)
        doc = json.loads(path.read_text())
        for x in doc["rows"]:
            row = by_id[x["id"]]
            same = (
                row.plan_key()
                == Row(
                    **{
                        k: x[k]
                        for k in (
                            "id",
                            "source",
                            "setup",
                            "metric",
                            "value",
                            "unit",
                            "gpu",
                            "over",
                            "recipe",
                            "gpus",
                            "strategy",
                            "impl",
                        )
                    },
                    legacy_softmax=x.get("legacy_softmax", False),
                    keep_gradients=x.get("keep_gradients", False),
                ).plan_key()
                and row.value == x["value"]
                and row.metric == x["metric"]
            )
            if not same:
                raise SystemExit(f"{x['id']}: recipe, GPU or value changed since {path}; plan it again (--only)")
            x.update({k: v for k, v in dataclasses.asdict(row).items()})
        doc["statistics"] = statistics_of(doc["rows"])
        doc["skipped"] = SKIPPED
        write_json(path, doc)
        print_table(doc["rows"])
        print_time_table(doc["rows"])
        print_statistics(doc["statistics"])
        return 0
    unknown = [i for i in (args.only or []) if i not in by_id]
    if unknown:
        ap.error(f"unknown row id(s) {', '.join(unknown)}; see --list")
    rows = [by_id[i] for i in args.only] if args.only else ROWS
    earlier = None
    if args.merge_into:
        if not args.only:
            ap.error("--merge-into needs --only (the rows to plan again)")
        earlier = json.loads(Path(args.merge_into).read_text())
        if not earlier.get("complete") or {x["id"] for x in earlier["rows"]} != {r.id for r in ROWS}:
            ap.error(f"--merge-into {args.merge_into}: not a complete result of today's rows; run the whole table")
    date = datetime.date.today().isoformat()
    out_path = Path(args.json) if args.json else ROOT / "bench" / "results" / f"published-cpu-{date}.json"
    command = "python bench/published.py" + (" " + " ".join(sys.argv[1:]) if sys.argv[1:] else "")
    plans: dict[str, dict] = {}
    results: list[dict] = []
    t_all = time.perf_counter()
    for i, row in enumerate(rows, 1):
        key = row.plan_key()
        if key not in plans:
            print(f"[{i}/{len(rows)}] {row.id}: planning {row.setup} ...", end=" ", flush=True)
            plans[key] = _plan_in_subprocess(row, args.timeout_s)
            res = plans[key]
            print(f"{res['seconds']} s" + (f" ERROR {res['error']}" if "error" in res else ""), flush=True)
        res = plans[key]
        short = None
        # Only where the cap leaves the verdict open (OOM there: a fit at the cap fits every shorter run)
        if row.shortest_over() and res.get("plan") and res["plan"]["fits"] is not True:
            skey = key + "|shortest"
            if skey not in plans:
                print(f"      {row.id} at the shortest batch {row.shortest_over()} ...", end=" ", flush=True)
                plans[skey] = _plan_in_subprocess(row, args.timeout_s, shortest=True)
                print(
                    f"{plans[skey]['seconds']} s" + (f" ERROR {plans[skey]['error']}" if "error" in plans[skey] else "")
                )
            short = plans[skey]
        x = compare(row, res.get("plan"), short.get("plan") if short else None)
        if x.get("agree", False) is None:
            x["plan_fits_up_to_length"] = longest_fitting(row, args.timeout_s, plans, key)
        if "error" in res or (short and "error" in short):
            x["error"] = res.get("error") or short["error"]
        x["plan_seconds_wall"] = res["seconds"]
        results.append(x)
        # rewritten after every row, so an interrupted run keeps every finished row
        write_json(
            out_path,
            {
                "date": date,
                "command": command,
                "rows": results,
                "skipped": SKIPPED,
                "statistics": statistics_of(results),
                "complete": False,
                "units": "GiB unless stated; published values also in their own unit",
            },
        )
    if earlier is not None:  # the earlier rows, these planned again in their place
        new = {x["id"]: x for x in results}
        results = [new.get(x["id"], x) for x in earlier["rows"]]
        command = f"{earlier['command']} ({earlier['date']}), then {command} ({date}: {', '.join(sorted(new))})"
    stats = statistics_of(results)
    write_json(
        out_path,
        {
            "date": date,
            "command": command,
            "rows": results,
            "skipped": SKIPPED,
            "statistics": stats,
            "complete": True,
            "wall_s": round(time.perf_counter() - t_all, 1),
            "units": "GiB unless stated; published values also in their own unit",
        },
    )
    print_table(results)
    print_time_table(results)
    print_statistics(stats)
    print(
        "\nimpl = the source's implementation differs materially from bigtune's engine (see the row's impl in "
        "the JSON); skipped data points: --list"
    )
    print(f"wrote {out_path.relative_to(ROOT) if out_path.is_relative_to(ROOT) else out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
