"""Engine overhead: bigtune's steady-state steps/s vs a bare PyTorch loop doing the same work.

    python bench/overhead.py [--steps 200] [--repeats 3]

Both sides train the tiny Llama preset on the bundled data with the same micro batches, the same
summed-token loss, AdamW and fp32 on the CPU. The engine's time comes from its own metrics (log
windows after the first, so the memory snapshots of steps 0 and 1 and the warm-up are excluded);
the bare loop is timed over the same steps. Runs alternate and the median of each side is taken.
Prints steps/s for both and the ratio (goal ≥ 0.97).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from bigtune.core.stepmath import causal_lm_loss_sum, loss_normaliser  # noqa: E402
from bigtune.data.text import Collator, EpochSampler, ListDataset, build_examples  # noqa: E402
from bigtune.models.build import build_model, load_tokenizer  # noqa: E402
from bigtune.recipe import load_recipe  # noqa: E402
from bigtune.run.training import train  # noqa: E402

LOG_EVERY = 20


def overrides(steps: int, out: str) -> dict:
    return {
        "model.name": "tiny-llama",
        "data.max_seq_length": 128,
        "train.micro_batch_size": 8,
        "train.max_steps": steps,
        "train.max_epochs": None,
        "train.log_every_steps": LOG_EVERY,
        "memory.every_steps": 10**9,
        "checkpoint.save_model": False,
        "accelerator": "cpu",
        "output_dir": out,
        "optim.lr": 1e-3,
    }


def engine_steps_per_s(steps: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        train({}, overrides(steps, d + "/run"), quiet_recipe=True)
        rows = [json.loads(x) for x in Path(d, "run", "metrics.jsonl").read_text().splitlines()]
    steady = rows[1:]  # drop the first window: warm-up and the step-0/1 memory snapshots
    return len(steady) * LOG_EVERY / sum(r["step_time_s"] * LOG_EVERY for r in steady)


def bare_steps_per_s(steps: int) -> float:
    r = load_recipe({}, overrides(steps, "unused"))
    tok = load_tokenizer(r.model)
    examples, _ = build_examples(r.data, tok, r.seed)
    torch.manual_seed(r.seed)
    model = build_model(r.model, tok, r.precision, r.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=r.optim.lr)
    sampler = EpochSampler(len(examples), r.seed)
    loader = torch.utils.data.DataLoader(
        ListDataset(examples), batch_size=8, sampler=sampler, collate_fn=Collator(tok.pad_token_id)
    )
    it = iter(loader)
    t0 = None
    for step in range(steps):
        if step == LOG_EVERY:
            t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            sampler.set_epoch(sampler.epoch + 1)
            it = iter(loader)
            batch = next(it)
        scale = loss_normaliser([batch["labels"]])
        mask = batch["attention_mask"] if batch["padded"] else None  # the engine skips full masks too
        logits = model(input_ids=batch["input_ids"], attention_mask=mask).logits
        loss = causal_lm_loss_sum(logits, batch["labels"]) * scale
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % LOG_EVERY == 0:
            loss.item()  # the engine syncs once per log window too
    return (steps - LOG_EVERY) / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="also write the result to this file")
    args = ap.parse_args()
    engine, bare = [], []
    for _ in range(args.repeats):
        bare.append(bare_steps_per_s(args.steps))
        engine.append(engine_steps_per_s(args.steps))
    e, b = statistics.median(engine), statistics.median(bare)
    result = {
        "engine_steps_per_s": e,
        "bare_steps_per_s": b,
        "ratio": e / b,
        "steps": args.steps,
        "repeats": args.repeats,
        "engine_all": engine,
        "bare_all": bare,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "command": "python bench/overhead.py " + " ".join(sys.argv[1:]),
    }
    print(f"engine {e:.2f} steps/s   bare loop {b:.2f} steps/s   ratio {e / b:.3f} (goal >= 0.97)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
