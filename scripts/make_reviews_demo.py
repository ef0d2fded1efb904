"""Regenerate the bundled text-classification demo: short food reviews labelled by sentiment.

    python scripts/make_reviews_demo.py

Writes src/bigtune/assets/demo_reviews.jsonl: 480 reviews ({"text", "label"}; labels negative /
neutral / positive, deliberately unbalanced so the majority-class baseline is well below 1), plus two
malformed records (an empty text, a missing label) that training must skip and count. Each review
pairs a dish with a phrase whose words carry the sentiment, so a tiny random-init classifier learns
the set within a minute on a CPU. Deterministic (seeded), no downloads; the file is committed and a
test checks it is reproducible.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "bigtune" / "assets" / "demo_reviews.jsonl"

DISHES = [
    "tomato soup",
    "pad thai",
    "caesar salad",
    "margherita pizza",
    "sushi roll",
    "chocolate cake",
    "guacamole",
    "pancakes",
    "ramen",
    "falafel",
    "paella",
    "lemon tart",
    "beef tacos",
    "greek salad",
    "mango sorbet",
    "fried rice",
    "burger",
    "lasagna",
    "curry",
    "dumplings",
]
PHRASES = {
    "positive": [
        "was delicious",
        "tasted amazing",
        "was fresh and wonderful",
        "was excellent, we loved it",
        "was perfect",
        "was great and the service was friendly",
        "is the best in town",
        "was tasty, highly recommended",
        "was superb",
        "made us happy",
    ],
    "negative": [
        "was cold and bland",
        "tasted awful",
        "was stale and greasy",
        "was terrible, never again",
        "was burnt",
        "was disgusting and the service was rude",
        "is the worst in town",
        "was soggy, not recommended",
        "was inedible",
        "made us sick",
    ],
    "neutral": [
        "was okay",
        "was average",
        "was fine, nothing special",
        "was ordinary",
        "was acceptable",
        "was decent but forgettable",
    ],
}
OPENERS = ["The", "Our", "My", "Their"]
ENDINGS = [".", "!", ". We ate it on Friday.", ". Portions were normal."]
COUNTS = {"positive": 216, "negative": 168, "neutral": 96}  # 45% / 35% / 20%


def reviews(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for label, n in COUNTS.items():
        for _ in range(n):
            text = f"{rng.choice(OPENERS)} {rng.choice(DISHES)} {rng.choice(PHRASES[label])}{rng.choice(ENDINGS)}"
            rows.append({"text": text, "label": label})
    rng.shuffle(rows)
    # Two broken records, as real exports have: training skips and counts them.
    rows.insert(17, {"text": "", "label": "positive"})
    rows.insert(230, {"text": "The ramen was delicious."})
    return rows


def main() -> int:
    OUT.write_text("".join(json.dumps(r) + "\n" for r in reviews()), encoding="utf-8")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
