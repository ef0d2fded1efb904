"""Task metrics, computed by maintained libraries (torchmetrics, sacrebleu, rouge-score), never by hand.

* classification: accuracy, macro-F1 (every class weighs the same, so a model that ignores a rare
  class is seen), per-class F1 and the confusion matrix (rows: true class, columns: predicted);
* captions: corpus BLEU (sacrebleu's default 13a tokenisation, 0-100, several references per image
  allowed), ROUGE-L F-measure (rouge-score, best reference per image, averaged), and the length in
  words of the generated and the reference captions. CIDEr and METEOR are left out: their usual
  implementations need Java (pycocoevalcap's tokenizer) or a WordNet download.

Each library is imported inside the function that needs it, with an error naming the ``pip install``.
"""

from __future__ import annotations

import statistics
from typing import Optional, Sequence


def _need(module: str, package: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{module} is needed for these metrics: pip install {package} (or reinstall bigtune, which depends on it)"
        ) from e


def classification_metrics(y_true: Sequence[int], y_pred: Sequence[int], label_names: Sequence[str]) -> dict:
    """accuracy, macro_f1, per-class F1 and the confusion matrix over class indices 0..K-1.

    torchmetrics (Lightning's own metrics library; scikit-learn would add SciPy to every install, and
    Lightning then imports SciPy at start-up: +1.4 s on every command). Macro-F1 is the plain mean of
    the per-class F1 over all K classes, a class never seen nor predicted counting 0 (scikit-learn's
    zero_division=0), so a model that ignores a class is penalised.
    """
    import torch

    _need("torchmetrics", "torchmetrics")
    from torchmetrics.functional.classification import (
        multiclass_accuracy,
        multiclass_confusion_matrix,
        multiclass_f1_score,
    )

    k = len(label_names)
    if not len(y_true):
        raise ValueError("classification_metrics: no samples to score")
    t = torch.tensor([int(x) for x in y_true])
    p = torch.tensor([int(x) for x in y_pred])
    per_class = multiclass_f1_score(p, t, num_classes=k, average="none", zero_division=0).tolist()
    return {
        "accuracy": float(multiclass_accuracy(p, t, num_classes=k, average="micro")),
        "macro_f1": float(sum(per_class) / k),
        "f1_per_class": {str(n): float(f) for n, f in zip(label_names, per_class)},
        "confusion_matrix": multiclass_confusion_matrix(p, t, num_classes=k).tolist(),
        "label_names": [str(n) for n in label_names],
        "samples": len(y_true),
    }


def majority_baseline(y_true: Sequence[int]) -> float:
    """Accuracy of always predicting the most frequent class (what a classifier must beat)."""
    if not y_true:
        raise ValueError("majority_baseline: no samples")
    counts: dict[int, int] = {}
    for y in y_true:
        counts[int(y)] = counts.get(int(y), 0) + 1
    return max(counts.values()) / len(y_true)


def length_stats(texts: Sequence[str]) -> dict:
    """Words per text: mean, median, min, max (whitespace split)."""
    n = [len(t.split()) for t in texts]
    if not n:
        return {"mean": None, "median": None, "min": None, "max": None}
    return {"mean": statistics.fmean(n), "median": float(statistics.median(n)), "min": min(n), "max": max(n)}


def caption_metrics(
    predictions: Sequence[str], references: Sequence[Sequence[str]], rouge_stemmer: bool = True
) -> dict:
    """Corpus BLEU and mean ROUGE-L F1 of ``predictions`` against ``references`` (one list of reference
    captions per prediction, of any length >= 1), plus caption length stats."""
    if len(predictions) != len(references):
        raise ValueError(f"caption_metrics: {len(predictions)} predictions but {len(references)} reference lists")
    if not predictions:
        raise ValueError("caption_metrics: no captions to score")
    if any(not refs for refs in references):
        raise ValueError("caption_metrics: every prediction needs at least one reference caption")
    _need("sacrebleu", "sacrebleu")
    _need("rouge_score", "rouge-score")
    from rouge_score import rouge_scorer
    from sacrebleu.metrics import BLEU

    # sacrebleu takes reference *streams*; images with fewer references are padded with None.
    width = max(len(r) for r in references)
    streams = [[refs[k] if k < len(refs) else None for refs in references] for k in range(width)]
    metric = BLEU()
    bleu = metric.corpus_score(list(predictions), streams)
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=rouge_stemmer)
    rouge = [scorer.score_multi(list(refs), pred)["rougeL"].fmeasure for pred, refs in zip(predictions, references)]
    return {
        "bleu": float(bleu.score),
        "bleu_signature": str(metric.get_signature()),
        "rouge_l": float(statistics.fmean(rouge)),
        "captions": len(predictions),
        "references_per_caption": statistics.fmean(len(r) for r in references),
        "caption_length_words": length_stats(predictions),
        "reference_length_words": length_stats([c for refs in references for c in refs]),
    }


def format_classification(m: dict, prefix: Optional[str] = None) -> str:
    """A few lines: accuracy, macro-F1 and the confusion matrix with class names."""
    names = m["label_names"]
    width = max(8, *(len(n) for n in names))
    lines = [
        f"{prefix + ': ' if prefix else ''}accuracy {m['accuracy']:.4f}, macro-F1 {m['macro_f1']:.4f} over "
        f"{m['samples']} samples",
        "confusion matrix (rows: true, columns: predicted):",
        " " * (width + 2) + "".join(f"{n:>{width + 2}}" for n in names),
    ]
    for n, row in zip(names, m["confusion_matrix"]):
        lines.append(f"  {n:<{width}}" + "".join(f"{v:>{width + 2}}" for v in row))
    return "\n".join(lines)
