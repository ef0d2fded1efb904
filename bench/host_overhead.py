"""Host time per operator of bigtune's eager training step: the planner's HOST_SECONDS_PER_OP.

    python bench/host_overhead.py [--steps 60] [--repeats 3] [--accelerator cpu|cuda] [--out FILE]

An eager step on a GPU is two queues: the host issues every aten operator (Python modules, autograd,
the dispatcher, the kernel launch) while the GPU runs the kernels. A small model or a small batch is
bound by the host. This measures the host's cost per operator where the kernels cost nothing: the
engine's own ``train_step`` on the tiny Llama preset at 16 tokens per micro-batch (synthetic ids; data.max_seq_length 256 only lets the demo data load), fp32 on the CPU, with
the foreach AdamW a CUDA run uses, one thread. Operators are counted with the planner's own
``roofline.OpCounter`` (views included, prim:: metadata queries not); the time per step is the median
over repeats of ``--steps`` timed steps. On a CPU the tiny kernels themselves still run inside the host
time, so the figure is an upper bound for this machine. Prints µs per operator and the constant the
planner uses; writes bench/results/host_overhead-cpu-<date>.json.

With ``--accelerator cuda`` the same step runs on the GPU in bf16-true, where each of these tiny kernels
takes a few µs and the host's queue is the longer one: the time per operator is then the host's own cost
on that machine, kernel launch included (bench/gpu_session.sh runs it first in every accuracy call).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from bigtune.engine.build import build, setup_fabric  # noqa: E402
from bigtune.engine.loop import LoopState, train_step  # noqa: E402
from bigtune.plan.device.roofline import HOST_SECONDS_PER_OP, OpCounter  # noqa: E402
from bigtune.recipe import load_recipe  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--accumulate", type=int, default=2)
    ap.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument(
        "--out", default=None, help="JSON path (default bench/results/host_overhead-<accelerator>-<date>.json)"
    )
    args = ap.parse_args(argv)
    cuda = args.accelerator == "cuda"
    torch.set_num_threads(1)
    over = {
        "model.name": "tiny-llama",
        "data.max_seq_length": 256,
        "train.micro_batch_size": 1,
        "train.accumulate_grad_batches": args.accumulate,
        "precision": "bf16-true" if cuda else "32-true",
        "accelerator": args.accelerator,
        "optim.implementation": "foreach",
        "optim.grad_clip": 1.0,
        "output_dir": "/tmp/bigtune-host-overhead",
    }
    recipe = load_recipe({"name": "host-overhead"}, over)
    fabric = setup_fabric(recipe)
    built = build(recipe, fabric)
    vocab = built.model.config.vocab_size if hasattr(built.model, "config") else 256
    g = torch.Generator().manual_seed(0)
    batches = [
        {
            "input_ids": (ids := torch.randint(3, vocab, (1, 16), generator=g).to(fabric.device)),
            "attention_mask": torch.ones_like(ids),
            "labels": ids.clone(),
        }
        for _ in range(args.accumulate)
    ]
    state = LoopState(step=1)
    for _ in range(5):  # warm-up: optimizer state, allocator, lazy inits
        train_step(built, batches, None, False, state)
    with OpCounter(state) as counter:
        train_step(built, batches, None, False, state)
    ops = int(sum(v[0] for v in counter.ops.values()))
    kernels = int(sum(v[0] for k, v in counter.ops.items() if k[0] != "host"))
    per_step = []
    for _ in range(args.repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            train_step(built, batches, None, False, state)
        if cuda:
            torch.cuda.synchronize()
        per_step.append((time.perf_counter() - t0) / args.steps)
    step = statistics.median(per_step)
    out = {
        "date": datetime.date.today().isoformat(),
        "command": "python bench/host_overhead.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{os.cpu_count()} CPU cores, torch {torch.__version__}, 1 thread"
        + (f", {torch.cuda.get_device_name(0)}" if cuda else ""),
        "setup": "engine train_step, tiny-llama preset, 16 tokens × 1 per micro-batch, "
        f"{args.accumulate} micro-batches, {'bf16-true on the GPU' if cuda else 'fp32'}, foreach AdamW, grad clip 1.0",
        "operators_per_step": ops,
        "kernel_operators_per_step": kernels,
        "step_s_median": step,
        "step_s_all": per_step,
        "us_per_operator": 1e6 * step / ops,
        "planner_us_per_operator": HOST_SECONDS_PER_OP * 1e6,
    }
    print(
        f"{ops} aten operators per step ({kernels} launch a kernel), {step * 1e3:.2f} ms per step "
        f"(median of {args.repeats} × {args.steps})"
    )
    print(
        f"host time per operator: {out['us_per_operator']:.1f} µs (planner assumes "
        f"{out['planner_us_per_operator']:.1f} µs)"
    )
    path = Path(args.out or Path(__file__).parent / "results" / f"host_overhead-{args.accelerator}-{out['date']}.json")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=2) + "\n")
    tmp.replace(path)
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
