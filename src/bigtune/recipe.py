"""The recipe: one typed, documented schema for every knob bigtune has.

A recipe is YAML (or a dict) shaped like the dataclasses below. Every field carries its doc in
``metadata["doc"]``; the CLI help, ``bigtune recipe --docs`` and docs/reference/recipe.md are generated from
them, so there is exactly one place to add a knob. Validation collects *every* problem before any
model is built and names the key, what is wrong and how to fix it.

The lab scripts' knob names map as follows (lab → recipe key):
model_name → model.name, lr → optim.lr, batch_size → train.micro_batch_size,
accumulate_grad_batches → train.accumulate_grad_batches, precision → precision, optim → optim.name,
act_ckpt → train.activation_checkpointing, max_epochs/max_steps/limit_train_batches → train.*,
devices/strategy → devices/strategy, num_workers → data.num_workers,
enable_checkpointing → checkpoint.enabled, num_train_samples → data.num_train_samples,
save_model → checkpoint.save_model.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

DEMO_RECIPE = Path(__file__).resolve().parent / "assets" / "demo.yaml"
PRECISIONS = ("32-true", "bf16-true", "bf16-mixed", "16-mixed", "16-true")
OPTIMIZERS = ("adamw", "sgd", "adam8bit", "adamw8bit", "paged_adamw8bit", "cpu_offload_adamw", "deepspeed_cpu_adam")
SCHEDULES = ("constant", "cosine", "linear")
DEEPSPEED_STRATEGIES = (
    "deepspeed_stage_2",
    "deepspeed_stage_2_offload",
    "deepspeed_stage_3",
    "deepspeed_stage_3_offload",
)
STRATEGIES = ("auto", "single", "ddp", "fsdp") + DEEPSPEED_STRATEGIES
LR_SCALINGS = ("none", "linear", "sqrt")
ACCELERATORS = ("auto", "cpu", "cuda")
DATA_FORMATS = ("auto", "alpaca", "text", "jsonl-text", "classification", "chat")
FAMILIES = ("causal-lm", "image-to-text", "sequence-classification")
BEST_METRICS = ("val_loss", "accuracy", "macro_f1")
TRACKING_BACKENDS = ("mlflow", "wandb", "tensorboard")


def _f(default: Any, doc: str, **kw: Any) -> Any:
    """A dataclass field with its documentation attached (the single source of truth).

    Bounds: ``min=`` is inclusive (the value may equal it), ``gt=`` exclusive (it must be above it).
    """
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"doc": doc, **kw})
    return field(default=default, metadata={"doc": doc, **kw})


@dataclass
class ModelConfig:
    name: str = _f(
        "tiny-llama",
        "Built-in preset (tiny-llama, tiny-opt, and one per decoder family: tiny-llama3, tiny-qwen2, tiny-qwen3, "
        "tiny-gemma2, tiny-gemma3, tiny-mistral, tiny-phi3, tiny-gpt-neox, tiny-stablelm, tiny-falcon, tiny-bloom, tiny-mixtral, "
        "tiny-qwen3-moe; image-to-text: tiny-blip2-opt, tiny-blip2-t5, tiny-qwen2-vl, tiny-qwen2.5-vl, tiny-llava, "
        "tiny-llava-next, tiny-paligemma, tiny-paligemma2, tiny-smolvlm; "
        "sequence-classification: tiny-bert), Hugging "
        "Face hub id, or local folder holding config.json + safetensors weights. "
        "Lab: model_name.",
    )
    family: Literal["causal-lm", "image-to-text", "sequence-classification"] = _f(
        "causal-lm",
        "Model family: causal-lm (AutoModelForCausalLM), image-to-text (AutoModelForImageTextToText, trained on "
        "image + caption pairs: BLIP-2, or Qwen2-VL / Qwen2.5-VL / LLaVA-1.5 / LLaVA-NeXT / PaliGemma (1, 2) / SmolVLM "
        "with the caption as "
        "the answer to data.prompt) or "
        "sequence-classification (AutoModelForSequenceClassification: BERT/DistilBERT/RoBERTa/Llama with a "
        "classification head, trained on text + label records).",
    )
    init: Literal["pretrained", "random"] = _f(
        "pretrained",
        "pretrained: load the weights. random: build the architecture from its config.json with random "
        "weights (benchmarks and planner validation need no download; bundled configs cover the lab's models).",
    )
    revision: Optional[str] = _f(None, "Hub revision (branch, tag or commit) when `name` is a hub id.")
    trust_remote_code: bool = _f(False, "Allow code shipped with a hub model to run. Off unless you trust it.")
    attn_implementation: Literal["sdpa", "eager"] = _f(
        "sdpa", "Attention kernel: sdpa (PyTorch scaled_dot_product_attention: flash/mem-efficient on CUDA) or eager."
    )
    tokenizer: Optional[str] = _f(None, "Tokenizer folder or hub id when it differs from `name`.")
    quantize: Literal["none", "nf4", "fp4", "int8"] = _f(
        "none",
        "Load the base weights quantized with bitsandbytes (nf4/fp4: 4-bit, QLoRA; int8: LLM.int8). Needs "
        "peft.method lora or dora: quantized weights cannot be trained directly. Lab: use_qlora.",
    )
    quant_backend: Literal["auto", "bitsandbytes", "torchao"] = _f(
        "auto",
        "Who stores 4-bit weights. bitsandbytes: Linear4bit (one device or DDP). torchao: NF4Tensor weights in the "
        "decoder blocks' linear layers, which FSDP2 shards (QLoRA across GPUs; model.quantize=nf4 only; pip "
        "install 'bigtune[torchao]'). auto: torchao with strategy=fsdp, else bitsandbytes.",
    )
    double_quant: bool = _f(True, "4-bit: also quantize the quantization constants (saves ~0.4 bit/parameter).")
    compute_dtype: Literal["auto", "bfloat16", "float16", "float32"] = _f(
        "auto", "4-bit: dtype the dequantized matmuls run in (auto: bfloat16 unless precision is 32-true or 16-*)."
    )
    upcast_unquantized: bool = _f(
        True,
        "Quantized base: cast the weights bitsandbytes leaves unquantized (embeddings, norms, output head) to "
        "fp32, as peft's prepare_model_for_kbit_training and the QLoRA paper do; hidden states then run in fp32 "
        "between the quantized matmuls. false keeps them in the precision's dtype: with bf16-true the hidden states "
        "stay 16-bit (less activation memory, flash attention), as litgpt and torchtune run QLoRA. No effect when "
        "the weights are already fp32 (32-true, *-mixed).",
    )
    freeze_vision: bool = _f(
        True,
        "image-to-text: freeze the vision encoder (no gradients, no optimizer state), as "
        "BLIP-2 fine-tuning usually does.",
    )
    freeze_qformer: bool = _f(
        False,
        "image-to-text: freeze the Q-Former and its query tokens (the language projection stays trainable); "
        "Qwen2-VL / Qwen2.5-VL: the patch merger that projects vision features into the language model; LLaVA / "
        "PaliGemma: the multi-modal projector.",
    )
    freeze_language_model: bool = _f(
        False,
        "image-to-text: freeze the language model (OPT / Flan-T5). With "
        "peft.method lora the whole base is frozen anyway and only adapters train.",
    )


@dataclass
class DataConfig:
    source: str = _f(
        "demo",
        "`demo` (bundled instruction set; with data.format chat the bundled food conversations; for "
        "model.family image-to-text the bundled food-photo caption set), a .json/.jsonl/.csv/.parquet/.txt "
        "file, a folder written by datasets' save_to_disk, or `hf:<dataset id>` (datasets.load_dataset; "
        "needs the hub).",
    )
    format: Literal["auto", "alpaca", "text", "jsonl-text", "classification", "chat"] = _f(
        "auto",
        "auto: chat if records have `messages` ([{role, content}]) or ShareGPT `conversations` ([{from, value}]), "
        "alpaca if records have instruction/output, plain text for .txt or a `text` column; "
        "classification (text_field + label_field per record) for model.family sequence-classification.",
    )
    chat_template: Optional[str] = _f(
        None,
        "chat: the template conversations are rendered with. null: the tokenizer's own (chat_template in the "
        "model's tokenizer_config.json or chat_template.jinja; the tiny presets carry Zephyr's). Or a built-in: "
        "chatml, qwen, llama-3, gemma, mistral, phi-3, zephyr; or a Jinja file in the Hugging Face chat-template "
        "dialect. The run's saved tokenizer keeps the template, so `generate --chat` uses the same one.",
    )
    train_on: Literal["assistant", "last_assistant", "all"] = _f(
        "assistant",
        "chat: which tokens carry the loss. assistant: every assistant turn (its text and the template's "
        "end-of-turn tokens); last_assistant: the final assistant turn only; all: every token, prompts included.",
    )
    split: str = _f("train", "Split to train on when the source holds several (DatasetDict).")
    text_field: str = _f("text", "Column holding raw text for the text format (image-to-text: the caption).")
    label_field: str = _f(
        "label",
        "classification: column holding each record's label (a name from label_names, or an integer index into them).",
    )
    label_names: list = _f(
        [],
        "classification: the class names, in index order ([] infers them from the training "
        "data: the sorted distinct labels). A label outside them is an error naming the record.",
    )
    class_weights: list = _f(
        [],
        "classification: one loss weight per class, in label_names order ([] = all 1); "
        "each sample's cross-entropy is multiplied by its class's weight (mean over samples).",
    )
    image_field: str = _f(
        "image",
        "image-to-text: column (save_to_disk / metadata / JSONL key) holding the image "
        "(a decoded image, bytes, or a path; metadata.jsonl/.csv image folders use `file_name`).",
    )
    prompt: str = _f(
        "Write alt text for this photo.",
        "image-to-text, chat vision-language models (Qwen2-VL, Qwen2.5-VL, LLaVA-1.5, LLaVA-NeXT, SmolVLM): the user's "
        "request beside "
        "the image; the caption is the assistant's answer and carries the loss. PaliGemma: the prefix after the "
        "image (e.g. 'caption en'; may be empty). `bigtune caption` asks the same. BLIP-2 captions without a prompt.",
    )
    image_max_pixels: Optional[int] = _f(
        None,
        "image-to-text: pixels per image at most, which bounds the image tokens (they drive memory). Qwen2-VL / "
        "Qwen2.5-VL: the processor's max_pixels (a larger image is scaled down to multiples of patch × merge "
        "pixels within it). SmolVLM / Idefics3: the longest edge images are resized to, floor(sqrt(N)) rounded down "
        "to the tile size (so at most that many tiles). `bigtune plan` takes it as the worst-case image. null: the "
        "processor's own. BLIP-2, LLaVA-1.5 and PaliGemma resize every image to one size, LLaVA-NeXT fits it into "
        "its image_grid_pinpoints: they refuse it.",
        min=1,
    )
    mask_prompt: bool = _f(True, "Alpaca: compute the loss on the response only (prompt tokens get label -100).")
    max_seq_length: int = _f(
        512,
        "Truncate every sample to this many tokens. image-to-text: caption tokens "
        "(BOS/EOS included); the model's num_query_tokens image tokens come on top. Qwen2-VL / Qwen2.5-VL: the "
        "conversation's text tokens (chat template, prompt, caption; the caption is cut), the image's tokens on top.",
        min=2,
    )
    num_train_samples: Optional[int] = _f(
        None, "Keep only this many samples after a seeded shuffle. Lab: num_train_samples.", min=1
    )
    num_workers: int = _f(0, "DataLoader worker processes. Lab: num_workers.", min=0)
    packing: bool = _f(
        False,
        "Concatenate samples into rows of up to max_seq_length tokens (seeded order), "
        "position ids restarting per sample so attention and the loss never cross samples; "
        "train.micro_batch_size then counts rows. Less padding, more tokens per step. Causal LMs only.",
    )
    group_by_length: bool = _f(
        False,
        "Put samples of similar length in the same micro-batch (sorted within "
        "seeded groups of 50 micro-batches): less padding without packing.",
    )
    val_fraction: float = _f(
        0.0,
        "Hold out this fraction of the samples (seeded) for validation; they never appear in training batches.",
        min=0.0,
    )
    val_source: Optional[str] = _f(
        None, "A separate validation source (same formats as `source`); overrides val_fraction."
    )
    sources: list = _f(
        [],
        "Several sources mixed in one run, instead of `source`: a list of {source, weight, format, split, "
        "text_field} (only `source` is required; the others default to weight 1 and this section's own keys). "
        "weight scales that source's share of each epoch: 3 repeats every sample 3 times, 0.5 keeps a seeded "
        "half. val_fraction is held out of each source before weighting, so every source is in validation. "
        "Causal LMs only.",
    )
    skip_bad_records: bool = _f(
        True,
        "Skip records with missing/empty fields (each one counted and reported by "
        "index). False makes the first bad record an error. Unparseable JSON is always an error.",
    )


@dataclass
class TrainConfig:
    micro_batch_size: int = _f(4, "Samples per forward/backward on one device. Lab: batch_size.", min=1)
    accumulate_grad_batches: int = _f(1, "Micro-batches per optimizer step. Lab: accumulate_grad_batches.", min=1)
    global_batch_size: Optional[int] = _f(
        None,
        "Samples per optimizer step over all devices; if set, accumulate_grad_batches is derived from it "
        "(must divide by micro_batch_size × devices).",
        min=1,
    )
    max_epochs: Optional[int] = _f(
        None,
        "Passes over the data. null: one pass, or as many as train.max_steps needs when that is set. When both "
        "are set, training stops at whichever comes first. Lab: max_epochs.",
        min=1,
    )
    max_steps: Optional[int] = _f(None, "Stop after this many optimizer steps. Lab: max_steps.", min=1)
    limit_train_batches: Optional[int] = _f(None, "Micro-batches per epoch at most. Lab: limit_train_batches.", min=1)
    activation_checkpointing: bool = _f(
        False, "Recompute each decoder layer's activations in backward (non-reentrant). Lab: act_ckpt."
    )
    compile: bool = _f(
        False,
        "torch.compile each repeated transformer block (the layers FSDP shards: decoder layers, BLIP-2's "
        "vision and Q-Former layers) in place, after activation checkpointing and adapters, before FSDP; "
        "embeddings, masks and the loss stay eager, so graph breaks there cost nothing. Works with activation "
        "checkpointing, LoRA/DoRA/QLoRA, DDP and FSDP; not with DeepSpeed. The first unmeasured step is slow while "
        "it compiles, and one more when the batch shape first changes (a shape-generic graph; eval compiles its "
        "own). Compiled dropout draws other random numbers than eager. Memory: on CUDA the allocator measures the "
        "compiled step. The CPU tracker cannot see inside compiled code, so on the CPU the measured steps (0, 1, "
        "every memory.every_steps) run eager: their table is the eager step's memory, exact, and their step time "
        "eager (memory.cap_gib, which measures every step, is refused). `bigtune plan` plans the eager step.",
    )
    log_every_steps: int = _f(1, "Print/write loss and throughput every N optimizer steps.", min=1)
    loss_chunk_tokens: Optional[int] = _f(
        None,
        "Compute the cross-entropy from the final hidden states this many tokens at a time, recomputing each "
        "chunk's logits in backward: the full tokens × vocab logits (and their fp32 copy) are never held, for one "
        "extra output-layer matmul. Same loss value. Applies to Llama/Mistral/Qwen2/OPT with a plain (no adapter) "
        "output layer, not under FSDP; elsewhere the plain loss is used. None: off.",
        min=1,
    )
    pipeline_microbatches: Optional[int] = _f(
        None,
        "pipeline_parallel > 1: the pipeline micro-batches each micro_batch_size batch is split into (it must "
        "divide train.micro_batch_size; 1f1b needs at least pipeline_parallel of them). None: micro_batch_size "
        "(one row each, the smallest bubble). Stages work on different pipeline micro-batches at once; more of them "
        "shrink the pipeline bubble ((stages - 1) / (pipeline_microbatches + stages - 1) of the step idle). "
        "Every schedule step sums the token losses of its pipeline micro-batches and divides by the target "
        "tokens of the whole optimizer step, as without pipelining.",
        min=1,
    )
    cuda_alloc_conf: str = _f(
        "",
        "PYTORCH_CUDA_ALLOC_CONF for the training process, set before CUDA starts, and the caching-allocator "
        "settings `bigtune plan` replays: e.g. 'expandable_segments:True' (one growing segment per pool, mapped "
        "in 2 MiB / 20 MiB pages: no slivers pinned in half-used segments) or 'max_split_size_mb:128' (cached "
        "blocks of that size or more are not split for smaller requests and are freed first near the capacity). "
        "Keys: expandable_segments (True/False), max_split_size_mb and max_non_split_rounding_mb (whole MiB, "
        ">= 20). garbage_collection_threshold is refused: PyTorch runs it only under a per-process memory "
        "fraction, which bigtune does not set. '': PyTorch's defaults (an inherited PYTORCH_CUDA_ALLOC_CONF is "
        "left alone, and not planned); a different PYTORCH_CUDA_ALLOC_CONF already in the environment is an error.",
    )


@dataclass
class OptimConfig:
    name: Literal[
        "adamw", "sgd", "adam8bit", "adamw8bit", "paged_adamw8bit", "cpu_offload_adamw", "deepspeed_cpu_adam"
    ] = _f(
        "adamw",
        "Optimizer. 8-bit ones keep state in 1 byte/element (bitsandbytes); paged ones page it to CPU RAM "
        "under pressure (CUDA); cpu_offload_adamw keeps fp32 master weights and moments in CPU RAM and steps there "
        "(deepspeed_cpu_adam: the same with DeepSpeed's vectorised CPU Adam). Lab: optim.",
    )
    lr: float = _f(3e-4, "Peak learning rate. Lab: lr.", min=0.0)
    weight_decay: float = _f(0.0, "Decoupled weight decay (AdamW) or L2 (SGD).", min=0.0)
    betas: list = _f([0.9, 0.999], "AdamW betas.")
    eps: float = _f(1e-8, "AdamW epsilon.", gt=0.0)  # it divides: 0 would let a zero second moment blow up
    momentum: float = _f(0.0, "SGD momentum (0 keeps no optimizer state).", min=0.0)
    implementation: Literal["auto", "foreach", "fused", "for-loop"] = _f(
        "auto",
        "PyTorch optimizer kernel: auto lets torch choose (foreach on CUDA); foreach costs a temporary "
        "copy of the parameters; fused needs CUDA.",
    )
    schedule: Literal["constant", "cosine", "linear"] = _f("constant", "LR decay after warmup.")
    warmup_steps: int = _f(0, "Linear warmup from 0 over this many optimizer steps.", min=0)
    min_lr_ratio: float = _f(0.0, "Cosine/linear decay floor as a fraction of lr.", min=0.0)
    grad_clip: Optional[float] = _f(None, "Clip the global gradient norm to this value (null: no clipping).", gt=0.0)
    zero_grad: Literal["after_step", "before_backward"] = _f(
        "after_step",
        "When the gradients are freed. after_step: right after the optimizer step, so the next "
        "forward runs without them (the lowest peak; Hugging Face Trainer, LitGPT and torchtune do the same). "
        "before_backward: PyTorch Lightning Trainer's order (the lab's scripts): the previous step's gradients stay "
        "alive through the next step's first forward and are freed just before its backward, which adds the "
        "gradient bytes to that forward's memory when accumulate_grad_batches is 1. Use it to compare with a "
        "Lightning Trainer's printouts; `bigtune plan` plans either. Not with DeepSpeed (ZeRO clears its own "
        "gradient buffers in its step).",
    )
    in_backward: bool = _f(
        False,
        "Step each weight from its own backward hook as soon as its gradient is complete, then free that "
        "gradient (torchtune's optimizer-in-backward): no full set of gradients ever exists, which saves their bytes "
        "(2 per trained weight in bf16) at the peak. Needs what can work one gradient at a time: one device, "
        "accumulate_grad_batches 1, no grad_clip, not the CPU-offloaded optimizers, not 16-mixed.",
    )
    lr_scaling: Literal["none", "linear", "sqrt"] = _f(
        "none",
        "Scale optim.lr with the data-parallel size N = devices × num_nodes, for a global batch that grows "
        "with the GPU count: linear uses lr × N (the lab's 'lr × 4' on 4 GPUs), sqrt lr × √N (often better for "
        "Adam), none keeps lr. The lr actually used is logged at start and in metrics.jsonl.",
    )


@dataclass
class PeftConfig:
    method: Literal["none", "lora", "dora"] = _f(
        "none",
        "Parameter-efficient fine-tuning with the peft library: train low-rank adapters, freeze the base. "
        "Lab: use_lora.",
    )
    r: int = _f(8, "Adapter rank. Lab: lora_r.", min=1)
    alpha: float = _f(16.0, "Adapter scaling numerator (scale = alpha / r). Lab: lora_alpha.", min=0.0)
    dropout: float = _f(0.05, "Dropout on the adapter input. Lab: lora_dropout.", min=0.0)
    target_modules: list = _f(
        ["auto"],
        "Modules that get adapters: [auto] (q_proj,v_proj for Llama/OPT; q,v for "
        "T5; BLIP-2: the language model's q_proj,v_proj (OPT) or q,v (Flan-T5) only), "
        "[all-linear], or names; a single string (all-linear, or one name) is a list of one.",
        one_as_list=True,
    )
    adapter_dtype: Literal["float32", "bfloat16"] = _f(
        "float32",
        "dtype of the adapter weights, and so of their gradients and AdamW state. float32 (PEFT's "
        "default) casts each adapted layer's input to fp32 for the adapter path (a copy per layer, kept for "
        "backward); bfloat16 keeps that path in bf16, as the QLoRA paper's script, LitGPT and torchtune do: "
        "less memory and time, but adapter updates smaller than bf16's resolution are lost. bfloat16 needs a "
        "bf16 precision (or a 4-bit base). Under DeepSpeed the adapters are 16-bit anyway: it casts the module.",
    )


@dataclass
class EvalConfig:
    every_steps: Optional[int] = _f(
        None,
        "Evaluate on the validation split every N optimizer steps (and always "
        "at the end when there is a validation split).",
        min=1,
    )
    max_batches: Optional[int] = _f(None, "Evaluate on at most this many batches (None: the whole split).", min=1)
    batch_size: Optional[int] = _f(None, "Eval batch size (default: train.micro_batch_size).", min=1)
    keep_best: bool = _f(True, "Save the model with the best validation `best_metric` to <output_dir>/best.")
    best_metric: Literal["val_loss", "accuracy", "macro_f1"] = _f(
        "val_loss",
        "What `keep_best` and summary.json's best step go by: val_loss (lowest) or, for "
        "sequence-classification, accuracy / macro_f1 on the validation split (highest).",
    )


@dataclass
class CheckpointConfig:
    enabled: bool = _f(False, "Save a resumable checkpoint (atomically). Lab: enable_checkpointing.")
    every_steps: Optional[int] = _f(None, "Checkpoint every N optimizer steps (and at the end when enabled).", min=1)
    keep_last: int = _f(2, "Keep this many newest checkpoints.", min=1)
    save_model: bool = _f(True, "Write the final model in Hugging Face format to <output_dir>/model. Lab: save_model.")


@dataclass
class MemoryConfig:
    enabled: bool = _f(
        True,
        "Take memory snapshots at four phases of a step (before/after forward, after backward, after optimizer step).",
    )
    every_steps: int = _f(50, "Snapshot at optimizer steps 0, 1 and every N.", min=1)
    plan: bool = _f(
        True,
        "Print `bigtune plan`'s prediction for this device before step 0, and measured vs "
        "predicted at the end (also in summary.json).",
    )
    cap_gib: Optional[float] = _f(
        None,
        "Treat the device as having only this much memory: on CUDA a per-process limit, on CPU the live-tensor "
        "tracker raises OOM above it (the tracker then runs every step). For what-if runs and tests.",
        gt=0.0,
    )
    oom_alternatives: bool = _f(
        True,
        "After an out-of-memory, list the variants the planner predicts to fit (planned in this process, "
        "the device still held: seconds for small models, minutes for a 12B BLIP-2 on a few cores). false skips "
        "it; `bigtune plan RECIPE --gpu NAME --alternatives` gives the same list later.",
    )


@dataclass
class TrackingConfig:
    backends: list = _f(
        [],
        "Experiment trackers the run is also logged to, any of: mlflow, wandb, tensorboard (`bigtune train --track "
        "NAME`, repeatable). Each gets the resolved recipe as parameters, the plan, every logged step's metrics, "
        "memory per category at each measured phase, plan vs measured, the status and the run folder's files. "
        "Rank 0 logs; a tracker that fails is warned about once and left off for the rest of the run, and the run "
        "folder's own files are written either way. Each needs its extra: pip install 'bigtune[mlflow]' (or wandb, "
        "tensorboard).",
        item_choices=TRACKING_BACKENDS,
    )
    mlflow_uri: Optional[str] = _f(
        None,
        "MLflow tracking URI (http://host:5000 for a server, sqlite:///mlflow.db, a folder). null: the "
        "MLFLOW_TRACKING_URI environment variable, else MLflow's own default (MLflow 3: sqlite:///mlflow.db and "
        "./mlruns for files, in the working folder, where `mlflow ui` finds them).",
    )
    experiment: Optional[str] = _f(
        None, "MLflow experiment (created when missing) and default W&B project. null: bigtune."
    )
    wandb_project: Optional[str] = _f(None, "W&B project. null: tracking.experiment, else bigtune.")
    wandb_mode: Optional[Literal["online", "offline"]] = _f(
        None,
        "W&B mode: online uploads as it goes, offline writes the run under WANDB_DIR for `wandb sync` later. "
        "null: W&B's own setting (WANDB_MODE, `wandb offline`), online by default.",
    )
    log_model: bool = _f(
        True,
        "Upload the trained model or adapter folder (checkpoint.save_model) to MLflow and W&B with the run's "
        "files. false: the reports only (a full model can be many GiB).",
    )
    register_model: Optional[str] = _f(
        None,
        "MLflow: register the trained model (or adapter) as a new version of this registered model when the "
        "run ends ok. Needs tracking.log_model and checkpoint.save_model.",
    )
    finish_timeout_s: float = _f(
        300.0,
        "How long the end of a run waits for the trackers to finish sending (uploads included). Past it the "
        "run ends anyway, with a warning; the run folder is complete either way.",
        gt=0.0,
    )


@dataclass
class Recipe:
    name: str = _f("demo", "Run name (used for the default output_dir).")
    model: ModelConfig = _f(None, "Which model to fine-tune.")
    data: DataConfig = _f(None, "What to train on.")
    train: TrainConfig = _f(None, "Batching, length of training, activation checkpointing.")
    optim: OptimConfig = _f(None, "Optimizer and learning-rate schedule.")
    peft: PeftConfig = _f(None, "LoRA / DoRA adapters (with model.quantize: QLoRA).")
    eval: EvalConfig = _f(None, "Validation during training.")
    checkpoint: CheckpointConfig = _f(None, "Checkpoints and the final model.")
    memory: MemoryConfig = _f(None, "Memory measurement.")
    tracking: TrackingConfig = _f(None, "Experiment tracking: MLflow, Weights & Biases, TensorBoard.")
    precision: Literal["32-true", "bf16-true", "bf16-mixed", "16-mixed", "16-true"] = _f(
        "32-true", "Numeric precision (Lightning Fabric names). Lab: precision."
    )
    accelerator: Literal["auto", "cpu", "cuda"] = _f("auto", "Device type; auto picks cuda when available.")
    devices: int = _f(
        1,
        "Devices (processes) per node; > 1 spawns one process per device unless already "
        "launched by torchrun or Slurm. Lab: devices.",
        min=1,
    )
    num_nodes: int = _f(1, "Nodes (machines) taking part; launch with torchrun or `bigtune launch slurm`.", min=1)
    strategy: Literal[
        "auto",
        "single",
        "ddp",
        "fsdp",
        "deepspeed_stage_2",
        "deepspeed_stage_2_offload",
        "deepspeed_stage_3",
        "deepspeed_stage_3_offload",
    ] = _f(
        "auto",
        "auto: single device, or DDP when devices × num_nodes > 1. ddp: replicated model, gradients "
        "all-reduced. fsdp: FSDP2 (fully_shard per decoder layer): parameters, gradients and optimizer state "
        "sharded across ranks. deepspeed_stage_2: DeepSpeed ZeRO-2 (optimizer state and gradients sharded); "
        "deepspeed_stage_3: ZeRO-3 (parameters too); *_offload: optimizer state (stage 3: also parameters) in "
        "CPU RAM, stepped by DeepSpeed's CPU Adam. DeepSpeed needs CUDA GPUs and pip install 'bigtune[deepspeed]'. "
        "Lab: strategy.",
    )
    tensor_parallel: int = _f(
        1,
        "Tensor parallelism (strategy=fsdp only): the number of ranks that split each decoder block's attention "
        "heads and MLP width (q/k/v/gate/up column-wise, o/down row-wise, from the model's base_model_tp_plan "
        "or Llama's names). The devices × num_nodes ranks form a mesh of (devices × num_nodes) / tensor_parallel "
        "data-parallel groups (FSDP2 over that dimension) × tensor_parallel; every rank of a tensor-parallel "
        "group reads the same micro-batches, so batch sizes and lr scaling count data-parallel ranks only. "
        "Embeddings, norms and the output layer stay whole on every rank of the group (full logits, the usual "
        "loss). 1: none.",
        min=1,
    )
    sequence_parallel: bool = _f(
        False,
        "Sequence parallelism (tensor_parallel > 1 only, Llama-style decoder blocks): between the split projections "
        "each rank of a tensor-parallel group holds 1/tensor_parallel of the sequence (the residual stream, the "
        "blocks' norms and the activations passed from block to block: s / tensor_parallel rows). Each block's "
        "attention and MLP input is all-gathered to the whole sequence and o_proj / down_proj reduce-scatter their "
        "outputs back to the rank's rows, the same bytes as plain tensor parallelism's two all-reduces. Embeddings, "
        "the final norm and the output layer stay whole (full logits, the usual loss). data.max_seq_length must be "
        "a multiple of tensor_parallel; batches are padded to one.",
    )
    pipeline_parallel: int = _f(
        1,
        "Pipeline parallelism: the number of stages the decoder stack is split into, one per rank (the embeddings "
        "on the first, the final norm, output layer and loss on the last; the layers split evenly). It must equal "
        "devices × num_nodes (no data parallelism beside it) with strategy auto or ddp; each rank holds and steps "
        "its stage only, every rank reads the same micro-batches, and each micro-batch is padded to "
        "data.max_seq_length (the stages exchange fixed-shape activations). Llama-architecture causal LMs, full "
        "fine-tuning. 1: none.",
        min=1,
    )
    pipeline_schedule: Literal["gpipe", "1f1b"] = _f(
        "1f1b",
        "pipeline_parallel > 1: the order of forwards and backwards (torch.distributed.pipelining). gpipe: every "
        "pipeline micro-batch's forward, then every backward, so a stage holds all their activations at once. "
        "1f1b: one forward, one backward after a warm-up, so stage i holds at most pipeline_parallel - i "
        "micro-batches' activations. The same bubble and the same losses.",
    )
    fsdp_sharding: Literal["full", "grad_op", "hybrid"] = _f(
        "full",
        "FSDP: full re-shards parameters after forward (least memory); grad_op keeps them gathered until "
        "backward (less communication); hybrid shards within a node and replicates across nodes.",
    )
    fsdp_cpu_offload: bool = _f(False, "FSDP: keep sharded parameters, gradients and optimizer state in CPU RAM.")
    fsdp_wrap: Literal["block", "none"] = _f(
        "block",
        "FSDP units. block: each decoder block is its own unit (gathered for its forward and backward, its "
        "gradients reduced as soon as they are done), then the root (embeddings, head). none: the root only, one "
        "flat unit, as Lightning's FSDPStrategy() without an auto_wrap_policy (the lab's FSDP runs): the whole "
        "model is gathered from the forward through the backward and every gradient exists unsharded before "
        "the one reduce-scatter, so it needs far more memory and hides no communication; `bigtune plan` shows "
        "how much.",
    )
    fsdp_grad_sync: Literal["micro_batch", "step"] = _f(
        "micro_batch",
        "FSDP with gradient accumulation: when gradients are reduce-scattered. micro_batch: after every "
        "micro-batch's backward, so each rank only ever keeps its shard (least memory). step: only after the "
        "window's last micro-batch, as Fabric's no_backward_sync and FSDP1's no_sync() do (litgpt's multi-GPU "
        "scripts): 1/accumulate of the gradient traffic, but every rank holds every trainable weight's unsharded "
        "gradient (fp32 under *-mixed) through the window; `bigtune plan` counts it.",
    )
    ddp_bucket_view: bool = _f(
        True,
        "DDP: each gradient is a view into the reducer's communication buckets, so the gradients are not "
        "held twice. false is PyTorch's and Lightning's default (DDPStrategy()): the buckets then hold a second "
        "copy of the gradients for the whole run (`bigtune plan` counts it). The lab's BLIP-2 DDP rung sets true.",
    )
    dist_timeout_s: int = _f(
        600,
        "Seconds a rank waits in a collective before giving up (torch.distributed "
        "init_process_group timeout), so a crashed or hung rank makes the others exit with an "
        "error instead of hanging forever.",
        min=10,
    )
    seed: int = _f(42, "Seeds data order, initialisation and dropout.")
    output_dir: Optional[str] = _f(None, "Run directory (default runs/<name>; a suffix is added if it exists).")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if dataclasses.is_dataclass(_SECTIONS.get(f.name)) or f.name in _SECTIONS:
                if getattr(self, f.name) is None:
                    setattr(self, f.name, _SECTIONS[f.name]())

    # -- derived values -------------------------------------------------------------------------
    @property
    def accumulate(self) -> int:
        """Micro-batches per optimizer step, derived from global_batch_size when that is set."""
        t = self.train
        if t.global_batch_size is not None:
            return max(1, t.global_batch_size // (t.micro_batch_size * self.data_parallel_size))
        return t.accumulate_grad_batches

    @property
    def pipeline_microbatches(self) -> int:
        """Pipeline micro-batches per micro-batch (train.pipeline_microbatches, default one row each)."""
        return self.train.pipeline_microbatches or self.train.micro_batch_size

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read different micro-batches: the world divided into tensor-parallel groups."""
        return max(1, self.world_size // (self.tensor_parallel * self.pipeline_parallel))

    @property
    def lr(self) -> float:
        """The peak lr actually used: optim.lr scaled by the data-parallel size per optim.lr_scaling."""
        n = self.data_parallel_size
        factor = {"none": 1.0, "linear": float(n), "sqrt": n**0.5}
        return self.optim.lr * factor[self.optim.lr_scaling]

    @property
    def global_batch_size(self) -> int:
        return self.train.micro_batch_size * self.accumulate * self.data_parallel_size

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "peft": PeftConfig,
    "eval": EvalConfig,
    "checkpoint": CheckpointConfig,
    "memory": MemoryConfig,
    "tracking": TrackingConfig,
}


class RecipeError(ValueError):
    """One or more problems in a recipe; ``problems`` holds one line each: key, problem, fix."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = problems
        self.source = source
        where = f" in {source}" if source else ""
        super().__init__(f"invalid recipe{where}:\n" + "\n".join(f"  - {p}" for p in problems))


# -- parsing --------------------------------------------------------------------------------------


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    # get_type_hints re-evaluates every string annotation on each call; the planner builds ~80 recipes
    # per `plan --alternatives`, so resolve each section class once.
    return typing.get_type_hints(cls)


def _field_type(cls: type, name: str) -> Any:
    return _type_hints(cls)[name]


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _describe(tp: Any) -> str:
    inner, optional = _unwrap_optional(tp)
    if typing.get_origin(inner) is Literal:
        s = "one of " + ", ".join(repr(a) for a in typing.get_args(inner))
    else:
        s = getattr(inner, "__name__", str(inner))
    return s + (" or null" if optional else "")


def _coerce(value: Any, tp: Any, key: str, meta: dict, problems: list[str]) -> Any:
    """Check/convert one leaf value; append a problem (and return the raw value) when it does not fit."""
    inner, optional = _unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        problems.append(f"{key}: must not be null; expected {_describe(tp)}")
        return value
    ok = True
    out = value
    if typing.get_origin(inner) is Literal:
        choices = typing.get_args(inner)
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append(f"{key}: {value!r} is not allowed; use one of {', '.join(map(str, choices))}{hint}")
            return value
    elif inner is bool:
        ok = isinstance(value, bool)
    elif inner is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif inner is float:
        if isinstance(value, str):
            # YAML 1.1 reads `1e-3` (no dot) as text; accept any string float() understands.
            try:
                value = out = float(value)
            except ValueError:
                pass
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        out = float(value) if ok else value
    elif inner is str:
        ok = isinstance(value, str)
    elif inner is list:
        if isinstance(value, str) and meta.get("one_as_list"):
            value = [value]  # `target_modules: all-linear` reads as PEFT's own string form does
        ok = isinstance(value, (list, tuple))
        out = list(value) if ok else value
        if ok and "item_choices" in meta:
            choices = meta["item_choices"]
            for item in out:
                if item not in choices:
                    close = difflib.get_close_matches(str(item), choices, n=1)
                    hint = f"; did you mean {close[0]!r}?" if close else ""
                    problems.append(f"{key}: {item!r} is not allowed; use any of {', '.join(choices)}{hint}")
            if any(item not in choices for item in out):
                return value
    if not ok:
        problems.append(f"{key}: got {value!r} ({type(value).__name__}); expected {_describe(tp)}")
        return value
    if isinstance(out, (int, float)):
        if "min" in meta and out < meta["min"]:
            problems.append(f"{key}: got {out!r}; must be ≥ {meta['min']:g}")
        elif "gt" in meta and out <= meta["gt"]:
            problems.append(f"{key}: got {out!r}; must be > {meta['gt']:g}")
    return out


def _build(cls: type, data: Any, prefix: str, problems: list[str]) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        problems.append(f"{prefix or 'recipe'}: expected a mapping of keys, got {type(data).__name__} {data!r}")
        return cls()
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            hint = f"; did you mean {prefix}{close[0]}?" if close else f"; valid keys: {', '.join(names)}"
            problems.append(f"{full}: unknown key{hint}")
            continue
        f = next(f for f in dataclasses.fields(cls) if f.name == key)
        if key in _SECTIONS and cls is Recipe:
            kwargs[key] = _build(_SECTIONS[key], value, f"{full}.", problems)
        else:
            kwargs[key] = _coerce(value, _field_type(cls, key), full, dict(f.metadata), problems)
    return cls(**kwargs)


def _set_path(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        nxt = node.get(p)
        if not isinstance(nxt, dict):
            nxt = {}
            node[p] = nxt
        node = nxt
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b=v`` → (``a.b``, YAML-parsed v). ``v`` keeps its string form when YAML cannot parse it."""
    if "=" not in text:
        raise RecipeError([f"override {text!r}: expected KEY=VALUE, e.g. train.micro_batch_size=8"])
    key, raw = text.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() != "" else None
    except yaml.YAMLError:
        value = raw
    # keep things like model names ("1e-3" is a float, but "open_llama_3b" stays text)
    return key, value


def load_recipe(
    source: str | Path | dict | Recipe | None = None,
    overrides: list[str] | dict[str, Any] | None = None,
    check: bool = True,
) -> Recipe:
    """Build and validate a Recipe from a YAML path, a dict or nothing (the built-in demo), plus overrides.

    Raises RecipeError listing every problem found. ``check=False`` checks keys, types and values only and
    leaves the cross-field rules (``check_combinations``) to the caller: a sweep records a rung that cannot
    run here (say, DeepSpeed missing) as a result instead of refusing the whole ladder.
    """
    if isinstance(source, Recipe):
        tree = source.to_dict()
        where = None
    elif isinstance(source, dict):
        tree = dict(source)
        where = None
    elif source is None:
        tree = yaml.safe_load(DEMO_RECIPE.read_text())
        where = "the built-in demo recipe"
    else:
        path = Path(source)
        where = str(path)
        if not path.is_file():
            hint = ""
            shipped = sorted(p.name for p in shipped_recipes())
            if shipped:
                close = difflib.get_close_matches(path.name, shipped, n=1)
                hint = f"; did you mean recipes/{close[0]}?" if close else f"; shipped recipes: {', '.join(shipped)}"
            raise RecipeError([f"recipe file {path} does not exist{hint}"])
        tree = _read_recipe_file(path)
        if "name" not in tree:
            tree["name"] = path.stem
    tree = _deepcopy(tree)
    problems: list[str] = []
    # Command-line overrides keep their text, so a problem with a value given there names `--set KEY=VALUE`
    # instead of blaming the recipe file (or the built-in demo) for it.
    given: dict[str, str] = {}
    if isinstance(overrides, dict):
        items = list(overrides.items())
    else:
        items = []
        for text in overrides or []:
            key, value = parse_override(text)
            items.append((key, value))
            given[key] = f"--set {text.strip()}"
    for key, value in items:
        _set_path(tree, key, value)
    recipe = _build(Recipe, tree, "", problems)
    if isinstance(recipe.train.cuda_alloc_conf, str):
        problems.extend(_check_cuda_alloc_conf(recipe.train.cuda_alloc_conf))
    if not problems and check:
        problems.extend(check_combinations(recipe))
    if problems:
        problems, from_command_line = _name_overrides(problems, given)
        raise RecipeError(problems, None if from_command_line else where)
    return recipe


def _read_recipe_file(path: Path) -> Any:
    """A recipe file's tree; a syntax error names the parser's line and column. ``.json`` recipes are read
    with the JSON parser: YAML reads JSON too, but points its errors elsewhere and words them as YAML."""
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json":
        try:
            tree = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as e:
            raise RecipeError(
                [f"{path} line {e.lineno} column {e.colno}: not valid JSON ({e.msg}); fix the syntax"]
            ) from None
    else:
        try:
            tree = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
            raise RecipeError([f"{path}{at}: not valid YAML ({getattr(e, 'problem', e)}); fix the syntax"]) from None
    if not isinstance(tree, dict):
        raise RecipeError([f"{path}: the top level must be a mapping of keys"])
    return tree


def _name_overrides(problems: list[str], given: dict[str, str]) -> tuple[list[str], bool]:
    """Each problem about a key given on the command line, with that ``--set`` appended; and whether every
    problem is one of those (the recipe itself is then not to blame)."""
    out, all_given = [], bool(problems)
    for problem in problems:
        head = problem.split(":", 1)[0]
        # the longest override that is this key or one of its parents (`data.sources` for `data.sources[1].x`)
        keys = [k for k in given if head == k or head.startswith((f"{k}.", f"{k}["))]
        if keys:
            out.append(f"{problem} (from {given[max(keys, key=len)]})")
        else:
            out.append(problem)
            all_given = False
    return out, all_given


def _deepcopy(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _deepcopy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_deepcopy(v) for v in tree]
    return tree


def resolve_accelerator(recipe: Recipe) -> str:
    if recipe.accelerator != "auto":
        return recipe.accelerator
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# check_combinations rules that only say *this machine* cannot run the recipe (no CUDA, no DeepSpeed, no
# bitsandbytes, CPU-only precision limits): a plan for a CUDA GPU made on a CPU machine skips them.
HOST_ONLY_RULES = (
    "precision: 16-mixed needs a CUDA GPU",
    "precision: 16-true on CPU",
    "optim.implementation: fused kernels need CUDA",
    "optim.name=paged_adamw8bit: paging",
    "DeepSpeed needs CUDA GPUs",
    "needs DeepSpeed: pip install",
    "needs bitsandbytes",
    "is not installed: pip install 'bigtune[",
)


def gpu_plan_problems(r: Recipe) -> list[str]:
    """check_combinations for a recipe planned for a CUDA GPU from this machine: every rule except those
    about this machine's own hardware and installs (HOST_ONLY_RULES)."""
    return [p for p in check_combinations(r) if not any(h in p for h in HOST_ONLY_RULES)]


def check_combinations(r: Recipe) -> list[str]:
    """Cross-field rules, each stated with its reason and fix. Runs before any model or data is loaded.

    Long because it is a flat list of independent rules, each a few lines with its own reason and fix;
    they are read (and added to) one at a time.
    """
    p: list[str] = []
    t = r.train
    if t.global_batch_size is not None:
        per = t.micro_batch_size * r.data_parallel_size
        if t.global_batch_size % per:
            p.append(
                f"train.global_batch_size: {t.global_batch_size} is not a multiple of micro_batch_size × devices "
                f"(data-parallel ranks) = {per}; pick a multiple, or set train.accumulate_grad_batches instead"
            )
        if "accumulate_grad_batches" in _explicit(t) and t.accumulate_grad_batches != r.accumulate:
            p.append("train.accumulate_grad_batches and train.global_batch_size disagree; set only one of them")
    if len(r.optim.betas) != 2 or not all(isinstance(b, (int, float)) for b in r.optim.betas):
        p.append(f"optim.betas: {r.optim.betas!r} must be two numbers, e.g. [0.9, 0.999]")
    if r.optim.zero_grad == "before_backward" and r.strategy in DEEPSPEED_STRATEGIES:
        p.append(
            f"optim.zero_grad=before_backward with strategy={r.strategy}: ZeRO clears its own gradient buffers "
            "in its step; use optim.zero_grad=after_step"
        )
    if r.optim.in_backward:
        why = "optim.in_backward steps each weight as soon as its gradient is complete"
        if r.world_size > 1 or r.strategy not in ("auto", "single"):
            p.append(
                f"{why}, before any gradient sync between devices: use devices=1 with strategy=single (or "
                f"auto), or optim.in_backward=false (devices={r.devices}, num_nodes={r.num_nodes}, "
                f"strategy={r.strategy})"
            )
        if r.accumulate > 1:
            p.append(
                f"{why}, so every micro-batch would step: set train.accumulate_grad_batches=1 (a larger "
                f"train.micro_batch_size keeps the batch) or optim.in_backward=false (accumulate is "
                f"{r.accumulate})"
            )
        if r.optim.grad_clip is not None:
            p.append(
                f"{why}: global-norm clipping needs all of them at once; set optim.grad_clip=null or "
                "optim.in_backward=false"
            )
        if r.optim.name in ("cpu_offload_adamw", "deepspeed_cpu_adam"):
            p.append(
                f"{why}, but optim.name={r.optim.name} copies all gradients to the CPU in one step; use "
                "adamw, adamw8bit or sgd with optim.in_backward"
            )
        if r.precision == "16-mixed":
            p.append(
                f"{why}, but 16-mixed's loss scaler must check every gradient for inf before any step; use "
                "bf16-mixed or bf16-true"
            )
    if r.optim.momentum and r.optim.name != "sgd":
        p.append("optim.momentum: only SGD uses momentum; remove it or set optim.name=sgd")
    world = r.devices * r.num_nodes
    if r.strategy == "single" and world > 1:
        p.append(f"strategy=single with {world} devices: use strategy=ddp or fsdp, or devices=1")
    p.extend(_check_quant_backend(r))
    p.extend(_check_tracking(r))
    if r.strategy == "fsdp" and r.optim.name in ("cpu_offload_adamw", "deepspeed_cpu_adam"):
        p.append("strategy=fsdp with an offloaded optimizer: use fsdp_cpu_offload=true with optim.name=adamw")
    if r.fsdp_sharding == "hybrid" and r.num_nodes == 1 and r.strategy == "fsdp":
        p.append("fsdp_sharding=hybrid needs num_nodes > 1 (it replicates across nodes); use full on one node")
    p.extend(check_tensor_parallel(r))
    p.extend(check_pipeline_parallel(r))
    accel = resolve_accelerator(r)
    p.extend(check_deepspeed(r, accel))
    if accel == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.append("accelerator: cuda was asked for but torch sees no CUDA device; use accelerator=cpu or auto")
    if accel == "cpu":
        if r.precision == "16-mixed":
            p.append(
                "precision: 16-mixed needs a CUDA GPU (on CPU Lightning silently switches to bf16-mixed); "
                "use bf16-mixed on CPU"
            )
        if r.precision == "16-true":
            p.append("precision: 16-true on CPU gives NaN losses with fp16 optimizer state; use bf16-true on CPU")
        if r.optim.implementation == "fused":
            p.append("optim.implementation: fused kernels need CUDA; use auto or foreach on CPU")
    if r.model.quantize != "none" and r.peft.method == "none":
        p.append(
            f"model.quantize={r.model.quantize}: quantized base weights cannot be trained; set peft.method=lora "
            "(QLoRA) or model.quantize=none"
        )
    if (
        r.peft.adapter_dtype == "bfloat16"
        and r.peft.method != "none"
        and not r.precision.startswith("bf16")
        and r.model.quantize not in ("nf4", "fp4")
    ):
        p.append(
            f"peft.adapter_dtype=bfloat16 with precision={r.precision}: the adapted layers' inputs are not bf16; "
            "use precision=bf16-true or bf16-mixed, or peft.adapter_dtype=float32"
        )
    needs_bnb = (r.model.quantize != "none" and quant_backend(r) == "bitsandbytes") or r.optim.name in (
        "adam8bit",
        "adamw8bit",
        "paged_adamw8bit",
    )
    if needs_bnb and not _installed("bitsandbytes"):
        what = f"model.quantize={r.model.quantize}" if r.model.quantize != "none" else f"optim.name={r.optim.name}"
        p.append(
            f"{what} needs bitsandbytes: pip install 'bigtune[bnb]' (or pip install bitsandbytes); or use "
            "optim.name=adamw / model.quantize=none"
        )
    if r.optim.name == "deepspeed_cpu_adam" and not _installed("deepspeed"):
        p.append(
            "optim.name=deepspeed_cpu_adam needs DeepSpeed: pip install 'bigtune[deepspeed]'; or use "
            "optim.name=cpu_offload_adamw (same placement, torch's CPU Adam)"
        )
    if accel == "cpu" and r.optim.name == "paged_adamw8bit":
        p.append(
            "optim.name=paged_adamw8bit: paging moves optimizer state between GPU and CPU memory, so it needs "
            "CUDA; use adamw8bit on CPU"
        )
    if r.memory.cap_gib is not None and r.memory.cap_gib <= 0:
        p.append("memory.cap_gib: must be positive")
    if not _is_preset(r.model.name) and _looks_local(r.model.name):
        path = Path(r.model.name).expanduser()
        if not path.is_dir():
            p.append(
                f"model.name: folder {path} does not exist; give a preset ({', '.join(preset_names())}), a hub id "
                "(org/name) or an existing folder"
            )
        elif not (path / "config.json").is_file():
            p.append(
                f"model.name: folder {path} has no config.json; point at a Hugging Face model folder "
                "(save_pretrained output)"
            )
    if not 0.0 <= r.data.val_fraction < 1.0:
        p.append(f"data.val_fraction: {r.data.val_fraction} must be in [0, 1), e.g. 0.1")
    if (
        r.data.val_source
        and not r.data.val_source.startswith("hf:")
        and not Path(r.data.val_source).expanduser().exists()
    ):
        p.append(f"data.val_source: {r.data.val_source} does not exist")
    if (r.data.packing or r.data.group_by_length) and r.model.family != "causal-lm":
        p.append("data.packing / data.group_by_length: only causal-lm models pack or group samples; turn them off")
    if r.data.packing and r.data.group_by_length:
        p.append("data.packing with data.group_by_length: packed rows are already full; set only one")
    if r.eval.every_steps and not (r.data.val_fraction or r.data.val_source):
        p.append("eval.every_steps: there is no validation split; set data.val_fraction (e.g. 0.1) or data.val_source")
    p.extend(_check_image_to_text(r))
    p.extend(_check_classification(r))
    p.extend(_check_compile(r, accel))
    src = r.data.source
    if src != "demo" and not src.startswith("hf:") and not Path(src).expanduser().exists():
        p.append(f"data.source: {src} does not exist; give a file or save_to_disk folder, `hf:<dataset id>` or `demo`")
    p.extend(check_sources(r))
    return p


# The keys of one data.sources entry; those other than source/weight default to data.<key>.
SOURCE_KEYS = ("source", "weight", "format", "split", "text_field")


def check_sources(r: Recipe) -> list[str]:
    """data.sources: each entry a mapping with an existing source and a positive weight, named by its index."""
    d = r.data
    if not d.sources:
        return []
    p: list[str] = []
    if r.model.family != "causal-lm":
        p.append(f"data.sources: mixing sources is for causal-lm models, not {r.model.family}; use data.source")
    if d.source != "demo":
        p.append("data.sources with data.source: give the file as one entry of data.sources and remove data.source")
    for i, entry in enumerate(d.sources):
        key = f"data.sources[{i}]"
        if not isinstance(entry, dict):
            p.append(f"{key}: got {entry!r}; expected a mapping such as {{source: a.jsonl, weight: 2}}")
            continue
        for k in entry:
            if k not in SOURCE_KEYS:
                close = difflib.get_close_matches(str(k), SOURCE_KEYS, n=1)
                hint = f"did you mean {close[0]}?" if close else "valid keys: " + ", ".join(SOURCE_KEYS)
                p.append(f"{key}.{k}: unknown key; {hint}")
        src = entry.get("source")
        if not isinstance(src, str) or not src:
            p.append(f"{key}.source: missing; give a file or save_to_disk folder, `hf:<dataset id>` or `demo`")
        elif src != "demo" and not src.startswith("hf:") and not Path(src).expanduser().exists():
            p.append(f"{key}.source: {src} does not exist; give a file or save_to_disk folder, `hf:<id>` or `demo`")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            p.append(f"{key}.weight: {weight!r} must be a number above 0, e.g. 1 (as is) or 3 (three times as often)")
        fmt = entry.get("format", d.format)
        if fmt not in DATA_FORMATS:
            p.append(f"{key}.format: {fmt!r} is not allowed; use one of {', '.join(DATA_FORMATS)}")
        for k in ("split", "text_field"):
            if k in entry and not isinstance(entry[k], str):
                p.append(f"{key}.{k}: got {entry[k]!r}; expected text")
    return p


def check_tensor_parallel(r: Recipe) -> list[str]:
    """tensor_parallel > 1: the mesh must factor, and the strategy and features must be ones the tensor-parallel
    path applies (strategy=fsdp's 2-D mesh). The model's head counts and widths are checked when it is built."""
    tp = r.tensor_parallel
    if tp == 1:
        if r.sequence_parallel:
            return [
                "sequence_parallel=true needs tensor_parallel > 1 (it splits the sequence across a tensor-parallel "
                "group); set tensor_parallel (with strategy=fsdp) or sequence_parallel=false"
            ]
        return []
    p: list[str] = []
    if r.sequence_parallel and r.data.max_seq_length % tp:
        p.append(
            f"sequence_parallel=true: data.max_seq_length={r.data.max_seq_length} is not a multiple of "
            f"tensor_parallel={tp} (each rank holds an equal share of the sequence); pick a multiple of {tp}"
        )
    if r.world_size % tp:
        p.append(
            f"tensor_parallel: {tp} does not divide devices × num_nodes = {r.world_size}; pick a divisor "
            f"(tensor_parallel = devices × num_nodes means tensor parallelism only, no data parallelism)"
        )
    if r.strategy != "fsdp":
        p.append(
            f"tensor_parallel={tp} with strategy={r.strategy}: tensor parallelism runs on FSDP2's 2-D mesh "
            "(data parallel × tensor parallel); set strategy=fsdp"
        )
    unsupported = {  # key: (its value, supported, why not)
        "model.quantize": (r.model.quantize, r.model.quantize == "none", "4-bit weights cannot be split into DTensors"),
        "peft.method": (
            r.peft.method,
            r.peft.method == "none",
            "adapters wrap the projections tensor parallelism splits",
        ),
        "model.family": (r.model.family, r.model.family == "causal-lm", "only decoder-only causal LMs have a plan"),
        "fsdp_wrap": (r.fsdp_wrap, r.fsdp_wrap == "block", "the tensor-parallel plan is applied per decoder block"),
        "fsdp_sharding": (r.fsdp_sharding, r.fsdp_sharding != "hybrid", "hybrid would need a third mesh dimension"),
        "fsdp_cpu_offload": (r.fsdp_cpu_offload, not r.fsdp_cpu_offload, "not tested with tensor-parallel DTensors"),
        "train.compile": (r.train.compile, not r.train.compile, "not tested with tensor-parallel DTensors"),
        "train.loss_chunk_tokens": (r.train.loss_chunk_tokens, not r.train.loss_chunk_tokens, "not tested with it"),
    }
    for key, (value, ok, reason) in unsupported.items():
        if not ok:
            p.append(f"tensor_parallel={tp} with {key}={value}: not supported ({reason}); use tensor_parallel=1")
    return p


def check_pipeline_parallel(r: Recipe) -> list[str]:
    """pipeline_parallel > 1: one stage per rank, and only the features the stage split applies. The model's
    architecture and layer count are checked when it is built."""
    pp = r.pipeline_parallel
    if pp == 1:
        return []
    p: list[str] = []
    if r.world_size != pp:
        p.append(
            f"pipeline_parallel: {pp} stages need devices × num_nodes = {pp} ranks (one stage each; pipeline "
            f"parallelism beside data parallelism is not supported), but devices × num_nodes = {r.world_size}; "
            f"set devices={pp} (num_nodes=1) or pipeline_parallel={r.world_size}"
        )
    m = r.pipeline_microbatches
    if r.train.micro_batch_size % m:
        p.append(
            f"train.pipeline_microbatches: {m} does not divide train.micro_batch_size="
            f"{r.train.micro_batch_size}; each micro-batch is split into equal pipeline micro-batches, pick a divisor"
        )
    if r.pipeline_schedule == "1f1b" and m < pp:
        p.append(
            f"train.pipeline_microbatches: pipeline_schedule=1f1b needs at least pipeline_parallel={pp} pipeline "
            f"micro-batches, got {m}; raise train.pipeline_microbatches (and train.micro_batch_size, which it "
            "divides) or use pipeline_schedule=gpipe"
        )
    unsupported = {  # key: (its value, supported, why not)
        "strategy": (r.strategy, r.strategy in ("auto", "ddp"), "each rank holds its own stage; set strategy=auto"),
        "tensor_parallel": (r.tensor_parallel, r.tensor_parallel == 1, "2-D pipeline × tensor parallel is not built"),
        "model.family": (r.model.family, r.model.family == "causal-lm", "only decoder-only causal LMs are split"),
        "model.quantize": (r.model.quantize, r.model.quantize == "none", "stages train full weights only"),
        "peft.method": (r.peft.method, r.peft.method == "none", "stages train full weights only"),
        "train.compile": (r.train.compile, not r.train.compile, "not tested with pipeline stages"),
        "train.loss_chunk_tokens": (
            r.train.loss_chunk_tokens,
            not r.train.loss_chunk_tokens,
            "the last stage computes the plain loss",
        ),
        "data.packing": (r.data.packing, not r.data.packing, "packed rows need position ids the stages do not pass"),
        "precision": (r.precision, r.precision != "16-mixed", "the schedule's backward bypasses the loss scaler"),
        "optim.in_backward": (r.optim.in_backward, not r.optim.in_backward, "the schedule runs the backward"),
        "optim.zero_grad": (
            r.optim.zero_grad,
            r.optim.zero_grad == "after_step",
            "forwards and backwards interleave within a schedule step",
        ),
        "data.val_fraction": (r.data.val_fraction, not r.data.val_fraction, "evaluation is not pipelined"),
        "data.val_source": (r.data.val_source, not r.data.val_source, "evaluation is not pipelined"),
    }
    for key, (value, ok, reason) in unsupported.items():
        if not ok:
            p.append(f"pipeline_parallel={pp} with {key}={value}: not supported ({reason}); use pipeline_parallel=1")
    return p


def check_deepspeed(r: Recipe, accel: str) -> list[str]:
    """Rules for the deepspeed_* strategies (also used by `bigtune launch slurm`, which validates off-GPU)."""
    if r.strategy not in DEEPSPEED_STRATEGIES:
        return []
    s = r.strategy
    p: list[str] = []
    if accel == "cpu":
        p.append(
            f"strategy={s}: DeepSpeed needs CUDA GPUs (Lightning's DeepSpeedStrategy refuses the CPU), but "
            "accelerator resolves to cpu; run on GPUs with accelerator=cuda (or auto), or use strategy=fsdp "
            "(with fsdp_cpu_offload=true for ZeRO-Offload-like memory) on CPU"
        )
    if not _installed("deepspeed"):
        p.append(
            f"strategy={s} needs DeepSpeed: pip install 'bigtune[deepspeed]' (or pip install deepspeed); or use "
            "strategy=fsdp"
        )
    if r.model.quantize != "none" and not (s.startswith("deepspeed_stage_3") and r.model.quantize in ("nf4", "fp4")):
        p.append(
            f"strategy={s} with model.quantize={r.model.quantize}: only ZeRO-3 partitions a quantized base (4-bit "
            "nf4/fp4, its packed bytes stored as 16-bit elements); use strategy=deepspeed_stage_3 (or _offload) "
            "with nf4, strategy=fsdp (torchao NF4), or strategy=ddp"
        )
    if r.optim.name not in ("adamw", "sgd"):
        p.append(
            f"strategy={s} with optim.name={r.optim.name}: ZeRO partitions and steps the optimizer itself; use "
            "optim.name=adamw (the *_offload strategies step it on the CPU with DeepSpeed's CPU Adam)"
        )
    elif s.endswith("_offload") and r.optim.name != "adamw":
        p.append(
            f"strategy={s}: offloaded ZeRO steps with DeepSpeed's CPU Adam; use optim.name=adamw, or "
            f"strategy={s.removesuffix('_offload')} for SGD"
        )
    if r.optim.implementation == "fused" and s.endswith("_offload"):
        p.append(f"optim.implementation=fused: strategy={s} steps on the CPU; use optim.implementation=auto")
    if r.fsdp_cpu_offload or r.fsdp_sharding != "full" or r.fsdp_wrap != "block" or r.fsdp_grad_sync != "micro_batch":
        p.append(
            f"fsdp_cpu_offload / fsdp_sharding / fsdp_wrap / fsdp_grad_sync apply to strategy=fsdp only; with "
            f"DeepSpeed pick the offload "
            f"through the strategy name (e.g. {s.removesuffix('_offload')}_offload) and remove the fsdp_* keys"
        )
    return p


def _check_image_to_text(r: Recipe) -> list[str]:
    p: list[str] = []
    m = r.model
    preset_family = _preset_family(m.name)
    if preset_family is not None and preset_family != m.family:
        p.append(f"model.family: {m.name} is a {preset_family} preset; set model.family={preset_family}")
    if m.family != "image-to-text":
        if not m.freeze_vision or m.freeze_qformer or m.freeze_language_model:
            p.append(
                "model.freeze_*: only image-to-text models have vision / Q-Former / language-model parts; remove "
                "them or set model.family=image-to-text"
            )
        if r.data.image_max_pixels is not None:
            p.append("data.image_max_pixels: only image-to-text models read images; remove it")
        return p
    if m.freeze_vision and m.freeze_qformer and m.freeze_language_model and r.peft.method == "none":
        p.append(
            "model.freeze_*: vision, Q-Former and language model are all frozen, so only the language "
            "projection would train; unfreeze one, or use peft.method=lora"
        )
    if r.data.format not in ("auto", "jsonl-text"):
        p.append(f"data.format={r.data.format}: image-to-text reads image + caption records; use data.format=auto")
    if r.data.source.startswith("hf:"):
        p.append(
            "data.source: hf:<id> is not supported for image-to-text yet; save it with save_to_disk and give the folder"
        )
    src = Path(r.data.source).expanduser()
    if r.data.source != "demo" and src.is_file() and src.suffix.lower() not in (".jsonl", ".json"):
        p.append(
            f"data.source: {src} is not an image source; image-to-text needs a save_to_disk folder, an image "
            "folder with metadata.jsonl/metadata.csv, a JSONL of {image, text} records, or `demo`"
        )
    if (
        r.data.val_source
        and Path(r.data.val_source).expanduser().is_file()
        and Path(r.data.val_source).suffix.lower() not in (".jsonl", ".json")
    ):
        p.append("data.val_source: image-to-text needs an image source (save_to_disk folder, image folder, JSONL)")
    return p


def _check_classification(r: Recipe) -> list[str]:
    p: list[str] = []
    d, classify = r.data, r.model.family == "sequence-classification"
    if classify and d.format not in ("auto", "classification"):
        p.append(
            f"data.format={d.format}: sequence-classification trains on text + label records; use "
            "data.format=auto or classification"
        )
    if not classify:
        if d.format == "classification":
            p.append("data.format=classification needs model.family=sequence-classification")
        if d.label_names or d.class_weights:
            p.append(
                "data.label_names / data.class_weights: only sequence-classification uses labels; remove them "
                "or set model.family=sequence-classification"
            )
        if r.eval.best_metric != "val_loss":
            p.append(
                f"eval.best_metric={r.eval.best_metric}: only sequence-classification runs measure it; use val_loss"
            )
        return p
    names = d.label_names
    if any(not isinstance(n, (str, int)) or isinstance(n, bool) for n in names):
        p.append(f"data.label_names: {names!r} must be a list of names, e.g. [negative, positive]")
    elif len({str(n) for n in names}) != len(names):
        p.append(f"data.label_names: {names!r} has duplicates; each class needs its own name")
    elif names and len(names) < 2:
        p.append(f"data.label_names: {names!r}: a classifier needs at least 2 classes")
    if d.class_weights:
        if not all(isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0 for w in d.class_weights):
            p.append(f"data.class_weights: {d.class_weights!r} must be non-negative numbers, one per class")
        elif not names:
            p.append("data.class_weights: give data.label_names too, so each weight's class is explicit")
        elif len(d.class_weights) != len(names):
            p.append(
                f"data.class_weights: {len(d.class_weights)} weights for {len(names)} label_names; give one per class"
            )
    return p


def _check_compile(r: Recipe, accel: str) -> list[str]:
    """train.compile: what it cannot do here, and what the compiler needs."""
    if not r.train.compile:
        return []
    p: list[str] = []
    if r.strategy in DEEPSPEED_STRATEGIES:
        p.append(
            f"train.compile with strategy={r.strategy}: not supported: ZeRO gathers and releases parameters "
            "inside the blocks with its own hooks, untested under torch.compile here (DeepSpeed needs CUDA); "
            "set train.compile=false, or use strategy=fsdp (compiled per block, then sharded)"
        )
    if accel == "cpu" and r.memory.cap_gib is not None:
        p.append(
            "train.compile with memory.cap_gib on the CPU: the cap is enforced by tracking every step, and "
            "tracked steps run eager, so nothing would be compiled; remove memory.cap_gib or set "
            "train.compile=false"
        )
    if accel == "cpu":
        import shutil
        import sys

        cxx = os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++")
        if shutil.which(cxx) is None:
            p.append(
                f"train.compile on the CPU: torch.compile builds C++ kernels, but the compiler {cxx!r} is not on "
                "PATH; install g++ (or set CXX), or set train.compile=false"
            )
    elif _cuda_available() and not _installed("triton"):  # (no CUDA at all is reported under accelerator)
        p.append(
            "train.compile on CUDA: torch.compile needs Triton, which is not installed; pip install triton "
            "(the version matching your torch), or set train.compile=false"
        )
    return p


def _check_cuda_alloc_conf(text: str) -> list[str]:
    """train.cuda_alloc_conf: PyTorch's grammar and limits, and only settings the planner replays."""
    from bigtune.core.allocconf import AllocatorConfig, AllocatorConfigError

    try:
        conf = AllocatorConfig.parse(text)
    except AllocatorConfigError as e:
        return [f"train.cuda_alloc_conf: {e}"]
    if conf.garbage_collection_threshold:
        return [
            "train.cuda_alloc_conf: garbage_collection_threshold does nothing here: PyTorch collects cached blocks "
            "only under a per-process memory fraction (torch.cuda.set_per_process_memory_fraction), which bigtune "
            "does not set; remove it (expandable_segments:True or max_split_size_mb fight fragmentation instead)"
        ]
    return []


def _preset_family(name: str) -> Optional[str]:
    from bigtune.core.presets import PRESETS

    return PRESETS[name].family if name in PRESETS else None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def quant_backend(r: "Recipe") -> str:
    """'torchao' or 'bitsandbytes': who holds the recipe's quantized weights (model.quant_backend resolved)."""
    if r.model.quant_backend != "auto":
        return r.model.quant_backend
    return "torchao" if r.strategy == "fsdp" else "bitsandbytes"


def _check_quant_backend(r: "Recipe") -> list[str]:
    if r.model.quantize == "none":
        return []
    backend = quant_backend(r)
    if backend == "bitsandbytes" and r.strategy == "fsdp":
        return [
            "strategy=fsdp with model.quant_backend=bitsandbytes: FSDP2 cannot shard bitsandbytes' Params4bit "
            "(fully_shard turns them into plain uint8 shards and Linear4bit's forward fails); use "
            "model.quant_backend=torchao (or auto) with model.quantize=nf4, or strategy=ddp"
        ]
    if backend == "torchao":
        if r.strategy in DEEPSPEED_STRATEGIES:
            return [
                f"model.quant_backend=torchao with strategy={r.strategy}: ZeRO cannot partition torchao's NF4Tensor; "
                "use model.quant_backend=bitsandbytes (or auto) with deepspeed_stage_3, or strategy=fsdp"
            ]
        if r.model.quantize != "nf4":
            return [
                f"model.quantize={r.model.quantize} with model.quant_backend=torchao: torchao's FSDP-shardable "
                "4-bit weight is NF4 only; use model.quantize=nf4 (or model.quant_backend=bitsandbytes, without FSDP)"
            ]
        if not _installed("torchao"):
            return [
                "model.quant_backend=torchao (QLoRA under FSDP) needs torchao: pip install 'bigtune[torchao]' "
                "(or pip install torchao)"
            ]
    return []


def _check_tracking(r: "Recipe") -> list[str]:
    t, p = r.tracking, []
    for name in dict.fromkeys(t.backends):
        if not _installed(name):  # the backends' packages are named as the backends (tensorboard: torch's writer)
            p.append(
                f"tracking.backends: {name} is not installed: pip install 'bigtune[{name}]' (or pip install {name}), "
                f"or leave {name} out of tracking.backends"
            )
    if t.register_model and "mlflow" not in t.backends:
        p.append("tracking.register_model registers in MLflow's model registry: add mlflow to tracking.backends")
    elif t.register_model and not (t.log_model and r.checkpoint.save_model):
        p.append(
            "tracking.register_model needs the model uploaded: set tracking.log_model=true and "
            "checkpoint.save_model=true (or tracking.register_model=null)"
        )
    return p


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _explicit(section: Any) -> set[str]:
    """Fields whose value differs from the default (used to spot contradicting settings)."""
    out = set()
    for f in dataclasses.fields(section):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if getattr(section, f.name) != default:
            out.add(f.name)
    return out


def preset_names() -> list[str]:
    from bigtune.core.presets import PRESETS

    return sorted(PRESETS)


def _is_preset(name: str) -> bool:
    return name in preset_names()


def _looks_local(name: str) -> bool:
    """./x, /x, ~/x, a/b/c or an existing path is a folder; `org/name` or `name` is a hub id."""
    return name.startswith((".", "/", "~")) or name.count("/") >= 2 or Path(name).expanduser().exists()


def run_name_for(model_name: str, data_source: str | None = None) -> str:
    """The run name for a recipe whose model or data came from ``--model`` / ``--data``: the model id's last
    path component, lowercased, then the data's file stem (``Qwen/Qwen2.5-7B`` with ``chats.jsonl`` →
    ``qwen2.5-7b-chats``), so the plan's title and ``runs/<name>`` say what is trained on what."""

    def part(text: str) -> str:
        last = text.rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1].removeprefix("hf:")
        return "-".join(
            w for w in "".join(c if c.isalnum() or c in "._-" else "-" for c in last.lower()).split("-") if w
        )

    name = part(model_name) or "run"
    if data_source and data_source != "demo":
        stem = data_source.rstrip("/\\")
        stem = part(Path(stem).stem if Path(stem).suffix.lower() in DATA_SUFFIXES else stem)
        name = f"{name}-{stem}" if stem else name
    return name


# file suffixes `data.source` reads (a source's stem, without them, names a run)
DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".tsv", ".parquet", ".txt", ".md", ".text")


def shipped_recipes() -> list[Path]:
    root = Path(__file__).resolve().parents[2] / "recipes"
    return sorted(root.glob("*.yaml")) if root.is_dir() else []


# -- documentation -------------------------------------------------------------------------------


def schema_rows() -> list[tuple[str, str, str, str]]:
    """(key, type, default, doc) for every leaf of the schema, in order."""
    rows = []
    for f in dataclasses.fields(Recipe):
        if f.name in _SECTIONS:
            sec = _SECTIONS[f.name]
            for g in dataclasses.fields(sec):
                default = g.default if g.default is not dataclasses.MISSING else g.default_factory()  # type: ignore
                rows.append(
                    (f"{f.name}.{g.name}", _describe(_field_type(sec, g.name)), repr(default), g.metadata["doc"])
                )
        else:
            rows.append((f.name, _describe(_field_type(Recipe, f.name)), repr(f.default), f.metadata["doc"]))
    return rows


# The heading id of the keys outside any block; a block's heading id is its name, a key's anchor the key itself.
TOP_LEVEL = "top-level"


def schema_blocks() -> list[tuple[str, str, list[tuple[str, str, str, str]]]]:
    """(block, intro, rows) per recipe block (``model``, ``data``, ...) in schema order, then ``TOP_LEVEL``:
    the keys outside any block. The intro is the block's own doc; rows are ``schema_rows()``'s."""
    rows = schema_rows()
    blocks = []
    for f in dataclasses.fields(Recipe):
        if f.name in _SECTIONS:
            blocks.append((f.name, f.metadata["doc"], [r for r in rows if r[0].startswith(f.name + ".")]))
    top = [r for r in rows if "." not in r[0]]
    blocks.append(
        (TOP_LEVEL, "Keys outside any block: the run's name and folder, precision, devices, parallelism.", top)
    )
    return blocks


def schema_markdown(anchors: bool = False) -> str:
    """The recipe reference: an index of the blocks, then one table per block.

    ``anchors``: for the docs site (mkdocs with attr_list): every block heading gets its name as id and every
    key an ``<a id="train.max_steps">``, so ``recipe.md#train.max_steps`` links to the key's row; the
    terminal (``bigtune recipe --docs``) gets the plain Markdown."""

    def cell(text: str) -> str:
        return " ".join(str(text).split()).replace("|", "\\|")

    blocks = schema_blocks()
    lines = [
        "# Recipe reference",
        "",
        "Generated from `src/bigtune/recipe.py` (`bigtune recipe --docs`). Override any key with `--set key=value`.",
        "",
        "| block | what it sets | keys |",
        "|---|---|---|",
    ]
    for name, intro, rows in blocks:
        title = "top level" if name == TOP_LEVEL else f"`{name}`"
        lines.append(f"| [{title}](#{name}) | {cell(intro)} | {len(rows)} |")
    for name, intro, rows in blocks:
        title = "Top-level keys" if name == TOP_LEVEL else f"`{name}`"
        lines += ["", f"## {title}" + (f" {{#{name}}}" if anchors else ""), "", cell(intro), ""]
        lines += ["| key | type | default | what it does |", "|---|---|---|---|"]
        for key, tp, default, doc in rows:
            # the key links to itself, so its address can be copied from the page
            shown = f'<a id="{key}"></a>[`{key}`](#{key})' if anchors else f"`{key}`"
            lines.append(f"| {shown} | {cell(tp)} | `{default}` | {cell(doc)} |")
    return "\n".join(lines) + "\n"
