"""train.compile A/B: one compiled bigtune model, timed windows alternating eager and compiled.

    python bench/compile_ab.py --smoke [--data fixed|real|packed|all] [--pairs 20] [--window 10]
    python bench/compile_ab.py --config tinyllama-1.1b-full-bf16           # one GPU

bench/throughput.py --compile compares whole runs, one after the other; on a shared machine their
load differs by more than compile's effect. Here both modes run in the same process on the same
model, interleaved (eager windows under torch.compiler.set_stance("force_eager"), the order swapped
every pair), so drift in the machine's load hits both alike. Compile warm-up is excluded: windows
start once every batch shape of the cycle has been compiled. Each pair gives compiled/eager tokens/s;
the median pair is the answer. Same presets as bench/throughput.py. Writes
bench/results/compile_ab-<gpu>-<date>.json (with the command line) unless --no-json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from bigtune.engine.build import build, setup_fabric  # noqa: E402
from bigtune.engine.loop import LoopState, train_step  # noqa: E402
from bigtune.recipe import load_recipe  # noqa: E402
from throughput import BIGTUNE_EXTRA, PRESETS, fixed_length_source, peak_flops_of  # noqa: E402

CYCLE = 60  # distinct micro-batches the windows cycle through


def measure(config: str, data: str, pairs: int, window: int, tmp: Path) -> dict:
    over = {
        **PRESETS[config],
        **BIGTUNE_EXTRA[config],
        "train.compile": True,
        "memory.enabled": False,
        "memory.plan": False,
        "checkpoint.save_model": False,
        "train.max_steps": 10**6,
        "train.max_epochs": None,
    }
    mb = over["train.micro_batch_size"]
    if data == "fixed":
        over.update(
            {
                "data.source": fixed_length_source(tmp, mb * CYCLE, over["data.max_seq_length"]),
                "data.format": "jsonl-text",
            }
        )
    else:
        over.update({"data.source": "demo", "data.packing": data == "packed"})
    r = load_recipe({}, over)
    fabric = setup_fabric(r)
    with contextlib.redirect_stdout(io.StringIO()):
        b = build(r, fabric)
    batches = list(itertools.islice(iter(b.loader), CYCLE))
    state = LoopState()
    cuda = fabric.device.type == "cuda"
    position = itertools.cycle(range(len(batches)))

    def run(steps: int) -> float:  # tokens/s over `steps` optimizer steps of one micro-batch each
        tokens = 0
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            batch = batches[next(position)]
            train_step(b, [batch], None, False, state)
            tokens += int(batch["attention_mask"].sum())
        if cuda:
            torch.cuda.synchronize()
        return tokens / (time.perf_counter() - t0)

    from torch._dynamo.utils import counters

    t0 = time.perf_counter()
    run(len(batches))  # every shape of the cycle compiled (static, then shape-generic)
    compile_s = time.perf_counter() - t0
    with torch.compiler.set_stance("force_eager"):
        run(2)
    tps: dict[str, list[float]] = {"eager": [], "compiled": []}
    for i in range(pairs):
        for mode in ("eager", "compiled") if i % 2 == 0 else ("compiled", "eager"):
            with torch.compiler.set_stance("force_eager") if mode == "eager" else contextlib.nullcontext():
                tps[mode].append(run(window))
    ratios = [c / e for c, e in zip(tps["compiled"], tps["eager"])]
    res = {
        "eager_tokens_per_s": tps["eager"],
        "compiled_tokens_per_s": tps["compiled"],
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "eager_median": statistics.median(tps["eager"]),
        "compiled_median": statistics.median(tps["compiled"]),
        "warmup_seconds": compile_s,
        "graphs": counters["stats"]["unique_graphs"],
    }
    print(
        f"[{data}] eager {res['eager_median']:,.0f} tok/s, compiled {res['compiled_median']:,.0f} tok/s (medians); "
        f"compiled/eager per pair: median {res['median_ratio']:.3f}, min {min(ratios):.3f}, max {max(ratios):.3f} "
        f"({pairs} pairs of {window} steps); warm-up incl. compiling {compile_s:.1f} s, {res['graphs']} graphs",
        flush=True,
    )
    torch._dynamo.reset()  # the next data set compiles from scratch
    counters.clear()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", choices=sorted(PRESETS), help="preset to run")
    ap.add_argument("--smoke", action="store_true", help="the CPU smoke preset")
    ap.add_argument("--data", choices=["fixed", "real", "packed", "all"], default="all")
    ap.add_argument("--pairs", type=int, default=20, help="eager/compiled window pairs")
    ap.add_argument("--window", type=int, default=10, help="optimizer steps per timed window")
    ap.add_argument("--json", help="result file (default bench/results/compile_ab-<gpu>-<date>.json)")
    ap.add_argument("--no-json", action="store_true", help="print only")
    args = ap.parse_args(argv)
    config = "smoke" if args.smoke else args.config
    if config is None:
        ap.error("give --smoke or --config")
    if PRESETS[config]["accelerator"] == "cuda" and not torch.cuda.is_available():
        print(f"--config {config} needs a CUDA GPU (torch sees none); on a CPU use --smoke", file=sys.stderr)
        return 2
    device = torch.device("cuda" if PRESETS[config]["accelerator"] == "cuda" else "cpu")
    _, gpu_name = peak_flops_of(device, PRESETS[config]["precision"])
    print(
        f"compile A/B: {config} on {gpu_name} ({torch.get_num_threads()} threads); torch {torch.__version__}",
        flush=True,
    )
    results = {}
    with tempfile.TemporaryDirectory() as d:
        for data in ["fixed", "real", "packed"] if args.data == "all" else [args.data]:
            results[data] = measure(config, data, args.pairs, args.window, Path(d))
    record = {
        "config": config,
        "overrides": PRESETS[config],
        "device": gpu_name,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "pairs": args.pairs,
        "window": args.window,
        "results": results,
        "command": "python bench/compile_ab.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    if not args.no_json:
        path = (
            Path(args.json)
            if args.json
            else ROOT / "bench" / "results" / f"compile_ab-{gpu_name}-{datetime.date.today().isoformat()}.json"
        )
        path.write_text(json.dumps(record, indent=2) + "\n")
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
