"""Regenerate the bundled chat demo: short conversations with a kitchen assistant.

    python scripts/make_chat_demo.py

Writes src/bigtune/assets/demo_chat.jsonl: 400 conversations about 16 dishes, most in the
``messages: [{role, content}]`` format and every fifth in ShareGPT's ``conversations: [{from, value}]``
with a ``system`` field; a third carry a system prompt; half are two- or three-turn exchanges whose
follow-ups ("What color is it?") only make sense with the earlier turns. Two malformed records (a
user turn following a user turn, an empty answer) come last: training must skip and report them.
Each answer follows one fixed sentence pattern per question, so a tiny random-init model learns the
set within a minute on a CPU. Deterministic (seeded), no downloads; the file is committed and a test
checks it is reproducible.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "bigtune" / "assets" / "demo_chat.jsonl"

# dish: (color, kind of food, main ingredients); the dishes and facts of the bundled instruction set.
DISHES = {
    "tomato soup": ("red", "a soup", "tomatoes, onion and basil"),
    "pad thai": ("orange", "a noodle dish", "rice noodles, egg, tofu and peanuts"),
    "caesar salad": ("green", "a salad", "romaine, croutons, parmesan and dressing"),
    "margherita pizza": ("red", "a pizza", "tomato, mozzarella and basil"),
    "sushi roll": ("white", "a rice dish", "rice, nori, cucumber and salmon"),
    "chocolate cake": ("brown", "a dessert", "cocoa, flour, eggs and butter"),
    "guacamole": ("green", "a dip", "avocado, lime, onion and cilantro"),
    "pancakes": ("golden", "a breakfast dish", "flour, milk, eggs and syrup"),
    "ramen": ("brown", "a noodle dish", "wheat noodles, broth, egg and scallions"),
    "falafel": ("brown", "a street food", "chickpeas, parsley and garlic"),
    "paella": ("yellow", "a rice dish", "rice, saffron, shrimp and peas"),
    "lemon tart": ("yellow", "a dessert", "lemon curd and shortcrust pastry"),
    "beef tacos": ("brown", "a street food", "tortillas, beef, salsa and cheese"),
    "greek salad": ("green", "a salad", "tomato, cucumber, olives and feta"),
    "mango sorbet": ("orange", "a dessert", "mango, sugar and lime"),
    "fried rice": ("golden", "a rice dish", "rice, egg, peas and soy sauce"),
}

SYSTEM = "You are a kitchen assistant. Answer in one sentence."

ASK_INGREDIENTS = ["What is in {d}?", "What are the ingredients of {d}?", "How do I make {d}?"]


def first_turn(rng: random.Random, d: str) -> tuple[str, str]:
    color, kind, ingredients = DISHES[d]
    name = d[0].upper() + d[1:]
    pick = rng.randrange(3)
    if pick == 0:
        return rng.choice(ASK_INGREDIENTS).format(d=d), f"{name} is made with {ingredients}."
    if pick == 1:
        return f"What color is {d}?", f"{name} is {color}."
    return f"What kind of food is {d}?", f"{name} is {kind}."


def follow_ups(rng: random.Random, d: str, n: int) -> list[tuple[str, str]]:
    color, kind, ingredients = DISHES[d]
    pool = [
        ("What color is it?", f"It is {color}."),
        ("What kind of food is it?", f"It is {kind}."),
        ("What goes in it?", f"It is made with {ingredients}."),
    ]
    rng.shuffle(pool)
    out = pool[:n]
    if n and rng.random() < 0.3:
        out[-1] = ("Thank you!", f"You are welcome, enjoy the {d}!")
    return out


def conversation(rng: random.Random, i: int) -> dict:
    d = sorted(DISHES)[i % len(DISHES)]
    turns = [first_turn(rng, d)] + follow_ups(rng, d, rng.choice([0, 0, 1, 2]))
    system = SYSTEM if i % 3 == 0 else None
    if i % 5 == 4:  # ShareGPT style, the system prompt as a record field
        conv = [{"from": s, "value": v} for q, a in turns for s, v in (("human", q), ("gpt", a))]
        return {"conversations": conv, **({"system": system} if system else {})}
    messages = [{"role": r, "content": c} for q, a in turns for r, c in (("user", q), ("assistant", a))]
    return {"messages": ([{"role": "system", "content": system}] if system else []) + messages}


def conversations(n: int = 400, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = [conversation(rng, i) for i in range(n)]
    out.append({"messages": [{"role": "user", "content": "Hi!"}, {"role": "user", "content": "What is in ramen?"}]})
    out.append({"messages": [{"role": "user", "content": "What is in paella?"}, {"role": "assistant", "content": ""}]})
    return out


def main() -> int:
    OUT.write_text("".join(json.dumps(r) + "\n" for r in conversations()), encoding="utf-8")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
