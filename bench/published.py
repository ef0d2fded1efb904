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

The rows are data: bench/published_rows.yaml holds each one (citation, published figure, the recipe overrides that
state its setup, and why they are set so), loaded and checked here into Row objects (a bad entry stops the
script with the row's id and the field). Every number is cited to the notes in bench/research/published-notes.md
(source repo, path, commit). Rows whose
implementation differs materially from bigtune's engine carry a flag (``impl``): those gaps are what a user
comparing with the source sees, not errors of the planner for bigtune's own engine. Nothing here is tuned:
a row states the published setup as a recipe, and the planner's answer is printed as it is.

Writes bench/results/published-cpu-<date>.json atomically (every row, published and planned numbers, the
command, the date); rows are written as they finish, so an interrupted run keeps what it has.
"""

from __future__ import annotations

import argparse
import copy
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

import yaml

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3

# -- the rows: bench/published_rows.yaml holds every published data point with its citation, its recipe
# overrides and why they are set so; this script loads it into Row objects and plans them -------------------
ROWS_FILE = ROOT / "bench" / "published_rows.yaml"

# Notes printed under the table for the bench-only emulations of litgpt's own code (Row.litgpt_emulations).
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


@dataclass(frozen=True)
class Row:
    """One published data point and how to state it as a bigtune recipe (a mapping of bench/published_rows.yaml)."""

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


class RowsFileError(ValueError):
    """A bad entry in bench/published_rows.yaml; the message names the row and the field."""


METRICS = ("peak_allocated", "after_forward_allocated", "reserved", "device_used", "fit")
UNITS = ("GB", "GiB", "MiB", "-")
SPEED_UNITS = ("tokens/s", "samples/s")
_REQUIRED = ("id", "source", "setup", "metric", "value", "unit", "gpu")
_TEXT_FIELDS = ("source", "setup", "impl", "note")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# What each plain field must hold (the text fields and `over` are joined and merged by _row_of instead).
_CHECKS: dict[str, tuple[Any, str]] = {
    "id": (lambda v: isinstance(v, str) and v.strip() == v != "", "a non-empty string without outer spaces"),
    "metric": (lambda v: v in METRICS, "one of " + ", ".join(METRICS)),
    "value": (lambda v: v is None or (_number(v) and v > 0), "a positive number, or null for a fit row"),
    "unit": (lambda v: v in UNITS, "one of " + ", ".join(UNITS)),
    "gpu": (lambda v: isinstance(v, str) and v != "", "a GPU catalog name (bigtune gpus)"),
    "recipe": (lambda v: v is None or (isinstance(v, str) and v != ""), "a recipe path under the repository, or null"),
    "gpus": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "a whole number ≥ 1"),
    "strategy": (lambda v: isinstance(v, str) and v != "", "the planner's strategy (single, ddp, fsdp, deepspeed_*)"),
    "expect": (lambda v: v in (None, "fit", "oom"), "fit, oom, or null"),
    "speed": (
        lambda v: v is None or (isinstance(v, list) and len(v) == 2 and _number(v[0]) and v[1] in SPEED_UNITS),
        "[rate, tokens/s | samples/s], or null",
    ),
    "legacy_bnb": (lambda v: isinstance(v, bool), "true or false"),
    "fsdp1_units": (lambda v: isinstance(v, bool), "true or false"),
    "legacy_softmax": (lambda v: isinstance(v, bool), "true or false"),
    "keep_gradients": (lambda v: isinstance(v, bool), "true or false"),
    "context_mib": (lambda v: v is None or (_number(v) and v > 0), "MiB as a positive number, or null"),
}


def _flat(items: list) -> list:
    """A YAML alias of a list inside a list arrives nested: flatten it."""
    out: list = []
    for x in items:
        out.extend(_flat(x) if isinstance(x, list) else [x])
    return out


def _text(value: Any) -> Optional[str]:
    """A string, or a list of strings (aliases of shared texts among them) joined without a separator."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(x, str) for x in _flat(value)):
        return "".join(_flat(value))
    return None


def _overrides(value: Any) -> Optional[dict]:
    """A mapping of dotted recipe keys, or a list of them applied in order: a later key replaces an earlier
    one's value where it stands, as Python's ``{**a, **b}``, so the order of the keys is the order written."""
    parts = _flat(value) if isinstance(value, list) else [value]
    if not all(isinstance(p, dict) and all(isinstance(k, str) for k in p) for p in parts):
        return None
    out: dict = {}
    for p in parts:
        out.update(p)
    return copy.deepcopy(out)  # YAML aliases share their objects: each row owns its values


def _row_of(entry: Any, n: int, path: Path) -> Row:
    """One mapping of the file's `rows:` as a Row, or RowsFileError naming the row, the field and the fix."""
    rid = entry.get("id") if isinstance(entry, dict) else None
    where = f"{path.name}: row {rid}" if isinstance(rid, str) and rid else f"{path.name}: row #{n} (no id)"
    if not isinstance(entry, dict):
        raise RowsFileError(f"{where}: expected a mapping of Row fields, got {entry!r}")
    names = [f.name for f in dataclasses.fields(Row)]
    unknown = [k for k in entry if k not in names]
    if unknown:
        raise RowsFileError(f"{where}: unknown field {unknown[0]!r}; a row's fields are {', '.join(names)}")
    missing = [k for k in _REQUIRED if k not in entry]
    if missing:
        raise RowsFileError(f"{where}: field {missing[0]!r} is missing (every row states {', '.join(_REQUIRED)})")
    fields: dict[str, Any] = {}
    for k, v in entry.items():
        if k in _TEXT_FIELDS:
            got = _text(v)
            want = "a string, or a list of strings joined"
        elif k == "over":
            got = _overrides(v)
            want = "a mapping of recipe keys (model.name: ...), or a list of mappings applied in order"
        else:
            check, want = _CHECKS[k]
            if not check(v):
                raise RowsFileError(f"{where}: field {k!r}: expected {want}, got {v!r}")
            fields[k] = tuple(v) if k == "speed" and v is not None else v  # Row.speed is a (rate, unit) pair
            continue
        if got is None:
            raise RowsFileError(f"{where}: field {k!r}: expected {want}, got {v!r}")
        fields[k] = got
    row = Row(**fields)
    # the pairs the runner relies on: a fit row states an outcome and no number, a measured row a number
    if row.metric == "fit" and (row.value is not None or row.expect is None or row.unit != "-"):
        raise RowsFileError(f"{where}: a fit row has value null, unit '-' and expect fit or oom")
    if row.metric != "fit" and (row.value is None or row.expect is not None or row.unit == "-"):
        raise RowsFileError(f"{where}: field 'value': a {row.metric} row needs a number in GB, GiB or MiB, no expect")
    return row


def _named_texts(doc: dict, key: str, path: Path) -> dict[str, str]:
    out = {}
    for name, v in (doc.get(key) or {}).items():
        text = _text(v)
        if text is None:
            raise RowsFileError(f"{path.name}: {key}.{name}: expected a string, or a list of strings joined")
        out[name] = text
    return out


def load_rows(path: Path = ROWS_FILE) -> tuple[list[Row], dict]:
    """The rows of ``path`` (validated, ids unique) and the whole file with its shared texts joined:
    ``sources`` and ``texts`` (name -> text) and ``skipped`` (data points not planned -> why)."""
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        raise RowsFileError(f"{path.name}: expected a mapping with a list under rows:")
    rows: list[Row] = []
    seen: dict[str, int] = {}
    for n, entry in enumerate(doc["rows"], 1):
        row = _row_of(entry, n, path)
        if row.id in seen:
            raise RowsFileError(f"{path.name}: row {row.id}: field 'id' is used by rows #{seen[row.id]} and #{n}")
        seen[row.id] = n
        rows.append(row)
    skipped = doc.get("skipped") or {}
    if not isinstance(skipped, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in skipped.items()):
        raise RowsFileError(f"{path.name}: skipped: expected a mapping of data points to why they are not planned")
    return rows, {
        "sources": _named_texts(doc, "sources", path),
        "texts": _named_texts(doc, "texts", path),
        "skipped": skipped,
    }


try:
    ROWS, _FILE = load_rows()
except RowsFileError as e:
    if __name__ != "__main__":
        raise
    # run as the script: one line saying what and where, not a traceback
    raise SystemExit(f"error: {e}\n(the fields of a row: the header of {ROWS_FILE.relative_to(ROOT)})") from None
SOURCES: dict[str, str] = _FILE["sources"]
TEXTS: dict[str, str] = _FILE["texts"]
# Published data points not planned, and why (ids as in the notes).
SKIPPED: dict[str, str] = _FILE["skipped"]

# The texts the runner itself tests rows against (their wording lives in the YAML, once)
LAB_BLIP = SOURCES["LAB_BLIP"]  # Row.lab_blip_inputs, Row.shortest_over
LITGPT = TEXTS["LITGPT"]  # Row.litgpt_emulations: rows whose impl starts with it
LAB_FSDP_IMPL = TEXTS["LAB_FSDP_IMPL"]  # plan_row: FSDP1's flat side streams
LEGACY_SOFTMAX_NOTE = TEXTS["LEGACY_SOFTMAX_NOTE"]  # printed under the table
# Sources that ran a Hugging Face transformers model in an eager training loop (statistics_of: hf_eager_reserved)
HF_EAGER_SOURCES = (SOURCES["HF_PERF"], SOURCES["PEFT_DS"], SOURCES["FMS"])


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
