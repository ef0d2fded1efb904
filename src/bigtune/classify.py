"""Text classification (``model.family: sequence-classification``): labelled data, `bigtune predict`,
and the classifier side of `bigtune eval`.

Data: records with a text column (``data.text_field``) and a label column (``data.label_field``),
from any source bigtune reads (``demo`` is the bundled food-review sentiment set). A label is a
class name from ``data.label_names`` or an integer index into them; with no label_names the classes
are the sorted distinct labels of the training data (integers sort as numbers), and the resolved
names are written back into the run's recipe.yaml so validation, eval and predict use the same ones.
A record with no text or no label is skipped and counted; a label that is not a known class is an
error naming the file, record and line, because it usually means the names do not match the data.

A sample is ``BOS + text + EOS`` (truncated to ``data.max_seq_length``): BERT's pooler reads position
0, where BOS stands in for [CLS]; Llama-style heads pool the last non-pad token.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

from bigtune.presets import DEMO_CLASSIFICATION_DATA
from bigtune.recipe import DataConfig

# torch and bigtune.data are imported inside the functions: `bigtune --help` registers this module's verb.

# -- labels ------------------------------------------------------------------------------------------


def _label_key(value: Any) -> tuple[Any, str]:
    """(int or str label, '') or (None, reason). Integral floats (CSV/pandas) count as integers."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None, "missing"
    if isinstance(value, bool):
        return None, f"label {value!r} is a boolean; use class names or integer indices"
    if isinstance(value, int):
        return value, ""
    if isinstance(value, float) and value.is_integer():
        return int(value), ""
    if isinstance(value, str):
        return value.strip(), ""
    return None, f"label {value!r} ({type(value).__name__}) is neither a class name nor an integer index"


def _where(source: str, index: int) -> str:
    """'FILE record I (line L)' where the line is known (JSONL, CSV without multi-line cells)."""
    path = Path(source)
    line = None
    if path.suffix.lower() == ".jsonl" and path.is_file():
        seen = -1
        with path.open(encoding="utf-8") as fh:
            for lineno, text in enumerate(fh, 1):
                if text.strip():
                    seen += 1
                    if seen == index:
                        line = lineno
                        break
    elif path.suffix.lower() == ".csv":
        line = index + 2  # after the header
    return f"{source} record {index}" + (f" (line {line})" if line else "")


def infer_label_names(keys: list[Any], source: str) -> list[str]:
    """Sorted distinct labels: integers as numbers, text alphabetically; a mix is an error."""
    from bigtune.data import DataError

    ints = {k for k in keys if isinstance(k, int)}
    strs = {k for k in keys if isinstance(k, str)}
    if ints and strs:
        raise DataError(f"{source}: labels mix integers ({sorted(ints)[:5]}) and names ({sorted(strs)[:5]}); use one "
                        "kind, or set data.label_names so integers are read as indices into them")
    names = [str(k) for k in sorted(ints)] if ints else sorted(strs)
    if len(names) < 2:
        raise DataError(f"{source}: every usable record has the label {names[0]!r}; a classifier needs at least 2 "
                        "classes (check data.label_field)")
    return names


class LabelMap:
    """Label value → class index for a fixed list of class names."""

    def __init__(self, names: list):
        self.names = [str(n) for n in names]
        self.by_name = {n: i for i, n in enumerate(self.names)}
        # Names like 1..5 (star ratings): an integer label is matched by name, not used as an index.
        self.numeric_names = all(n.lstrip("-").isdigit() for n in self.names)

    def index(self, key: Any) -> Optional[int]:
        if isinstance(key, int):
            if self.numeric_names:
                return self.by_name.get(str(key))
            return key if 0 <= key < len(self.names) else None
        return self.by_name.get(key)


def encode_text(tok, text: str, max_len: int) -> tuple[list[int], bool]:
    """(BOS + text + EOS truncated to max_len, truncated?) — the same for training, eval and predict."""
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    ids = bos + tok(text, add_special_tokens=False)["input_ids"] + eos
    return ids[:max_len], len(ids) > max_len


def build_classification_examples(cfg: DataConfig, tok, seed: int):
    """(examples, DataReport): read, check and tokenize text + label records, split off validation,
    select num_train_samples. ``Example.labels`` is ``[class index]``; the report's label_names are
    cfg.label_names, or inferred.
    """
    from bigtune.data import DataError, DataReport, Example, no_samples_error, read_source, split_and_select

    if cfg.source == "demo":
        cfg = dataclasses.replace(cfg, source=str(DEMO_CLASSIFICATION_DATA))
    source, records = read_source(cfg)
    if records and isinstance(records[0], str):
        raise DataError(f"{source}: a plain text file has no labels; classification needs records with "
                        f"{cfg.text_field!r} and {cfg.label_field!r} (.jsonl, .csv, .parquet, save_to_disk)")
    if not records:
        raise DataError(f"{source}: no usable samples (the source holds no records)")
    report = DataReport(source=source, format="classification", records=len(records))
    rows: list[tuple[int, str, Any]] = []
    for i, rec in enumerate(records):
        reason = ""
        if not isinstance(rec, dict):
            reason = f"not an object ({type(rec).__name__})"
        else:
            text = rec.get(cfg.text_field)
            key, why = _label_key(rec.get(cfg.label_field))
            if not isinstance(text, str):
                reason = f"missing text field {cfg.text_field!r}"
            elif not text.strip():
                reason = "empty text"
            elif why == "missing":
                reason = f"missing label field {cfg.label_field!r}"
            elif why:
                raise DataError(f"{_where(source, i)}: {why}; fix the record")
        if reason:
            if not cfg.skip_bad_records:
                raise DataError(f"{_where(source, i)}: {reason}; fix the record or set data.skip_bad_records=true")
            report.skipped.append((i, reason))
            continue
        rows.append((i, text, key))
    if not rows:
        raise no_samples_error(source, report)
    names = [str(n) for n in cfg.label_names] if cfg.label_names else infer_label_names([k for _, _, k in rows],
                                                                                        source)
    labels = LabelMap(names)
    examples: list[Example] = []
    counts = {n: 0 for n in names}
    for i, text, key in rows:
        y = labels.index(key)
        if y is None:
            raise DataError(f"{_where(source, i)}: label {key!r} is not one of data.label_names {names}; fix the "
                            "record, or correct data.label_names (integers are indices into it)")
        ids, truncated = encode_text(tok, text, cfg.max_seq_length)
        report.truncated += int(truncated)
        examples.append(Example(ids, [y]))
        counts[names[y]] += 1
    report.label_names, report.label_counts = names, counts
    return split_and_select(examples, report, cfg, seed), report


class ClassificationCollator:
    """Right-pads input_ids (mask 0); labels are one class index per sample, shape (batch,)."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, batch: list) -> dict[str, Any]:
        import torch

        n = max(len(e.input_ids) for e in batch)
        ids = torch.full((len(batch), n), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), n), dtype=torch.long)
        for i, e in enumerate(batch):
            ids[i, :len(e.input_ids)] = torch.tensor(e.input_ids, dtype=torch.long)
            mask[i, :len(e.input_ids)] = 1
        labels = torch.tensor([e.labels[0] for e in batch], dtype=torch.long)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels,
                "padded": any(len(e.input_ids) < n for e in batch)}


def classification_data(recipe, tokenizer):
    """The engine's data hooks for the family: (examples, report, dataset factory, collator, builder
    for a validation source). Inferred label names are stored in ``recipe.data.label_names``, so the
    run's recipe.yaml, its validation source and its saved config all use the same classes."""
    from bigtune.data import ListDataset

    examples, report = build_classification_examples(recipe.data, tokenizer, recipe.seed)
    if not recipe.data.label_names:
        recipe.data.label_names = list(report.label_names)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return examples, report, ListDataset, ClassificationCollator(pad), \
        (lambda cfg: build_classification_examples(cfg, tokenizer, recipe.seed))


# -- using a trained classifier -------------------------------------------------------------------------


def _config_of(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}


def is_classifier_folder(folder: Path) -> bool:
    archs = _config_of(folder).get("architectures") or []
    return any(str(a).endswith("ForSequenceClassification") for a in archs)


def _run_label_names(run: Path) -> list[str]:
    import yaml

    try:
        recipe = yaml.safe_load((run / "recipe.yaml").read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        return []
    return [str(n) for n in ((recipe.get("data") or {}).get("label_names") or [])]


def load_classifier(path_or_run: str, dtype: str = "auto", device: str = "auto"):
    """(model, tokenizer, label names) in eval mode from a model folder, run directory or adapter folder."""
    from transformers import AutoModelForSequenceClassification

    from bigtune.infer import InferError, _adapter_base, _load_tokenizer, _resolve_device, _torch_dtype, \
        attach_adapter, locate_model
    from bigtune.models import label_config

    folder, adapter = locate_model(path_or_run)
    device = _resolve_device(device)
    torch_dtype = _torch_dtype(dtype, device)

    def load(source: str, names: Optional[list] = None):
        from bigtune.models import hub_kwargs

        try:
            return AutoModelForSequenceClassification.from_pretrained(
                source, dtype=torch_dtype, use_safetensors=True, trust_remote_code=False, **label_config(names),
                **hub_kwargs(source))
        except Exception as e:
            raise InferError(f"could not load a sequence-classification model from {source!r} "
                             f"({type(e).__name__}: {str(e)[:300]})") from e

    if folder is not None:
        if not is_classifier_folder(folder):
            raise InferError(f"{folder} is not a sequence-classification model (config.json architectures: "
                             f"{_config_of(folder).get('architectures')}); use `bigtune generate` for language "
                             "models, `bigtune caption` for image-to-text ones")
        model, tok = load(str(folder)), _load_tokenizer(folder)
    else:
        base = _adapter_base(adapter)
        model = attach_adapter(load(base, _run_label_names(adapter.parent) or None), adapter, base)
        tok = _load_tokenizer(adapter, base if Path(base).is_dir() else None)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    config = model.config
    if config.pad_token_id is None:
        config.pad_token_id = tok.pad_token_id
    names = [str(config.id2label[i]) for i in range(config.num_labels)]
    return model.to(device).eval(), tok, names


def _max_len(model, wanted: int) -> int:
    limit = getattr(model.config, "max_position_embeddings", None)
    return min(wanted, limit) if limit else wanted


def predict_proba(model, tok, texts: list[str], batch_size: int = 32, max_seq_length: int = 512,
                  progress: bool = True):
    """Class probabilities (a float32 tensor, len(texts) × classes), in input order."""
    import torch

    from bigtune.data import Example

    device = next(model.parameters()).device
    collate = ClassificationCollator(tok.pad_token_id if tok.pad_token_id is not None else 0)
    n = _max_len(model, max_seq_length)
    out = []
    t0 = time.perf_counter()
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            chunk = [Example(encode_text(tok, t, n)[0], [0]) for t in texts[start:start + batch_size]]
            batch = collate(chunk)
            logits = model(input_ids=batch["input_ids"].to(device),
                           attention_mask=batch["attention_mask"].to(device)).logits
            out.append(torch.softmax(logits.float(), dim=-1).cpu())
            if progress and len(texts) > batch_size:
                done = min(start + batch_size, len(texts))
                print(f"predict: {done}/{len(texts)} texts ({time.perf_counter() - t0:.1f} s)", file=sys.stderr,
                      flush=True)
    return torch.cat(out) if out else torch.zeros((0, model.config.num_labels))


def evaluate_classifier(model, tok, label_names: list[str], data_source: str, text_field: str = "text",
                        label_field: str = "label", batch_size: int = 32, max_seq_length: int = 512) -> dict:
    """Accuracy, macro-F1, confusion matrix and mean cross-entropy of a classifier on labelled data
    (read as for training, with the model's own classes; bad records skipped and counted)."""
    import torch

    from bigtune.metrics import classification_metrics, majority_baseline

    cfg = DataConfig(source=data_source, text_field=text_field, label_field=label_field,
                     label_names=list(label_names), max_seq_length=_max_len(model, max_seq_length))
    examples, report = build_classification_examples(cfg, tok, seed=0)
    probs = []
    device = next(model.parameters()).device
    collate = ClassificationCollator(tok.pad_token_id if tok.pad_token_id is not None else 0)
    with torch.no_grad():
        for start in range(0, len(examples), batch_size):
            batch = collate(examples[start:start + batch_size])
            logits = model(input_ids=batch["input_ids"].to(device),
                           attention_mask=batch["attention_mask"].to(device)).logits
            probs.append(torch.softmax(logits.float(), dim=-1).cpu())
    p = torch.cat(probs)
    y = torch.tensor([e.labels[0] for e in examples])
    loss = float(torch.nn.functional.nll_loss(torch.log(p.clamp_min(1e-12)), y))
    m = classification_metrics(y.tolist(), p.argmax(-1).tolist(), label_names)
    return {**m, "loss": loss, "majority_baseline": majority_baseline(y.tolist()), "skipped": len(report.skipped),
            "source": report.source}


# -- `bigtune predict` ----------------------------------------------------------------------------------


def read_texts(path: str, text_field: str) -> list[str]:
    """The text column of a .csv or .jsonl file, in order; a row without text is an error with its line."""
    from bigtune.infer import InferError

    p = Path(path).expanduser()
    if not p.is_file():
        raise InferError(f"{path}: no such file; give a .csv or .jsonl with a {text_field!r} column")
    suffix = p.suffix.lower()
    texts: list[str] = []
    if suffix == ".csv":
        with p.open(encoding="utf-8", newline="") as fh:
            reader = csv.DictReader(fh)
            if reader.fieldnames is None or text_field not in reader.fieldnames:
                raise InferError(f"{p}: no {text_field!r} column (columns: {reader.fieldnames}); pass "
                                 "--text-field NAME")
            for row in reader:
                text = row.get(text_field)
                if not text or not text.strip():
                    raise InferError(f"{p} line {reader.line_num}: empty {text_field!r}; fill it or delete the row")
                texts.append(text)
    elif suffix == ".jsonl":
        with p.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InferError(f"{p} line {lineno}: not valid JSON ({e.msg})") from None
                text = rec.get(text_field) if isinstance(rec, dict) else None
                if not isinstance(text, str) or not text.strip():
                    raise InferError(f"{p} line {lineno}: no text {text_field!r} field; add one or pass "
                                     "--text-field NAME")
                texts.append(text)
    else:
        raise InferError(f"{path}: unknown extension {suffix!r}; give a .csv or .jsonl file")
    if not texts:
        raise InferError(f"{path}: holds no rows")
    return texts


def prediction_rows(texts: list[str], probs, names: list[str]) -> list[dict]:
    rows = []
    for text, p in zip(texts, probs.tolist()):
        best = max(range(len(names)), key=lambda i: p[i])
        rows.append({"text": text, "label": names[best], **{f"prob_{n}": round(v, 6) for n, v in zip(names, p)}})
    return rows


def main_predict(args) -> int:
    from bigtune.infer import InferError, _atomic_write

    if args.batch_size < 1:
        raise InferError(f"--batch-size must be at least 1, got {args.batch_size}")
    kind = Path(args.out).suffix.lower() if args.out else None
    if kind not in (None, ".csv", ".jsonl"):
        raise InferError(f"--out {args.out}: use a .csv or .jsonl file")
    texts = read_texts(args.input, args.text_field)
    model, tok, names = load_classifier(args.model, dtype=args.dtype, device=args.device)
    probs = predict_proba(model, tok, texts, args.batch_size, args.max_seq_length)
    rows = prediction_rows(texts, probs, names)
    if kind == ".jsonl":
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    else:
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
        text = buf.getvalue()
    if args.out:
        _atomic_write(Path(args.out), text)  # temp file, then rename: never half-written
        print(f"predict: {len(rows)} texts labelled ({', '.join(names)}) to {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def add_cli(subparsers) -> None:
    """Add the ``predict`` verb to bigtune's argparse subparsers."""
    p = subparsers.add_parser("predict", help="label texts with a trained classifier (CSV/JSONL in, labels and "
                              "per-class probabilities out)")
    p.add_argument("input", metavar="FILE", help="a .csv or .jsonl file with a text column")
    p.add_argument("--model", required=True, metavar="RUN_OR_FOLDER",
                   help="a bigtune run directory (runs/NAME), its model/ folder, or an adapter folder")
    p.add_argument("--out", metavar="FILE", help="labels.csv (text, label, prob_<class>...) or .jsonl (default: "
                   "CSV on stdout)")
    p.add_argument("--text-field", default="text", help="column holding the text (default: text)")
    p.add_argument("--batch-size", type=int, default=32, help="texts per forward pass (default 32)")
    p.add_argument("--max-seq-length", type=int, default=512, help="truncate texts to this many tokens")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="weights dtype (auto: the checkpoint's on a GPU, float32 on a CPU)")
    p.add_argument("--device", default="auto", help="cpu, cuda, ... (auto: a GPU if there is one)")
    p.set_defaults(func=main_predict)
