"""What `bigtune train` tells a person: a short header (the whole recipe stays in recipe.yaml; --verbose
prints it), --quiet for scripts, which limit ends the run, epoch averages over every step, and a Ctrl-C
before the first optimizer step."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys

import pytest

import bigtune.engine.loop as engine
from bigtune.cli.app import main
from bigtune.engine.build import run_length
from conftest import HANG_GUARD_S, ROOT, read_jsonl, run_cli, set_args

# The built-in demo on 64 of its samples: 8 micro-batches of 8 an epoch, its max_epochs 3 => 24 steps.
SMALL_DEMO = {"data.num_train_samples": 64, "data.max_seq_length": 64, "checkpoint.save_model": "false"}


def test_max_epochs_ending_the_run_before_max_steps_is_said_at_the_start(tmp_path):
    run = tmp_path / "run"
    res = run_cli("train", *set_args({**SMALL_DEMO, "train.max_steps": 30, "output_dir": run}), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    note = "train.max_epochs=3 ends the run at step 24, before train.max_steps=30"
    at = next(i for i, line in enumerate(lines) if note in line)
    assert at < next(i for i, line in enumerate(lines) if line.startswith("run dir:")), res.stdout  # at the start
    assert "raise train.max_epochs" in lines[at]
    assert json.loads((run / "summary.json").read_text())["steps"] == 24


@pytest.mark.parametrize(
    "max_epochs, max_steps, per_epoch, says, warns",
    [
        (3, 30, 8, "24 optimizer steps (3 epochs of 8 steps)", "train.max_epochs=3 ends the run at step 24"),
        (3, 12, 8, "train.max_steps=12 ends the run after 1.5 of train.max_epochs=3 epochs", None),
        (3, 24, 8, "24 optimizer steps (3 epochs of 8 steps)", None),
        (None, 30, 8, "30 optimizer steps (train.max_steps", None),
        (None, None, 8, "8 optimizer steps (one epoch", None),
    ],
)
def test_run_length_names_the_limit_that_ends_the_run(max_epochs, max_steps, per_epoch, says, warns):
    text, warning = run_length(max_epochs, max_steps, per_epoch)
    assert says in text
    assert (warning is None) if warns is None else (warns in warning)


def test_header_is_short_the_recipe_goes_to_the_run_folder_and_verbose_prints_it(tmp_path):
    run = tmp_path / "run"
    over = {**SMALL_DEMO, "train.max_steps": 3, "train.max_epochs": "null", "output_dir": run}
    res = run_cli("train", *set_args(over), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout
    assert "# resolved recipe" not in out and "fsdp_sharding" not in out
    header = out.split("run dir:")[0].splitlines()
    assert len(header) <= 8, header  # data, model, run, steps, plan
    for fragment in (
        "model: tiny-llama: 158,016 parameters",
        "precision 32-true",
        "run: 1 cpu device; batch 8 samples = micro-batch 8 × accumulation 1 × 1 device",
        "steps: 3 optimizer steps",
        "plan (cpu): predicted peak",
    ):
        assert fragment in out, (fragment, out)
    # the whole resolved recipe is in the run folder, and --verbose prints it too
    saved = (run / "recipe.yaml").read_text()
    assert "fsdp_sharding:" in saved and "num_train_samples: 64" in saved
    res = run_cli("train", *set_args({**over, "output_dir": tmp_path / "loud"}), "--verbose", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "# resolved recipe" in res.stdout and "fsdp_sharding: full" in res.stdout
    assert "after_optimizer" in res.stdout.split("run dir:")[0]  # the plan's phase table
    # transformers' own "Writing model shards" bar is not shown beside ours
    res = run_cli("train", *set_args({**over, "output_dir": tmp_path / "model", "checkpoint.save_model": "true"}),
                  cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0 and (tmp_path / "model" / "model").is_dir(), res.stderr[-2000:]
    assert "Writing model shards" not in res.stderr + res.stdout


def test_quiet_prints_the_summary_line_and_notices_only(tmp_path):
    run = tmp_path / "run"
    res = run_cli("train", *set_args({**SMALL_DEMO, "train.max_steps": 30, "output_dir": run}), "--quiet", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    assert len(lines) == 1 and re.match(r"status ok; 24 steps; final loss \d+\.\d{4}; ", lines[0]), res.stdout
    assert f"summary: {run / 'summary.json'}" in lines[0]
    assert "train.max_epochs=3 ends the run at step 24" in res.stderr  # the notice still shows, on stderr
    assert (run / "recipe.yaml").is_file() and (run / "metrics.jsonl").is_file()
    res = run_cli("train", "--quiet", "--verbose", cwd=tmp_path)
    assert res.returncode == 2 and "not allowed with" in res.stderr


def test_epoch_loss_averages_every_step_not_only_the_logged_ones(tmp_path):
    # 64 samples, micro-batches of 4 accumulated 2 => 8 steps an epoch; logged every 10 steps the windows
    # straddle the epochs. The same seeded run logged every step gives each step's loss to average.
    common = {
        **SMALL_DEMO,
        "train.micro_batch_size": 4,
        "train.accumulate_grad_batches": 2,
        "train.max_epochs": 2,
        "memory.plan": "false",
    }
    res = run_cli(
        "train", *set_args({**common, "train.log_every_steps": 10, "output_dir": tmp_path / "a"}), cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr[-2000:]
    printed = dict(re.findall(r"^epoch (\d+): average train loss (\d+\.\d+) over 8 steps$", res.stdout, re.M))
    assert sorted(printed) == ["0", "1"], res.stdout
    every = run_cli(
        "train", *set_args({**common, "train.log_every_steps": 1, "output_dir": tmp_path / "b"}), cwd=tmp_path
    )
    assert every.returncode == 0, every.stderr[-2000:]
    steps = read_jsonl(tmp_path / "b" / "metrics.jsonl")
    assert [m["step"] for m in steps] == list(range(1, 17))
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    for epoch in (0, 1):
        want = sum(m["loss"] for m in steps[8 * epoch : 8 * epoch + 8]) / 8
        assert float(printed[str(epoch)]) == pytest.approx(want, abs=1.5e-4)
        rec = summary["epoch_losses"][epoch]
        assert rec["epoch"] == epoch and rec["steps"] == 8 and rec["loss"] == pytest.approx(want, rel=1e-5)


def test_ctrl_c_while_setting_up_writes_nothing_and_says_so(tmp_path):
    run = tmp_path / "run"
    args = set_args({**SMALL_DEMO, "train.max_steps": 3, "train.max_epochs": "null", "output_dir": run})
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "bigtune", "train", "--verbose", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for line in proc.stdout:  # the recipe, printed before the model and data are built
        if line.startswith("output_dir:"):  # the recipe's last line
            break
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=HANG_GUARD_S)[0]
    assert proc.returncode == 130, out[-2000:]
    assert "SIGINT before the first optimizer step" in out and "Traceback" not in out, out[-2000:]
    assert not run.exists()
    res = run_cli("train", *args, cwd=tmp_path)  # the same command again starts it
    assert res.returncode == 0 and json.loads((run / "summary.json").read_text())["steps"] == 3, res.stderr[-2000:]


def test_ctrl_c_before_the_first_step_then_resume_starts_afresh(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    over = {
        **SMALL_DEMO,
        "train.max_steps": 3,
        "train.max_epochs": "null",
        "checkpoint.enabled": "true",
        "checkpoint.every_steps": 2,
        "train.log_every_steps": 1,
        "memory.plan": "false",
        "output_dir": run,
    }

    def ctrl_c(*args, **kwargs):  # what a second Ctrl-C during the first step raises
        raise KeyboardInterrupt

    monkeypatch.setenv("BIGTUNE_SIM_CACHE", "off")
    monkeypatch.setattr(engine, "train_step", ctrl_c)
    assert main(["train", *set_args(over)]) == 130
    out = capsys.readouterr().out
    assert f"SIGINT before the first optimizer step: no checkpoint to write; `--resume {run}`" in out, out
    assert "stopped before the first optimizer step; no loss yet" in out.splitlines()[-1]
    assert "None" not in out.splitlines()[-1]
    saved = json.loads((run / "summary.json").read_text())
    assert saved["status"] == "interrupted" and saved["steps"] == 0 and not list((run / "checkpoints").iterdir())

    monkeypatch.undo()
    monkeypatch.setenv("BIGTUNE_SIM_CACHE", "off")
    assert main(["train", "--resume", str(run)]) == 0
    out = capsys.readouterr().out
    assert "stopped before its first optimizer step and has no checkpoint: starting it afresh" in out, out
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]
    assert json.loads((run / "summary.json").read_text())["status"] == "ok"


def test_a_stop_between_logged_steps_records_its_loss_and_speed(tmp_path):
    run = tmp_path / "run"
    over = {
        **SMALL_DEMO,
        "train.max_steps": 100_000,
        "train.max_epochs": "null",
        "train.log_every_steps": 100_000,
        "checkpoint.enabled": "true",
        "memory.plan": "false",
        "output_dir": run,
    }
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "bigtune", "train", *set_args(over)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for line in proc.stdout:  # step 1's memory table: the loop and its stop handlers are running
        if line.startswith("    1 after_optimizer"):
            break
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=HANG_GUARD_S)[0]
    assert proc.returncode == 130, out[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    step = summary["preempted_at_step"]
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [step]
    assert summary["final_loss"] is not None and summary["tokens_per_s"] > 0
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"status interrupted; {step} steps; final loss ") and "tok/s" in last, last


# -- progress: a live bar on a terminal, plain lines elsewhere ---------------------------------------------------

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
RECORD = {"loss": 1.23456, "lr": 1e-3, "tokens_per_s": 12345.6}


class _Terminal(io.StringIO):
    """A stdout that says it is a terminal, as rank 0's is under `bigtune train` in a shell."""

    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_is_a_bar_with_step_loss_speed_memory_and_eta():
    from rich.console import Console

    from bigtune.engine.progress import Progress

    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, color_system=None, width=160)
    with Progress(5, console=console) as p:
        p.step(1)
        p.log(2, RECORD, memory_bytes=3 * 2**30)
    text = ANSI.sub("", screen.getvalue())
    assert "2/5" in text and "loss 1.2346" in text and "12,346 tok/s" in text and "mem 3.00 GiB" in text, text
    assert "eta" in text
    assert "step 2/5 [" not in text  # not the plain line


def test_progress_elsewhere_prints_the_plain_line_and_nothing_between_logs(capsys):
    from bigtune.engine.progress import Progress

    with Progress(4) as p:  # pytest's captured stdout is not a terminal
        p.step(1)
        p.log(2, RECORD, memory_bytes=2**30)
    (line,) = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"step 2/4 \[50\.0%\] loss 1\.2346 lr 1\.00e-03 12,346 tok/s eta +\d+s", line), line


def test_a_run_on_a_terminal_draws_the_bar_and_quiet_still_silences_it(tmp_path, monkeypatch):
    import bigtune
    from conftest import tiny_overrides

    monkeypatch.setenv("COLUMNS", "160")
    over = {"memory.plan": False, "train.max_steps": 3}
    screen = _Terminal()
    monkeypatch.setattr(sys, "stdout", screen)
    s = bigtune.train({}, tiny_overrides(tmp_path / "tty", **over))
    monkeypatch.undo()
    text = ANSI.sub("", screen.getvalue()).replace("\r", "\n")
    final = read_jsonl(tmp_path / "tty" / "metrics.jsonl")[-1]["loss"]
    assert s["status"] == "ok" and "3/3" in text and f"loss {final:.4f}" in text and "MiB eta" in text, text
    assert not re.search(r"^step \d+/3 \[", text, re.M)  # the bar replaces the plain lines
    assert text.strip().splitlines()[-1].startswith("status ok; 3 steps")

    quiet = _Terminal()
    monkeypatch.setattr(sys, "stdout", quiet)
    bigtune.train({}, tiny_overrides(tmp_path / "quiet", **over), verbosity="quiet")
    monkeypatch.undo()
    (line,) = ANSI.sub("", quiet.getvalue()).strip().splitlines()
    assert line.startswith("status ok; 3 steps"), quiet.getvalue()


def test_a_run_in_a_log_prints_a_plain_line_per_logged_step(tmp_path, capsys):
    import bigtune
    from conftest import tiny_overrides

    bigtune.train({}, tiny_overrides(tmp_path / "run", **{"memory.plan": False, "train.max_steps": 3}))
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("step ")]
    losses = [m["loss"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert len(lines) == 3
    for i, (line, loss) in enumerate(zip(lines, losses), 1):
        pattern = rf"step {i}/3 \[ *\d+\.\d%\] loss {loss:.4f} lr \S+ [\d,]+ tok/s eta +(\d+|nan)s"
        assert re.fullmatch(pattern, line), line
