"""Task metrics, computed by maintained libraries (torchmetrics, sacrebleu, rouge-score) where one exists.

* classification: accuracy, macro-F1 (every class weighs the same, so a model that ignores a rare
  class is seen), per-class F1 and the confusion matrix (rows: true class, columns: predicted);
* captions: corpus BLEU (sacrebleu's default 13a tokenisation, 0-100, several references per image
  allowed), ROUGE-L F-measure (rouge-score, best reference per image, averaged), and the length in
  words of the generated and the reference captions, and CIDEr-D (``cider_d`` below). METEOR and SPICE
  are left out: their implementations need Java or a WordNet download.

CIDEr-D is the one metric computed here: the reference implementation (pycocoevalcap 1.2, last released in
2020) is a 104 MB wheel whose tokenizer needs Java, and the maintained alternatives pull in sentence
encoders. ``cider_d`` follows pycocoevalcap's CiderScorer rule for rule (tests/test_metrics.py checks it
against values that scorer printed); only the Java PTB tokenizer is replaced by a lower-case word split
that drops the same punctuation marks.

Each library is imported inside the function that needs it, with an error naming the ``pip install``.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter
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
        "cider_d": cider_d(predictions, references) if len(predictions) > 1 else None,
        "captions": len(predictions),
        "references_per_caption": statistics.fmean(len(r) for r in references),
        "caption_length_words": length_stats(predictions),
        "reference_length_words": length_stats([c for refs in references for c in refs]),
    }


# Words: runs of letters and digits, an apostrophe allowed inside ("don't" stays one word; the Java PTB
# tokenizer pycocoevalcap runs splits it as "do n't", and keeps hyphenated words whole, which this splits).
# Every other mark is dropped, as that tokenizer's punctuation list drops them.
_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)*")


def caption_tokens(text: str) -> list[str]:
    """Lower-case words of a caption with punctuation removed (CIDEr-D's input)."""
    return _WORD.findall(text.lower())


def _ngrams(words: Sequence[str], n: int = 4) -> Counter:
    return Counter(tuple(words[i : i + k]) for k in range(1, n + 1) for i in range(len(words) - k + 1))


def cider_d(predictions: Sequence[str], references: Sequence[Sequence[str]], n: int = 4, sigma: float = 6.0) -> float:
    """Corpus CIDEr-D (Vedantam et al., 2015, as the COCO caption evaluation computes it), on its usual
    0-10 scale. Each caption and reference becomes TF-IDF vectors of its 1..n-grams, the document
    frequencies counted over the corpus's reference sets (so the corpus must hold at least two images:
    with one, every n-gram is in every "document" and all weights are 0). Per n, the similarity is the
    cosine with the candidate's weights clipped at the reference's (so repeating a word cannot inflate
    it), times a Gaussian penalty on the length difference (sigma words); the n's are averaged, the
    references averaged, times 10."""
    docs = [[_ngrams(caption_tokens(r), n) for r in refs] for refs in references]
    df: Counter = Counter()
    for refs in docs:
        df.update({g for r in refs for g in r})
    log_docs = math.log(len(docs))

    def vectors(counts: Counter):
        # pycocoevalcap measures the length by the bigram count (words - 1); the difference is the same
        vec = [dict() for _ in range(n)]
        for g, tf in counts.items():
            vec[len(g) - 1][g] = tf * (log_docs - math.log(max(1.0, df[g])))
        norms = [math.sqrt(sum(w * w for w in v.values())) for v in vec]
        return vec, norms, sum(tf for g, tf in counts.items() if len(g) == 2)

    scores = []
    for pred, refs in zip(predictions, docs):
        vh, nh, lh = vectors(_ngrams(caption_tokens(pred), n))
        total = [0.0] * n
        for ref in refs:
            vr, nr, lr = vectors(ref)
            penalty = math.exp(-((lh - lr) ** 2) / (2 * sigma**2))
            for k in range(n):
                dot = sum(min(w, vr[k].get(g, 0.0)) * vr[k].get(g, 0.0) for g, w in vh[k].items())
                if nh[k] and nr[k]:
                    dot /= nh[k] * nr[k]
                total[k] += dot * penalty
        scores.append(10.0 * statistics.fmean(total) / len(refs))
    return statistics.fmean(scores)


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
