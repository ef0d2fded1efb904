"""Throughput: bigtune's engine vs a plain Hugging Face Trainer (+ PEFT) on the same configuration.

    python bench/throughput.py --smoke                                  # CPU, tiny shapes (CI)
    python bench/throughput.py --config tinyllama-1.1b-full-bf16        # one GPU
    python bench/throughput.py --config llama-7b-lora [--steps 30] [--data fixed|real|both]
                               [--set data.packing=true ...]           # extra bigtune-only overrides
                               [--set-both peft.adapter_dtype=bfloat16 ...]  # both sides: still identical

Both sides run in this process on the same model shapes (bundled config, random init from the same
seed, same dtype), the same token ids (bigtune's own tokenizer and data pipeline produce the
examples; the Trainer gets them through a padding collator), the same micro-batch, accumulation,
precision, AdamW settings, gradient clipping, checkpointing and DataLoader workers.

Data: ``fixed``: every sample is max_seq_length tokens (no padding anywhere). ``real``: the bundled
instruction set as is (its records' real, short lengths; padding to the longest in each
micro-batch). On ``real`` data bigtune also runs with data.packing (the same samples packed into
rows), reported as its own line.

``--compile``: torch.compile on both sides, each the way it is documented: bigtune's train.compile
(every decoder block compiled in place) and Trainer's ``torch_compile=True`` (accelerate compiles the
whole model). Each side starts from empty in-memory compile caches (torch._dynamo.reset(); inductor's
on-disk cache stays); its CPU peak step runs eager, as bigtune's measured CPU steps do. Give it a warm-up
that covers the compiles (the first unmeasured step, and the first change of batch shape on ``real``).

Timing skips the first ``--warmup`` optimizer steps on both sides. Tokens are non-padding tokens.
MFU = model FLOPs (stepmath.training_flops, the same helper for both) / time / the GPU's dense peak.
Peak memory: CUDA allocator peaks (allocated, reserved) per side; on CPU, live tensor bytes at the
peak of a measured step (memory.LiveTensorTracker, as the engine's own CPU measurement).
Writes bench/results/throughput-<gpu>-<date>.json (with the command line) unless --no-json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from bigtune.core.stepmath import flop_shape, training_flops  # noqa: E402
from bigtune.data.text import Collator, build_examples  # noqa: E402
from bigtune.models.build import apply_peft, build_model, enable_activation_checkpointing, load_tokenizer  # noqa: E402
from bigtune.recipe import load_recipe  # noqa: E402
from bigtune.run.training import train  # noqa: E402

# Each preset is a set of recipe overrides; both sides read their settings from the resolved recipe.
PRESETS = {
    "smoke": {
        "model.name": "tiny-llama",
        "accelerator": "cpu",
        "precision": "32-true",
        "data.max_seq_length": 128,
        "train.micro_batch_size": 4,
        "optim.grad_clip": 1.0,
        "optim.lr": 1e-4,
    },
    "tinyllama-1.1b-full-bf16": {
        "model.name": "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T",
        "model.init": "random",
        "accelerator": "cuda",
        "precision": "bf16-true",
        "data.max_seq_length": 2048,
        "train.micro_batch_size": 8,
        "train.activation_checkpointing": False,
        "optim.implementation": "fused",
        "optim.grad_clip": 1.0,
        "optim.lr": 1e-5,
        "data.num_workers": 2,
    },
    "llama-7b-lora": {
        "model.name": "meta-llama/Llama-2-7b-hf",
        "model.init": "random",
        "accelerator": "cuda",
        "precision": "bf16-true",
        "data.max_seq_length": 2048,
        "train.micro_batch_size": 4,
        "train.activation_checkpointing": True,
        "peft.method": "lora",
        "peft.r": 16,
        "peft.alpha": 32.0,
        "peft.dropout": 0.05,
        "optim.implementation": "fused",
        "optim.grad_clip": 1.0,
        "optim.lr": 1e-4,
        "data.num_workers": 2,
    },
}
# bigtune options Trainer has no counterpart for, on by default in the GPU presets (--set overrides them):
# the chunked loss never holds the full tokens × 32k-vocab logits (on CPU it cut the peak by 40-55%; its
# speed effect on a GPU, one extra output-layer matmul against less memory traffic, is to be measured).
BIGTUNE_EXTRA = {
    "smoke": {},
    "tinyllama-1.1b-full-bf16": {"train.loss_chunk_tokens": 4096},
    "llama-7b-lora": {"train.loss_chunk_tokens": 4096},
}
DEFAULT_STEPS = {"smoke": 12, "tinyllama-1.1b-full-bf16": 40, "llama-7b-lora": 30}
DEFAULT_WARMUP = {"smoke": 4, "tinyllama-1.1b-full-bf16": 10, "llama-7b-lora": 10}


def fixed_length_source(tmp: Path, n: int, max_len: int) -> str:
    """Records longer than max_seq_length: truncated, every sample is exactly max_len tokens."""
    path = tmp / "fixed.jsonl"
    words = "plate {i} of tomato soup with basil, bread and a glass of cold water "
    reps = max_len // 8 + 4
    path.write_text("".join(json.dumps({"text": words.format(i=i) * reps}) + "\n" for i in range(n)))
    return str(path)


def recipe_for(config: str, data: str, steps: int, tmp: Path, extra: dict):
    over = dict(PRESETS[config])
    mb = over["train.micro_batch_size"]
    n = mb * (steps + 2)
    over.update(
        {
            "train.max_steps": steps,
            "train.max_epochs": None,
            "memory.plan": False,
            "checkpoint.save_model": False,
            "name": f"throughput-{config}",
        }
    )
    if data == "fixed":
        over.update(
            {"data.source": fixed_length_source(tmp, n, over["data.max_seq_length"]), "data.format": "jsonl-text"}
        )
    else:
        over.update({"data.source": "demo"})
    over.update(extra)
    return over


def peak_flops_of(device: torch.device, precision: str):
    if device.type != "cuda":
        return None, "cpu"
    from bigtune.core.gpus import detect_gpu, peak_flops

    props = torch.cuda.get_device_properties(device)
    gpu = detect_gpu(props.name, props.total_memory)
    name = gpu.key if gpu is not None else props.name.replace(" ", "-").lower()
    return (peak_flops(gpu, precision) if gpu is not None else None), name


def _reset_cuda() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _cuda_peaks() -> dict:
    if not torch.cuda.is_available():
        return {}
    torch.cuda.synchronize()
    return {
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
    }


# -- bigtune --------------------------------------------------------------------------------------------


def _reset_compiler() -> int:
    """Each side compiles from scratch, as in its own process: both compile nn.Module._call_impl, so
    one side's cached graphs (and their share of the recompile limit) would otherwise carry over.
    Returns the graph count so far (see _graphs_since)."""
    torch._dynamo.reset()
    return _graphs_since(0)


def _graphs_since(start: int) -> int:
    """Graphs dynamo compiled since its counter read ``start`` (stays 0 without --compile)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"] - start


def run_bigtune(over: dict, warmup: int, out: Path) -> dict:
    over = {
        **over,
        "output_dir": str(out),
        "train.log_every_steps": warmup,
        "memory.every_steps": 10**9,
    }  # snapshots at steps 0 and 1 only, inside the warm-up window
    _reset_cuda()
    graphs = _reset_compiler()
    with contextlib.redirect_stdout(io.StringIO()):
        s = train({}, over, quiet_recipe=True)
    graphs = _graphs_since(graphs)
    peaks = _cuda_peaks()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    timed = rows[1:]  # the first window is the warm-up
    seconds = sum(r["step_time_s"] * warmup for r in timed)
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] * warmup for r in timed)
    flops = sum(r["model_flops_per_s"] * r["step_time_s"] * warmup for r in timed)
    # mean of the per-step losses over the run, as Trainer's training_loss (equal windows)
    res = {
        "tokens_per_s": tokens / seconds,
        "model_flops_per_s": flops / seconds,
        "timed_steps": len(timed) * warmup,
        "mean_loss": statistics.fmean(r["loss"] for r in rows),
        "compiled_graphs": graphs,
    }
    if peaks:
        res.update(peaks)
    else:  # CPU: the engine's own live-tensor peak (steps 0 and 1)
        res.update({"peak_allocated_bytes": s["peak_allocated_bytes"], "peak_reserved_bytes": None})
    return res


# -- Hugging Face Trainer -------------------------------------------------------------------------------


class _Examples(torch.utils.data.Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class _HFCollator:
    """Pads to the longest sample with label -100, always passing the attention mask (what
    DataCollatorForSeq2Seq does); the same Collator bigtune uses, minus its own flags."""

    def __init__(self, pad_id: int):
        self.inner = Collator(pad_id)

    def __call__(self, batch):
        return {k: v for k, v in self.inner(batch).items() if isinstance(v, torch.Tensor)}


def run_hf(over: dict, warmup: int, out: Path) -> dict:
    from transformers import Trainer, TrainerCallback

    r = load_recipe({}, over)
    cuda = r.accelerator == "cuda" or (r.accelerator == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    tok = load_tokenizer(r.model)
    with contextlib.redirect_stdout(io.StringIO()):
        examples, _ = build_examples(r.data, tok, r.seed)
    _reset_cuda()
    graphs = _reset_compiler()
    with torch.device(device):  # random init straight on the device, as the engine does
        model = build_model(r.model, tok, r.precision, r.seed)
    if r.peft.method != "none":
        model = apply_peft(model, r.peft, quantized=False, checkpointing=r.train.activation_checkpointing)
    shape = flop_shape(model)

    counts = {"on": False, "tokens": 0, "pairs": 0}

    # Outside any compiled graph (torch_compile=True compiles the whole model, hooks included): traced,
    # its `counts["on"]` would become a guard, and turning the count on would recompile in the timed window.
    @torch.compiler.disable
    def count(module, args, kwargs):  # every micro-batch forward in the timed window
        if counts["on"]:
            # Summed on the device, read once at the end: no host sync in Trainer's loop. FLOPs are
            # linear in tokens and attended pairs (stepmath.causal_pairs, written out for tensors).
            mask = kwargs["attention_mask"].long()
            counts["tokens"] = counts["tokens"] + mask.sum()
            counts["pairs"] = counts["pairs"] + (mask.cumsum(-1) * mask).sum()

    model.register_forward_pre_hook(count, with_kwargs=True)

    class Clock(TrainerCallback):
        t0 = t1 = None

        def on_step_end(self, args, state, control, **kw):
            if state.global_step in (warmup, r.train.max_steps):
                if cuda:
                    torch.cuda.synchronize()
                if state.global_step == warmup:
                    self.t0 = time.perf_counter()
                    counts["on"] = True
                else:
                    self.t1 = time.perf_counter()
                    counts["on"] = False

    clock = Clock()
    bf16_model = r.precision == "bf16-true"
    args = hf_training_args(r, out, cuda)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=_Examples(examples),
        data_collator=_HFCollator(tok.pad_token_id),
        callbacks=[clock],
    )
    if bf16_model:
        # A bf16-loaded model trains in pure bf16 (bigtune's bf16-true); Trainer needs no autocast for it.
        assert next(model.parameters()).dtype == torch.bfloat16
    cpu_peak = None
    if not cuda:
        cpu_peak = _cpu_peak_callback(trainer, model)
    with contextlib.redirect_stdout(io.StringIO()):
        result = trainer.train()
    graphs = _graphs_since(graphs)
    peaks = _cuda_peaks()
    seconds = clock.t1 - clock.t0
    flops = training_flops(shape, int(counts["tokens"]), int(counts["pairs"]))
    res = {
        "tokens_per_s": int(counts["tokens"]) / seconds,
        "model_flops_per_s": flops / seconds,
        "timed_steps": r.train.max_steps - warmup,
        "mean_loss": result.training_loss,
        "compiled_graphs": graphs,
    }
    if peaks:
        res.update(peaks)
    else:
        res.update({"peak_allocated_bytes": cpu_peak.peak, "peak_reserved_bytes": None})
    del trainer, model
    return res


def hf_training_args(r, out: Path, cuda: bool):
    """Trainer's settings from the resolved recipe (the same values bigtune's side reads)."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=r.train.micro_batch_size,
        gradient_accumulation_steps=r.accumulate,
        max_steps=r.train.max_steps,
        learning_rate=r.optim.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=r.optim.weight_decay,
        adam_beta1=r.optim.betas[0],
        adam_beta2=r.optim.betas[1],
        adam_epsilon=r.optim.eps,
        max_grad_norm=r.optim.grad_clip or 0.0,
        optim="adamw_torch_fused" if r.optim.implementation == "fused" else "adamw_torch",
        bf16=r.precision == "bf16-mixed",
        fp16=False,
        use_cpu=not cuda,
        gradient_checkpointing=r.train.activation_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        dataloader_num_workers=r.data.num_workers,
        dataloader_pin_memory=cuda,
        remove_unused_columns=False,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        seed=r.seed,
        torch_compile=r.train.compile,
    )


def _cpu_peak_callback(trainer, model):
    """CPU: live tensor bytes at the peak of optimizer step 1 (step 0 creates the optimizer state),
    counting parameters, gradients and optimizer state as the engine's own measurement does."""
    from transformers import TrainerCallback

    from bigtune.memory.tracker import LiveTensorTracker

    class Peak(TrainerCallback):
        peak = None
        tracker = None

        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 1:
                # The tracker cannot see inside compiled code, and compiled code met under it would stay eager
                # for the rest of the run (see memory.MemoryMonitor.begin_step): this step runs eager.
                self.eager = torch.compiler.set_stance("force_eager")
                self.tracker = LiveTensorTracker()
                opt = trainer.optimizer
                state_tensors = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
                self.tracker.track(list(model.parameters()) + state_tensors)
                self.tracker.__enter__()

        def on_step_end(self, args, state, control, **kw):
            if self.tracker is not None:
                self.tracker.__exit__(None, None, None)
                self.eager.__exit__(None, None, None)
                self.peak = self.tracker.peak_bytes
                self.tracker = None

    cb = Peak()
    trainer.add_callback(cb)
    return cb


# -- report ---------------------------------------------------------------------------------------------


def _fmt_bytes(n) -> str:
    return "-" if n is None else f"{n / 2**30:.3f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def compare(name: str, ours: dict, hf: dict, peak: float | None) -> dict:
    out = {"bigtune": ours, "hf": hf}
    for side in (ours, hf):
        side["mfu"] = side["model_flops_per_s"] / peak if peak else None
    out["tokens_per_s_ratio"] = ours["tokens_per_s"] / hf["tokens_per_s"]
    out["peak_allocated_ratio"] = (
        ours["peak_allocated_bytes"] / hf["peak_allocated_bytes"]
        if ours.get("peak_allocated_bytes") and hf.get("peak_allocated_bytes")
        else None
    )
    out["peak_reserved_ratio"] = (
        ours["peak_reserved_bytes"] / hf["peak_reserved_bytes"]
        if ours.get("peak_reserved_bytes") and hf.get("peak_reserved_bytes")
        else None
    )
    print(f"\n[{name}]")
    print(
        f"{'side':<10}{'tokens/s':>14}{'GFLOP/s':>12}{'MFU':>8}{'peak alloc':>14}{'peak reserved':>16}{'mean loss':>12}"
    )
    for label, side in (("bigtune", ours), ("hf", hf)):
        m = f"{side['mfu']:.1%}" if side["mfu"] is not None else "-"
        print(
            f"{label:<10}{side['tokens_per_s']:>14,.0f}{side['model_flops_per_s'] / 1e9:>12,.1f}{m:>8}"
            f"{_fmt_bytes(side['peak_allocated_bytes']):>14}{_fmt_bytes(side.get('peak_reserved_bytes')):>16}"
            f"{side['mean_loss']:>12.4f}"
        )
    if ours.get("compiled_graphs") or hf.get("compiled_graphs"):
        print(f"torch.compile graphs: bigtune {ours['compiled_graphs']}, hf {hf['compiled_graphs']}")
    ra = out["peak_allocated_ratio"]
    rr = out["peak_reserved_ratio"]
    print(
        f"ratio bigtune/hf: tokens/s {out['tokens_per_s_ratio']:.3f}, peak allocated "
        f"{'-' if ra is None else f'{ra:.3f}'}, peak reserved {'-' if rr is None else f'{rr:.3f}'}",
        flush=True,
    )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", choices=sorted(PRESETS), help="preset to run")
    ap.add_argument("--smoke", action="store_true", help="the CPU smoke preset (tiny shapes, CI)")
    ap.add_argument("--steps", type=int, help="optimizer steps per side (including --warmup)")
    ap.add_argument("--warmup", type=int, help="steps not timed at the start of each side")
    ap.add_argument("--data", choices=["fixed", "real", "both"], default="both")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra recipe override for the bigtune side only (e.g. train.loss_chunk_tokens=4096)",
    )
    ap.add_argument(
        "--set-both",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="recipe override for both sides, which stay the identical configuration (e.g. "
        "peft.adapter_dtype=bfloat16: bf16 adapters for bigtune and for the Trainer's PEFT)",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile both sides: train.compile=true for bigtune, TrainingArguments(torch_compile="
        "True) for the Trainer; use a --warmup that covers the compiles",
    )
    ap.add_argument("--json", help="result file (default bench/results/throughput-<gpu>-<date>.json)")
    ap.add_argument("--no-json", action="store_true", help="print only")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="build both sides (recipes, data, model on the meta "
        "device, Trainer arguments, bigtune's plan on an H100) and exit without training; runs on a CPU",
    )
    args = ap.parse_args(argv)
    config = "smoke" if args.smoke else args.config
    if config is None:
        ap.error("give --smoke or --config")
    if PRESETS[config]["accelerator"] == "cuda" and not torch.cuda.is_available() and not args.dry_run:
        print(
            f"--config {config} needs a CUDA GPU (torch sees none); on a CPU use --smoke (or --dry-run to check "
            "the preset)",
            file=sys.stderr,
        )
        return 2
    warmup = args.warmup or DEFAULT_WARMUP[config]
    steps = args.steps or DEFAULT_STEPS[config]
    if steps < 2 * warmup:
        ap.error(f"--steps {steps} must be at least twice --warmup {warmup} (timed windows are warm-up long)")
    steps -= steps % warmup  # whole timed windows

    def parsed(pairs: list[str]) -> dict:
        out = {}
        for kv in pairs:
            k, _, v = kv.partition("=")
            out[k] = json.loads(v) if v not in ("", None) and v[0] in "0123456789-[{tfn" else v
        return out

    extra = {**BIGTUNE_EXTRA[config], **parsed(args.set)}
    both = parsed(args.set_both)
    datas = ["fixed", "real"] if args.data == "both" else [args.data]
    if args.dry_run:
        return dry_run(config, datas, steps, warmup, extra, both)
    device = torch.device("cuda" if PRESETS[config]["accelerator"] == "cuda" else "cpu")
    r0 = load_recipe({}, PRESETS[config])
    peak, gpu_name = peak_flops_of(device, r0.precision)
    print(
        f"throughput: {config} on {gpu_name} ({torch.get_num_threads()} threads), {steps} steps, first {warmup} "
        f"not timed; torch {torch.__version__}; bigtune-only options {extra or 'none'}"
        + ("; torch.compile on both sides" if args.compile else ""),
        flush=True,
    )
    results: dict = {}
    record = {
        "config": config,
        "overrides": {**PRESETS[config], **both},
        "compile": args.compile,
        "bigtune_extra": extra,
        "steps": steps,
        "warmup": warmup,
        "device": gpu_name,
        "peak_flops": peak,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "results": results,
        "command": "python bench/throughput.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    try:
        import transformers

        record["transformers"] = transformers.__version__
    except ImportError:
        pass
    path = (
        None
        if args.no_json
        else Path(args.json)
        if args.json
        else ROOT / "bench" / "results" / f"throughput-{gpu_name}-{datetime.date.today().isoformat()}.json"
    )
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for data in datas:
            over = recipe_for(config, data, steps, tmp, {"train.compile": args.compile, **both})
            ours_over = {**over, **extra}
            ours = run_bigtune(ours_over, warmup, tmp / f"bigtune-{data}")
            hf = run_hf(over, warmup, tmp / f"hf-{data}")
            results[data] = compare(f"{data} data", ours, hf, peak)
            _write_record(path, record)  # after every comparison: a time limit keeps what finished
            if data == "real" and not ours_over.get("data.packing"):
                packed = run_bigtune({**ours_over, "data.packing": True}, warmup, tmp / "bigtune-real-packed")
                results["real+packing"] = compare("real data, bigtune with data.packing", packed, hf, peak)
                _write_record(path, record)
    record["complete"] = True
    _write_record(path, record)
    if path is not None:
        print(f"\nwrote {path}")
    return 0


def _write_record(path: Path | None, record: dict) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = path.with_suffix(".json.tmp")
    tmp_path.write_text(json.dumps(record, indent=2) + "\n")
    tmp_path.replace(path)


def dry_run(
    config: str,
    datas: list[str],
    steps: int,
    warmup: int,
    extra: dict,
    both: dict | None = None,
    gpu_key: str = "h100-80gb",
) -> int:
    """Build everything a GPU run builds, on any machine, and train nothing: both sides' recipes (validated as
    on a CUDA machine), data, tokenizer, the model on the meta device (+ PEFT, checkpointing), its FLOP
    shape, Trainer's arguments, the GPU's peak FLOP/s, and bigtune's plan of its side on ``gpu_key``. A
    typo in a preset or an API change fails here instead of on a rented GPU."""
    from unittest import mock

    from bigtune.core.gpus import detect_gpu, find_gpu, peak_flops
    from bigtune.plan.base.target import Target
    from bigtune.plan.format import format_plan
    from bigtune.plan.planner import plan

    gpu = find_gpu(gpu_key)
    t0 = time.perf_counter()
    print(
        f"throughput --dry-run: {config} ({steps} steps, first {warmup} not timed), data {datas}; "
        f"bigtune-only options {extra or 'none'}",
        flush=True,
    )
    # A CUDA machine as the recipe checks see it (fused AdamW, accelerator=cuda), nothing else faked.
    cuda_checks = (
        mock.patch("torch.cuda.is_available", return_value=True)
        if PRESETS[config]["accelerator"] == "cuda"
        else contextlib.nullcontext()
    )
    planned = False
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for data in datas:
            over = recipe_for(config, data, steps, tmp, dict(both or {}))
            sides = [("bigtune", {**over, **extra}), ("hf", over)]
            if data == "real" and not extra.get("data.packing"):
                sides.append(("bigtune+packing", {**over, **extra, "data.packing": True}))
            for label, side in sides:
                with cuda_checks:
                    r = load_recipe({}, side)
                tok = load_tokenizer(r.model)
                with contextlib.redirect_stdout(io.StringIO()):
                    examples, _ = build_examples(r.data, tok, r.seed)
                need = r.train.micro_batch_size * r.accumulate * steps
                if len(examples) < need and data == "fixed":
                    raise SystemExit(f"{label}/{data}: {len(examples)} examples for {need} samples")
                with torch.device("meta"):
                    model = build_model(r.model, tok, r.precision, r.seed)
                if r.train.activation_checkpointing:
                    enable_activation_checkpointing(model)
                if r.peft.method != "none":
                    model = apply_peft(model, r.peft, quantized=False, checkpointing=r.train.activation_checkpointing)
                shape = flop_shape(model)
                assert shape and shape.trainable_matmul_params > 0, shape
                trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
                line = (
                    f"  {data:<5} {label:<16} {len(examples)} examples, {trainable:,} trainable parameters, "
                    f"precision {r.precision}, micro-batch {r.train.micro_batch_size} x {r.accumulate}"
                )
                if label == "hf":
                    hf_training_args(r, tmp / "hf-args", cuda=PRESETS[config]["accelerator"] == "cuda")
                    line += ", TrainingArguments ok"
                elif PRESETS[config]["accelerator"] == "cuda" and not planned:  # the plan does not read the data
                    planned = True
                    p = plan(r, Target("cuda", gpu))
                    line += (
                        f"; plan on {gpu.key}: peak allocated {p.peak_allocated / 2**30:.2f} GiB, total "
                        f"{p.peak_total / 2**30:.2f} GiB ({'fits' if p.fits else 'DOES NOT FIT'}), step "
                        f"{p.step_time_s:.3f} s"
                    )
                    if not p.fits:
                        print(format_plan(p))
                        raise SystemExit(f"{label}/{data}: the planner predicts an OOM on {gpu.key}")
                print(line, flush=True)
                del model
    if PRESETS[config]["accelerator"] == "cuda":
        h100 = detect_gpu("NVIDIA H100 80GB HBM3", int(79.1 * 2**30))
        assert h100 is not None and peak_flops(h100, PRESETS[config]["precision"]), "no peak FLOP/s for the H100"
    print(f"dry run ok: {config} builds ({time.perf_counter() - t0:.1f} s); nothing trained", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
