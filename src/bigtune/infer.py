"""Use a trained model: batched text generation and held-out loss / perplexity.

``load_for_inference`` takes whatever a user is likely to point at: a Hugging Face model folder, a
bigtune run directory (its ``model/`` for a full fine-tune; for an adapter run the base weights plus
``adapter/``, attached with peft and left unmerged) or a peft adapter folder on its own. Weights load
from safetensors only and no remote code runs.

``generate`` left-pads each batch so every prompt's last token sits next to its first new token, and
returns only the new text, in the order the prompts came. ``evaluate`` computes the loss exactly as
training does (``bigtune.stepmath``: summed next-token cross-entropy over target tokens divided by the
number of target tokens), so the numbers are directly comparable with a run's training loss.

Heavy libraries (torch, transformers, peft) are imported inside the functions that need them, so
``bigtune --help`` stays quick.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")


class InferError(ValueError):
    """The model, prompts or options cannot be used as given; the message says what is wrong and the fix."""


# -- loading ----------------------------------------------------------------------------------------

def _torch_dtype(dtype: str, device: str):
    """``auto``: the checkpoint's own dtype on a GPU, float32 on a CPU (half-precision CPU matmuls are slow)."""
    import torch

    if dtype not in DTYPE_NAMES:
        raise InferError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPE_NAMES)}")
    if dtype == "auto":
        return "auto" if device.startswith("cuda") else torch.float32
    return getattr(torch, dtype)


def _resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InferError(f"device {device!r} was asked for but PyTorch sees no CUDA GPU; use --device cpu "
                         "(or auto)")
    return device


def _has_safetensors(folder: Path) -> bool:
    return any(folder.glob("*.safetensors")) or (folder / "model.safetensors.index.json").is_file()


def _check_model_folder(folder: Path) -> None:
    if not (folder / "config.json").is_file():
        raise InferError(f"{folder} has no config.json, so it is not a Hugging Face model folder; point at the "
                         "folder that holds config.json and the *.safetensors weights")
    if not _has_safetensors(folder):
        pickles = [p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
        if pickles:
            raise InferError(
                f"{folder} holds only pickle weights ({', '.join(sorted(pickles)[:3])}); bigtune loads safetensors "
                "only, because unpickling can run code. Convert once with `python -c \"from transformers import "
                f"AutoModelForCausalLM as M; M.from_pretrained('{folder}').save_pretrained('{folder}-st')\"` and "
                "use the new folder")
        raise InferError(f"{folder} has a config.json but no *.safetensors weights; copy the weights in or point "
                         "at a complete model folder")


def _load_model(source: str, torch_dtype, device: str):
    from transformers import AutoModelForCausalLM

    from bigtune.models import hub_kwargs

    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, use_safetensors=True,
                                                     trust_remote_code=False, **hub_kwargs(source))
    except Exception as e:  # transformers raises OSError/ValueError/hub errors
        local = Path(source).expanduser().exists()
        hint = ("check that the folder is complete" if local else
                "without internet, download it elsewhere (`huggingface-cli download ...`) and use the local folder")
        raise InferError(f"could not load the model from {source!r} ({type(e).__name__}: {str(e)[:300]}); "
                         f"{hint}") from e
    return model.to(device)


def load_first(what: str, loader, candidates, hint: str):
    """``loader.from_pretrained`` on the first candidate folder that works (remote code off)."""
    from bigtune.models import hub_kwargs

    errors = []
    for src in candidates:
        if src is None:
            continue
        try:
            return loader.from_pretrained(str(src), trust_remote_code=False, **hub_kwargs(str(src)))
        except Exception as e:  # noqa: BLE001 - try the next place it may live
            errors.append(f"{src}: {type(e).__name__}: {str(e)[:200]}")
    raise InferError(f"could not load {what} (" + "; ".join(errors) + f"); {hint}")


def _load_tokenizer(*candidates: Path | str):
    from transformers import AutoTokenizer

    return load_first("a tokenizer", AutoTokenizer, candidates,
                      "save one next to the weights with `tokenizer.save_pretrained(FOLDER)`")


def _adapter_base(adapter: Path) -> str:
    """Where an adapter's base weights are: the run's base/ if it has one, else what adapter_config names."""
    run = adapter.parent
    if (run / "base").is_dir() and (run / "base" / "config.json").is_file():
        return str(run / "base")
    try:
        cfg = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise InferError(f"{adapter / 'adapter_config.json'} cannot be read ({e}); re-export the adapter") from e
    base = cfg.get("base_model_name_or_path")
    if not base and (run / "recipe.yaml").is_file():
        import yaml

        recipe = yaml.safe_load((run / "recipe.yaml").read_text(encoding="utf-8")) or {}
        base = (recipe.get("model") or {}).get("name")
    if not base:
        raise InferError(f"adapter {adapter} does not say which base model it belongs to (no "
                         "base_model_name_or_path in adapter_config.json); set it there to the base model's folder "
                         "or hub id")
    from bigtune.presets import PRESETS

    if base in PRESETS:
        raise InferError(f"adapter {adapter} was trained on the random-init preset {base!r}, whose weights were not "
                         "kept; retrain with checkpoint.save_model=true (the run then keeps <run>/base)")
    p = Path(base).expanduser()
    if p.is_absolute() and not p.exists():
        raise InferError(f"adapter {adapter} names base model folder {base}, which no longer exists; put the base "
                         "weights back there or edit base_model_name_or_path in adapter_config.json")
    if p.is_dir():
        _check_model_folder(p)
    return base


def _finish(model, tokenizer):
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    tokenizer.padding_side = "left"
    model.eval()
    return model, tokenizer


def locate_model(path_or_run: str) -> tuple[Optional[Path], Optional[Path]]:
    """(model folder, None) or (None, adapter folder) for what ``--model`` names: a Hugging Face model
    folder, a peft adapter folder, or a bigtune run directory (its ``model/``, else its ``adapter/``).
    One clear error otherwise. Shared by generate/eval, caption and predict."""
    path = Path(path_or_run).expanduser()
    if not path.exists():
        raise InferError(f"{path_or_run}: no such file or folder; give a Hugging Face model folder, a bigtune run "
                         "directory (runs/NAME) or an adapter folder")
    if not path.is_dir():
        raise InferError(f"{path_or_run} is a file; give the folder that holds config.json (a model), "
                         "adapter_config.json (an adapter) or recipe.yaml (a bigtune run)")
    if (path / "adapter_config.json").is_file():
        return None, path
    for folder in (path, path / "model"):
        if (folder / "config.json").is_file():
            _check_model_folder(folder)
            return folder, None
    if (path / "adapter" / "adapter_config.json").is_file():
        return None, path / "adapter"
    if (path / "recipe.yaml").is_file() or (path / "summary.json").is_file():
        raise InferError(f"run {path} holds no trained model (no model/ or adapter/ folder); train it with "
                         "checkpoint.save_model=true")
    raise InferError(f"{path} is neither a model folder (config.json + *.safetensors), an adapter folder "
                     "(adapter_config.json) nor a bigtune run directory (model/ or adapter/); point at one of "
                     "those")


def attach_adapter(model, adapter: Path, base: str):
    """``model`` (the base) with the peft adapter at ``adapter`` attached, not merged."""
    from peft import PeftModel

    from bigtune.models import peft_renames_quiet

    try:
        with peft_renames_quiet():
            return PeftModel.from_pretrained(model, str(adapter), is_trainable=False)
    except Exception as e:
        raise InferError(f"could not attach adapter {adapter} to base {base} ({type(e).__name__}: {str(e)[:300]}); "
                         "check that the adapter was trained on this base model") from e


def load_for_inference(path_or_run: str, dtype: str = "auto", device: str = "auto"):
    """(model, tokenizer) ready for ``generate``/``evaluate``, in eval mode, tokenizer padding on the left.

    ``path_or_run``: a Hugging Face model folder (config.json + safetensors), a bigtune run directory
    (``model/``, or ``adapter/`` on top of ``base/`` or the base named in adapter_config.json), or a
    peft adapter folder. Adapters are attached with peft and not merged.
    """
    folder, adapter = locate_model(path_or_run)
    device = _resolve_device(device)
    torch_dtype = _torch_dtype(dtype, device)
    if folder is not None:
        return _finish(_load_model(str(folder), torch_dtype, device), _load_tokenizer(folder))
    base = _adapter_base(adapter)
    model = attach_adapter(_load_model(base, torch_dtype, device), adapter, base)
    model.to(device)
    base_dir = Path(base) if Path(base).is_dir() else base
    return _finish(model, _load_tokenizer(adapter, base_dir))


# -- generation -------------------------------------------------------------------------------------

def _device_of(model):
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover - a model without parameters
        import torch

        return torch.device("cpu")


def _check_generate_args(max_new_tokens, batch_size, do_sample, temperature, top_p, top_k) -> None:
    problems = []
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        problems.append(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        problems.append(f"batch_size must be a positive integer, got {batch_size!r}")
    if do_sample:
        if not temperature > 0:
            problems.append(f"temperature must be > 0 when sampling, got {temperature!r}")
        if not 0 < top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {top_p!r}")
        if top_k < 0:
            problems.append(f"top_k must be >= 0 (0 turns it off), got {top_k!r}")
    if problems:
        raise InferError("; ".join(problems))


def _encode(tokenizer, text: str) -> list[int]:
    """Token ids the way bigtune's training data starts a sample: BOS (if the tokenizer has one), then the text."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    return ([bos] if bos is not None else []) + list(ids)


def _left_pad(rows: list[list[int]], pad_id: int):
    import torch

    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, n - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, n - len(r):] = 1
    return ids, mask


def _eos_ids(model, tokenizer) -> list[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]


def generate_ids(model, tokenizer, prompts: list[str], max_new_tokens: int = 64, batch_size: int = 8,
                 do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int = 0, instruction_format: bool = False) -> list[list[int]]:
    """The new token ids per prompt (stopping at, and without, the end-of-sequence token), in input order.

    ``generate`` is this plus decoding; see there for the arguments.
    """
    import copy

    import torch

    if isinstance(prompts, str):
        raise InferError("prompts must be a list of strings, not one string; wrap it: [prompt]")
    prompts = list(prompts)
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise InferError(f"prompt {i} is {type(p).__name__}, not text")
    _check_generate_args(max_new_tokens, batch_size, do_sample, temperature, top_p, top_k)
    if not prompts:
        return []
    if instruction_format:
        from bigtune.data import format_prompt

        prompts = [format_prompt(p) for p in prompts]
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    eos = _eos_ids(model, tokenizer)
    encoded = [_encode(tokenizer, p) for p in prompts]
    for i, e in enumerate(encoded):
        if not e:
            raise InferError(f"prompt {i} is empty and the tokenizer has no BOS token to start from; give some text")

    base_cfg = getattr(model, "generation_config", None)
    cfg = copy.deepcopy(base_cfg) if base_cfg is not None else None
    if cfg is None:
        from transformers import GenerationConfig

        cfg = GenerationConfig()
    cfg.max_new_tokens = max_new_tokens
    cfg.max_length = None
    cfg.min_new_tokens = None
    cfg.min_length = 0
    cfg.do_sample = bool(do_sample)
    cfg.num_beams = 1
    cfg.num_return_sequences = 1
    cfg.use_cache = True  # bigtune saves models with use_cache=False (training); generation wants the KV cache
    cfg.pad_token_id = pad_id
    cfg.eos_token_id = eos or None
    if do_sample:
        cfg.temperature, cfg.top_p, cfg.top_k = float(temperature), float(top_p), int(top_k)
    else:  # neutral values: no "sampling flag set without do_sample" warnings from transformers
        cfg.temperature, cfg.top_p, cfg.top_k = None, None, None

    device = _device_of(model)
    n_batches = -(-len(prompts) // batch_size)
    # Longest first keeps padding small; results go back to input order at the end.
    order = sorted(range(len(prompts)), key=lambda i: -len(encoded[i])) if not do_sample else list(range(len(prompts)))
    results: list[Optional[list[int]]] = [None] * len(prompts)
    t0 = time.perf_counter()
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(seed)
        for b in range(n_batches):
            idx = order[b * batch_size:(b + 1) * batch_size]
            ids, mask = _left_pad([encoded[i] for i in idx], pad_id)
            ids, mask = ids.to(device), mask.to(device)
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
            new = out[:, ids.shape[1]:].tolist()
            for i, row in zip(idx, new):
                cut = len(row)
                for j, t in enumerate(row):
                    if t in eos:
                        cut = j
                        break
                results[i] = row[:cut]
            if n_batches > 1:
                done = min((b + 1) * batch_size, len(prompts))
                print(f"generate: batch {b + 1}/{n_batches} ({done}/{len(prompts)} prompts, "
                      f"{time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    return [r if r is not None else [] for r in results]


def generate(model, tokenizer, prompts: list[str], max_new_tokens: int = 64, batch_size: int = 8,
             do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
             seed: int = 0, instruction_format: bool = False) -> list[str]:
    """Generate a continuation of each prompt; return only the new text, one string per prompt, in order.

    Prompts are batched ``batch_size`` at a time, left-padded. Greedy by default (``do_sample=False``:
    the same output whatever the batch size); with ``do_sample`` the ``temperature`` / ``top_p`` /
    ``top_k`` (0: off) filters apply and ``seed`` makes the draw repeatable without touching the
    caller's global RNG. ``instruction_format`` wraps each prompt in the template bigtune trains
    instruction data with (``bigtune.data.format_prompt``). A progress line per batch goes to stderr
    when there is more than one batch.
    """
    ids = generate_ids(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
                       do_sample=do_sample, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                       instruction_format=instruction_format)
    return [tokenizer.decode(r, skip_special_tokens=True) for r in ids]


# -- evaluation -------------------------------------------------------------------------------------

def evaluate(model, tokenizer, data_source: str, max_seq_length: int = 512, batch_size: int = 8,
             mask_prompt: bool = True) -> dict:
    """Token-weighted mean causal-LM loss and perplexity of ``model`` on ``data_source``.

    The data is read and tokenized exactly as for training (``bigtune.data.build_examples``; alpaca
    prompts masked out unless ``mask_prompt=False``; malformed records skipped and counted). The loss
    is the sum of per-token cross-entropies over every target token divided by their number, so long
    samples weigh more than short ones, as in training; perplexity is exp(loss).
    """
    import torch

    from bigtune.data import Collator, build_examples
    from bigtune.recipe import DataConfig
    from bigtune.stepmath import causal_lm_loss_sum, target_token_count

    if not isinstance(batch_size, int) or batch_size < 1:
        raise InferError(f"batch_size must be a positive integer, got {batch_size!r}")
    if not isinstance(max_seq_length, int) or max_seq_length < 2:
        raise InferError(f"max_seq_length must be an integer >= 2, got {max_seq_length!r}")
    examples, report = build_examples(DataConfig(source=data_source, max_seq_length=max_seq_length,
                                                 mask_prompt=mask_prompt), tokenizer, seed=0)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    collate = Collator(pad_id)
    device = _device_of(model)
    was_training = model.training
    model.eval()
    loss_sum, tokens = 0.0, 0
    n_batches = -(-len(examples) // batch_size)
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            for b in range(n_batches):
                batch = collate(examples[b * batch_size:(b + 1) * batch_size])
                ids = batch["input_ids"].to(device)
                mask = batch["attention_mask"].to(device)
                labels = batch["labels"].to(device)
                logits = model(input_ids=ids, attention_mask=mask).logits
                loss_sum += float(causal_lm_loss_sum(logits, labels))
                tokens += int(target_token_count(labels))
                del logits
                if n_batches > 1:
                    print(f"eval: batch {b + 1}/{n_batches} ({tokens} target tokens, "
                          f"{time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    finally:
        if was_training:
            model.train()
    if tokens == 0:
        raise InferError(f"{report.source}: no target tokens to score (every label is masked); use longer samples "
                         "or mask_prompt=False")
    loss = loss_sum / tokens
    try:
        ppl = math.exp(loss)
    except OverflowError:
        ppl = float("inf")
    return {"loss": loss, "perplexity": ppl, "tokens": tokens, "samples": len(examples),
            "skipped": len(report.skipped), "source": report.source}


# -- command line -----------------------------------------------------------------------------------

def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8", newline="") as fh:
        fh.write(text)
    os.replace(tmp, path)


def read_prompt_file(path: str, instruction: bool = False) -> list[tuple[str, str]]:
    """[(prompt as shown, text to generate from)] from a .jsonl (``instruction``/``prompt`` field, optional
    ``input``) or a text file (one prompt per non-empty line).

    With ``instruction`` the text is already wrapped in the training template (so a record's ``input``
    lands in its own section); without it, ``input`` is appended to the instruction after a blank line.
    """
    from bigtune.data import format_prompt

    p = Path(path).expanduser()
    if not p.is_file():
        raise InferError(f"--file {path}: no such file; give a text file (one prompt per line) or a .jsonl")
    out: list[tuple[str, str]] = []
    if p.suffix.lower() == ".jsonl":
        with p.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InferError(f"{p} line {lineno}: not valid JSON ({e.msg}); each line must be one JSON "
                                     "object with an \"instruction\" or \"prompt\" field") from None
                text = None
                if isinstance(rec, dict):
                    text = rec.get("instruction", rec.get("prompt"))
                if not isinstance(text, str):
                    raise InferError(f"{p} line {lineno}: no text \"instruction\" or \"prompt\" field; add one")
                inp = rec.get("input") or ""
                if not isinstance(inp, str):
                    raise InferError(f"{p} line {lineno}: \"input\" is {type(inp).__name__}, not text")
                if instruction:
                    out.append((text, format_prompt(text, inp)))
                else:
                    out.append((text, f"{text}\n\n{inp}" if inp else text))
    else:
        for line in p.read_text(encoding="utf-8").splitlines():
            if line.strip():
                out.append((line, format_prompt(line) if instruction else line))
    if not out:
        raise InferError(f"--file {path}: holds no prompts")
    return out


def _out_kind(out: Optional[str]) -> Optional[str]:
    if out is None:
        return None
    suffix = Path(out).suffix.lower()
    if suffix not in (".jsonl", ".csv"):
        raise InferError(f"--out {out}: unknown extension {suffix!r}; use .jsonl (one {{prompt, output}} object per "
                         "line) or .csv")
    return suffix[1:]


def main_generate(args) -> int:
    """``bigtune generate``: continue each prompt; print the outputs or write them to --out."""
    items: list[tuple[str, str]] = []
    if args.instruction:
        from bigtune.data import format_prompt

        items += [(p, format_prompt(p)) for p in args.prompts]
    else:
        items += [(p, p) for p in args.prompts]
    if args.file:
        items += read_prompt_file(args.file, instruction=args.instruction)
    if not items:
        raise InferError("no prompts: give them as arguments (bigtune generate --model M \"Once upon\") or with "
                         "--file FILE")
    kind = _out_kind(args.out)
    _check_generate_args(args.max_new_tokens, args.batch_size, args.sample, args.temperature, args.top_p, args.top_k)
    model, tok = load_for_inference(args.model, dtype=args.dtype, device=args.device)
    outputs = generate(model, tok, [text for _, text in items], max_new_tokens=args.max_new_tokens,
                       batch_size=args.batch_size, do_sample=args.sample, temperature=args.temperature,
                       top_p=args.top_p, top_k=args.top_k, seed=args.seed, instruction_format=False)
    rows = [{"prompt": shown, "output": out} for (shown, _), out in zip(items, outputs)]
    if kind == "jsonl":
        _atomic_write(Path(args.out), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        print(f"generate: {len(rows)} outputs written to {args.out}", file=sys.stderr)
    elif kind == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=["prompt", "output"])
        w.writeheader()
        w.writerows(rows)
        _atomic_write(Path(args.out), buf.getvalue())
        print(f"generate: {len(rows)} outputs written to {args.out}", file=sys.stderr)
    elif len(rows) == 1:
        print(rows[0]["output"])
    else:
        for i, r in enumerate(rows):
            print(f"=== [{i}] {r['prompt']}\n{r['output']}\n")
    return 0


def format_eval(result: dict[str, Any]) -> str:
    return (f"eval: {result['source']}: loss {result['loss']:.4f}, perplexity {result['perplexity']:.3f} over "
            f"{result['tokens']} target tokens in {result['samples']} samples ({result['skipped']} skipped)")


def model_family(path_or_run: str) -> str:
    """causal-lm, image-to-text or sequence-classification, from the config.json (or adapter config)
    of a model folder, run directory or adapter folder; causal-lm when nothing says otherwise."""
    path = Path(path_or_run).expanduser()
    for folder in (path, path / "model", path / "adapter"):
        adapter = folder / "adapter_config.json"
        config = folder / "config.json"
        if adapter.is_file():
            try:
                task = json.loads(adapter.read_text(encoding="utf-8")).get("task_type")
            except (OSError, json.JSONDecodeError):
                task = None
            if task == "SEQ_CLS":
                return "sequence-classification"
            base = folder.parent / "base" / "config.json"
            config = base if base.is_file() else config
        if config.is_file():
            try:
                cfg = json.loads(config.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                return "causal-lm"
            archs = [str(a) for a in cfg.get("architectures") or []]
            if any(a.endswith("ForSequenceClassification") for a in archs):
                return "sequence-classification"
            if "vision_config" in cfg:
                return "image-to-text"
            return "causal-lm"
    return "causal-lm"


def main_eval(args) -> int:
    """``bigtune eval``: loss and perplexity of a language model on a data source; for a classifier
    accuracy, macro-F1 and the confusion matrix; for an image-to-text model BLEU, ROUGE-L and caption
    lengths of its greedy captions against the source's reference captions."""
    if args.batch_size < 1:
        raise InferError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.max_seq_length < 2:
        raise InferError(f"--max-seq-length must be at least 2, got {args.max_seq_length}")
    family = model_family(args.model)
    if family == "sequence-classification":
        from bigtune.classify import evaluate_classifier, load_classifier
        from bigtune.metrics import format_classification

        model, tok, names = load_classifier(args.model, dtype=args.dtype, device=args.device)
        res = evaluate_classifier(model, tok, names, args.data, text_field=args.text_field,
                                  label_field=args.label_field, batch_size=args.batch_size,
                                  max_seq_length=args.max_seq_length)
        print(json.dumps(res, indent=2) if args.json else
              format_classification(res, prefix=f"eval: {res['source']}") +
              f"\nmajority-class baseline {res['majority_baseline']:.4f}; loss {res['loss']:.4f}; "
              f"{res['skipped']} records skipped")
        return 0
    if family == "image-to-text":
        from bigtune.caption import evaluate_captions, format_caption_eval, load_captioner

        model, processor = load_captioner(args.model, dtype=args.dtype, device=args.device)
        res = evaluate_captions(model, processor, args.data, text_field=args.text_field,
                                batch_size=args.batch_size, max_new_tokens=args.max_new_tokens)
        print(json.dumps(res, indent=2) if args.json else format_caption_eval(res))
        return 0
    model, tok = load_for_inference(args.model, dtype=args.dtype, device=args.device)
    result = evaluate(model, tok, args.data, max_seq_length=args.max_seq_length, batch_size=args.batch_size,
                      mask_prompt=not args.no_mask_prompt)
    print(json.dumps(result, indent=2) if args.json else format_eval(result))
    return 0


def _add_load_args(p) -> None:
    p.add_argument("--model", required=True, metavar="PATH",
                   help="a Hugging Face model folder, a bigtune run directory (runs/NAME) or an adapter folder")
    p.add_argument("--dtype", choices=list(DTYPE_NAMES), default="auto",
                   help="weights dtype (auto: the checkpoint's on a GPU, float32 on a CPU)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (auto: a GPU if there is one)")


def add_cli(subparsers) -> None:
    """Add the ``generate`` and ``eval`` verbs to bigtune's argparse subparsers."""
    g = subparsers.add_parser("generate", help="generate text from a trained model (greedy unless --sample)")
    _add_load_args(g)
    g.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompts to continue (quote each one)")
    g.add_argument("--file", metavar="FILE", help="more prompts: one per line, or a .jsonl with an \"instruction\" "
                   "(optional \"input\") or \"prompt\" field per line")
    g.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt at most (default 64)")
    g.add_argument("--batch-size", type=int, default=8, help="prompts per forward pass (default 8)")
    g.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (with --sample)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (with --sample; 1: off)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (with --sample; 0: off)")
    g.add_argument("--seed", type=int, default=0, help="random seed for --sample (same seed, same outputs)")
    g.add_argument("--instruction", action="store_true",
                   help="wrap each prompt in the instruction template bigtune trains alpaca data with")
    g.add_argument("--out", metavar="FILE", help="write the results to FILE (.jsonl: {prompt, output} per line, or "
                   ".csv) instead of printing them")
    g.set_defaults(func=main_generate)
    e = subparsers.add_parser("eval", help="score a trained model on a data source: loss and perplexity; "
                              "classifiers: accuracy, macro-F1, confusion matrix; image-to-text: BLEU, ROUGE-L")
    _add_load_args(e)
    e.add_argument("--data", default="demo", metavar="SOURCE",
                   help="data source, as data.source in a recipe (default: the bundled demo set of the model's "
                        "kind)")
    e.add_argument("--max-seq-length", type=int, default=512, help="truncate samples to this many tokens")
    e.add_argument("--batch-size", type=int, default=8, help="samples per forward pass (default 8)")
    e.add_argument("--no-mask-prompt", action="store_true",
                   help="alpaca data: score the prompt tokens too (default: the response only, as in training)")
    e.add_argument("--text-field", default="text", help="classification / image-to-text data: the text or caption "
                   "column (default: text)")
    e.add_argument("--label-field", default="label", help="classification data: the label column (default: label)")
    e.add_argument("--max-new-tokens", type=int, default=30, help="image-to-text: caption tokens at most (default 30)")
    e.add_argument("--json", action="store_true", help="print the result as JSON")
    e.set_defaults(func=main_eval)
