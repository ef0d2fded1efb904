"""Regenerate the bundled demo data and the tiny tokenizer (deterministic; no downloads).

    python scripts/make_assets.py

Writes src/bigtune/assets/demo_alpaca.jsonl (instruction data about food, templated so a tiny
model's loss falls visibly within a minute on a CPU) and src/bigtune/assets/tiny_tokenizer.json
(a byte-level BPE trained on that data). Both are committed; tests check they are reproducible.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "src" / "bigtune" / "assets"

DISHES = {
    "tomato soup": ("red", "soup", "tomatoes, onion and basil"),
    "pad thai": ("orange", "noodles", "rice noodles, egg, tofu and peanuts"),
    "caesar salad": ("green", "salad", "romaine, croutons, parmesan and dressing"),
    "margherita pizza": ("red", "pizza", "tomato, mozzarella and basil"),
    "sushi roll": ("white", "rice", "rice, nori, cucumber and salmon"),
    "chocolate cake": ("brown", "dessert", "cocoa, flour, eggs and butter"),
    "guacamole": ("green", "dip", "avocado, lime, onion and cilantro"),
    "pancakes": ("golden", "breakfast", "flour, milk, eggs and syrup"),
    "ramen": ("brown", "noodles", "wheat noodles, broth, egg and scallions"),
    "falafel": ("brown", "street food", "chickpeas, parsley and garlic"),
    "paella": ("yellow", "rice", "rice, saffron, shrimp and peas"),
    "lemon tart": ("yellow", "dessert", "lemon curd and shortcrust pastry"),
    "beef tacos": ("brown", "street food", "tortillas, beef, salsa and cheese"),
    "greek salad": ("green", "salad", "tomato, cucumber, olives and feta"),
    "mango sorbet": ("orange", "dessert", "mango, sugar and lime"),
    "fried rice": ("golden", "rice", "rice, egg, peas and soy sauce"),
}
PLURALS = {
    "apple": "apples",
    "cherry": "cherries",
    "potato": "potatoes",
    "loaf": "loaves",
    "knife": "knives",
    "dish": "dishes",
    "berry": "berries",
    "peach": "peaches",
    "leaf": "leaves",
    "tomato": "tomatoes",
}


def records(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    dishes = sorted(DISHES)
    out = []
    for i in range(n):
        kind = i % 5
        if kind == 0:
            d = rng.choice(dishes)
            out.append(
                {
                    "instruction": "Write alt text for a photo of this dish.",
                    "input": d,
                    "output": f"A plate of {d}, {DISHES[d][0]} in color, served fresh.",
                }
            )
        elif kind == 1:
            d = rng.choice(dishes)
            out.append({"instruction": "List the main ingredients.", "input": d, "output": DISHES[d][2] + "."})
        elif kind == 2:
            a, b = rng.randint(1, 20), rng.randint(1, 20)
            out.append(
                {
                    "instruction": f"How many plates are there if a table has {a} and another has {b}?",
                    "input": "",
                    "output": f"There are {a + b} plates.",
                }
            )
        elif kind == 3:
            w = rng.choice(sorted(PLURALS))
            out.append({"instruction": "Give the plural of the word.", "input": w, "output": PLURALS[w]})
        else:
            d = rng.choice(dishes)
            out.append(
                {
                    "instruction": "What kind of food is this?",
                    "input": d,
                    "output": f"{d.capitalize()} is a {DISHES[d][1]}.",
                }
            )
    return out


def write_data(path: Path) -> None:
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records(640)))


def write_tokenizer(data: Path, path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        min_frequency=1,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = []
    for line in data.read_text().splitlines():
        r = json.loads(line)
        texts += [r["instruction"], r["input"], r["output"]]
    texts += ["### Instruction:", "### Input:", "### Response:"]
    tok.train_from_iterator(texts, trainer=trainer)
    path.write_text(tok.to_str())


def main() -> int:
    ASSETS.mkdir(parents=True, exist_ok=True)
    data = ASSETS / "demo_alpaca.jsonl"
    write_data(data)
    write_tokenizer(data, ASSETS / "tiny_tokenizer.json")
    print(f"wrote {data} and {ASSETS / 'tiny_tokenizer.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
