"""Generate the bundled food-photo caption set: src/bigtune/assets/gourmetgram_demo/.

Synthetic "photos" drawn with PIL (a plate or bowl on a table, holding a food drawn in its colour
and shape) with templated captions that name what is visible, so a tiny BLIP-2 can learn to
describe them. Deterministic: the same seed gives the same PNG bytes and metadata.jsonl.

    python scripts/make_gourmetgram_demo.py [--n 320] [--size 32]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

from PIL import Image, ImageDraw

OUT = Path(__file__).resolve().parents[1] / "src" / "bigtune" / "assets" / "gourmetgram_demo"

# name, colour (RGB), shape drawn on the plate
FOODS = [
    ("tomato soup", (200, 40, 30), "fill"),
    ("green salad", (60, 170, 60), "dots"),
    ("fried eggs", (250, 220, 60), "eggs"),
    ("blueberries", (50, 60, 170), "dots"),
    ("chocolate cake", (90, 50, 30), "square"),
    ("orange slices", (245, 150, 30), "wedges"),
    ("rice", (240, 240, 230), "fill"),
    ("strawberries", (220, 30, 70), "dots"),
]
VESSELS = ["plate", "bowl"]
TABLES = [("wooden table", (150, 100, 60)), ("white table", (225, 225, 225)), ("dark table", (40, 40, 45))]
TEMPLATES = ["a {vessel} of {food} on a {table}", "{food} in a {vessel} on a {table}"]


def draw(food: tuple, vessel: str, table: tuple, size: int, rng: random.Random) -> Image.Image:
    scale = 4  # draw large, then shrink: smoother edges at the small size
    s = size * scale
    img = Image.new("RGB", (s, s), table[1])
    d = ImageDraw.Draw(img)
    # a little table texture
    for _ in range(6):
        y = rng.randrange(s)
        shade = tuple(max(0, c - 18) for c in table[1])
        d.line([(0, y), (s, y + rng.randrange(-8, 8))], fill=shade, width=2)
    cx, cy = s // 2 + rng.randrange(-s // 16, s // 16 + 1), s // 2 + rng.randrange(-s // 16, s // 16 + 1)
    r = int(s * (0.40 if vessel == "plate" else 0.32))
    if vessel == "plate":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=(245, 245, 250), outline=(180, 180, 190), width=3)
        inner = int(r * 0.7)
    else:
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=(70, 110, 160), outline=(40, 60, 100), width=4)
        inner = int(r * 0.8)
    name, colour, shape = food
    jitter = tuple(min(255, max(0, c + rng.randrange(-15, 16))) for c in colour)
    if shape == "fill":
        d.ellipse([cx - inner, cy - inner, cx + inner, cy + inner], fill=jitter)
    elif shape == "dots":
        for _ in range(14):
            a, b = rng.randrange(-inner, inner), rng.randrange(-inner, inner)
            if a * a + b * b < inner * inner:
                k = max(3, inner // 5)
                d.ellipse([cx + a - k, cy + b - k, cx + a + k, cy + b + k], fill=jitter)
    elif shape == "eggs":
        for off in (-inner // 2, inner // 2):
            k = inner // 2
            d.ellipse([cx + off - k, cy - k, cx + off + k, cy + k], fill=(255, 255, 255))
            d.ellipse([cx + off - k // 2, cy - k // 2, cx + off + k // 2, cy + k // 2], fill=jitter)
    elif shape == "square":
        k = int(inner * 0.8)
        d.rectangle([cx - k, cy - k, cx + k, cy + k], fill=jitter)
    elif shape == "wedges":
        for start in range(0, 360, 60):
            d.pieslice([cx - inner, cy - inner, cx + inner, cy + inner], start, start + 40, fill=jitter)
    return img.resize((size, size), Image.Resampling.LANCZOS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=320)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    if args.out.exists():
        shutil.rmtree(args.out)
    (args.out / "images").mkdir(parents=True)
    rows = []
    for i in range(args.n):
        food, vessel, table = rng.choice(FOODS), rng.choice(VESSELS), rng.choice(TABLES)
        img = draw(food, vessel, table, args.size, rng)
        name = f"images/{i:04d}.png"
        img.save(args.out / name, optimize=True)
        caption = rng.choice(TEMPLATES).format(vessel=vessel, food=food[0], table=table[0])
        rows.append({"file_name": name, "text": caption})
    with (args.out / "metadata.jsonl").open("w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    total = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"wrote {len(rows)} images + metadata.jsonl to {args.out} ({total / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
