"""A trained classifier (``model.family: sequence-classification``) in use: loading it, class
probabilities for texts (``bigtune predict``) and its side of ``bigtune eval`` (accuracy, macro-F1,
confusion matrix). The labelled training data is ``bigtune.data.labels``.

A sample is ``BOS + text + EOS`` (truncated to ``data.max_seq_length``): BERT's pooler reads position
0, where BOS stands in for [CLS]; Llama-style heads pool the last non-pad token.
"""

from __future__ import annotations

import csv
import json
import sys
import time
from pathlib import Path
from typing import Optional

from bigtune.data.labels import ClassificationCollator, build_classification_examples, encode_text
from bigtune.recipe import DataConfig


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

    from bigtune.models.build import label_config
    from bigtune.use.loading import (
        InferError,
        adapter_base,
        attach_adapter,
        load_saved_tokenizer,
        locate_model,
        resolve_device,
        resolve_dtype,
    )

    folder, adapter = locate_model(path_or_run)
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)

    def load(source: str, names: Optional[list] = None):
        from bigtune.core.hub import hub_kwargs

        try:
            return AutoModelForSequenceClassification.from_pretrained(
                source,
                dtype=torch_dtype,
                use_safetensors=True,
                trust_remote_code=False,
                **label_config(names),
                **hub_kwargs(source),
            )
        except Exception as e:
            raise InferError(
                f"could not load a sequence-classification model from {source!r} ({type(e).__name__}: {str(e)[:300]})"
            ) from e

    if folder is not None:
        if not is_classifier_folder(folder):
            raise InferError(
                f"{folder} is not a sequence-classification model (config.json architectures: "
                f"{_config_of(folder).get('architectures')}); use `bigtune generate` for language "
                "models, `bigtune caption` for image-to-text ones"
            )
        model, tok = load(str(folder)), load_saved_tokenizer(folder)
    else:
        base = adapter_base(adapter)
        model = attach_adapter(load(base, _run_label_names(adapter.parent) or None), adapter, base)
        tok = load_saved_tokenizer(adapter, base if Path(base).is_dir() else None)
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


def predict_proba(model, tok, texts: list[str], batch_size: int = 32, max_seq_length: int = 512, progress: bool = True):
    """Class probabilities (a float32 tensor, len(texts) × classes), in input order."""
    import torch

    from bigtune.data.text import Example

    device = next(model.parameters()).device
    collate = ClassificationCollator(tok.pad_token_id if tok.pad_token_id is not None else 0)
    n = _max_len(model, max_seq_length)
    out = []
    t0 = time.perf_counter()
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            chunk = [Example(encode_text(tok, t, n)[0], [0]) for t in texts[start : start + batch_size]]
            batch = collate(chunk)
            logits = model(
                input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)
            ).logits
            out.append(torch.softmax(logits.float(), dim=-1).cpu())
            if progress and len(texts) > batch_size:
                done = min(start + batch_size, len(texts))
                print(
                    f"predict: {done}/{len(texts)} texts ({time.perf_counter() - t0:.1f} s)",
                    file=sys.stderr,
                    flush=True,
                )
    return torch.cat(out) if out else torch.zeros((0, model.config.num_labels))


def evaluate_classifier(
    model,
    tok,
    label_names: list[str],
    data_source: str,
    text_field: str = "text",
    label_field: str = "label",
    batch_size: int = 32,
    max_seq_length: int = 512,
) -> dict:
    """Accuracy, macro-F1, confusion matrix and mean cross-entropy of a classifier on labelled data
    (read as for training, with the model's own classes; bad records skipped and counted)."""
    import torch

    from bigtune.core.metrics import classification_metrics, majority_baseline

    cfg = DataConfig(
        source=data_source,
        text_field=text_field,
        label_field=label_field,
        label_names=list(label_names),
        max_seq_length=_max_len(model, max_seq_length),
    )
    examples, report = build_classification_examples(cfg, tok, seed=0)
    probs = []
    device = next(model.parameters()).device
    collate = ClassificationCollator(tok.pad_token_id if tok.pad_token_id is not None else 0)
    with torch.no_grad():
        for start in range(0, len(examples), batch_size):
            batch = collate(examples[start : start + batch_size])
            logits = model(
                input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)
            ).logits
            probs.append(torch.softmax(logits.float(), dim=-1).cpu())
    p = torch.cat(probs)
    y = torch.tensor([e.labels[0] for e in examples])
    loss = float(torch.nn.functional.nll_loss(torch.log(p.clamp_min(1e-12)), y))
    m = classification_metrics(y.tolist(), p.argmax(-1).tolist(), label_names)
    return {
        **m,
        "loss": loss,
        "majority_baseline": majority_baseline(y.tolist()),
        "skipped": len(report.skipped),
        "source": report.source,
    }


def read_texts(path: str, text_field: str) -> list[str]:
    """The text column of a .csv or .jsonl file, in order; a row without text is an error with its line."""
    from bigtune.use.loading import InferError

    p = Path(path).expanduser()
    if not p.is_file():
        raise InferError(f"{path}: no such file; give a .csv or .jsonl with a {text_field!r} column")
    suffix = p.suffix.lower()
    texts: list[str] = []
    if suffix == ".csv":
        with p.open(encoding="utf-8", newline="") as fh:
            reader = csv.DictReader(fh)
            if reader.fieldnames is None or text_field not in reader.fieldnames:
                raise InferError(
                    f"{p}: no {text_field!r} column (columns: {reader.fieldnames}); pass --text-field NAME"
                )
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
                    raise InferError(f"{p} line {lineno} column {e.colno}: not valid JSON ({e.msg})") from None
                text = rec.get(text_field) if isinstance(rec, dict) else None
                if not isinstance(text, str) or not text.strip():
                    raise InferError(
                        f"{p} line {lineno}: no text {text_field!r} field; add one or pass --text-field NAME"
                    )
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
