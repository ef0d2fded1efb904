"""Reserved memory when micro-batches change length: the allocator model replayed over varying shapes.

    python bench/varlen_reserved.py [--model TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T]
                                    [--micro-batch 8] [--depth 8] [--steps 6] [--seeds 1 2 3] [--json OUT]

The planner replays the caching allocator (src/bigtune/allocator.py) over steps of one shape, full
``max_seq_length`` rows. Data padded to each batch's longest sample changes shape every step. This
traces one simulated step (bf16-true, AdamW, CUDA rules, ``depth`` blocks) after ``--steps`` earlier
steps of random lengths (200..512 tokens, seeded), then prints peak reserved / peak allocated next to
the fixed-shape replay. It measures the model, not a GPU.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6, help="earlier steps of random length")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    import torch

    import bigtune.engine.loop as engine
    from bigtune.models.configs import resolve_config
    from bigtune.plan.base.constants import GIB
    from bigtune.plan.step.simulate import simulate
    from bigtune.recipe import load_recipe

    r = load_recipe(
        {},
        {
            "model.name": args.model,
            "precision": "bf16-true",
            "data.max_seq_length": 512,
            "train.micro_batch_size": args.micro_batch,
            "accelerator": "cpu",
        },
        check=False,
    )
    config = resolve_config(r)
    real_step = engine.train_step
    rows = []
    for seed in [None] + args.seeds:
        rng = random.Random(seed)
        lengths = [] if seed is None else [rng.randint(200, 512) for _ in range(args.steps)]

        def step(built, batches, monitor, measure, state, tokens, _lengths=lengths):
            # simulate() runs one untimed step 0 before the traced steady step: make it several, shorter
            if state.step != 0 or not _lengths:
                return real_step(built, batches, monitor, measure, state, tokens)
            for n in _lengths:
                cut = [
                    {k: v[:, :n] if torch.is_tensor(v) and v.dim() == 2 else v for k, v in b.items()} for b in batches
                ]
                out = real_step(built, cut, monitor, measure, state, tokens)
            return out

        engine.train_step = step
        try:
            sim = simulate(r, config, args.depth, True, trace=True)
        finally:
            engine.train_step = real_step
        row = {
            "seed": seed,
            "earlier_lengths": lengths,
            "peak_allocated_gib": sim.peak_allocated / GIB,
            "reserved_gib": sim.reserved / GIB,
            "needed_gib": sim.needed / GIB,
            "reserved_over_allocated": sim.reserved / sim.peak_allocated,
        }
        rows.append(row)
        what = "fixed shape" if seed is None else f"after lengths {lengths}"
        print(
            f"{what:<44} peak allocated {row['peak_allocated_gib']:.3f} GiB, reserved "
            f"{row['reserved_gib']:.3f} GiB ({row['reserved_over_allocated']:.2f}×), needed {row['needed_gib']:.3f}",
            flush=True,
        )
    if args.json:
        out = {
            "model": args.model,
            "micro_batch": args.micro_batch,
            "depth": args.depth,
            "rows": rows,
            "command": "python bench/varlen_reserved.py " + " ".join(sys.argv[1:]),
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
