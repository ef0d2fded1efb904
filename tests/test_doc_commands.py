"""Every command a reader sees runs: the ```bash blocks of README.md and docs/, page by page.

Each line of a ```bash block is one command. A line that can run offline on a CPU runs, in page order,
in a fresh folder that holds the repository's files (so a page's later commands see its earlier runs),
and must exit 0. A block whose lines cannot (a GPU, the hub, the user's own files, minutes of time) follows
an HTML comment ``<!-- not run: <reason> -->``, which the reader does not see; a ``bigtune`` line there is
still parsed by the real command line, and the recipe it names must load, so a renamed flag or key fails here
too. The README's Quick start is run by .ci/run.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from bigtune.cli import build_parser
from bigtune.recipe import load_recipe
from conftest import HANG_GUARD_S, run_cli

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
NOT_RUN = re.compile(r"\s+#\s*not run:\s*(\S.*)$")  # the old visible form, refused below
HIDDEN = re.compile(r"<!--\s*not run:\s*(\S.*?)\s*-->")
BLOCK = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)
SHELL = re.compile(r"[|&;<>$`*?]")  # pipes, redirections, variables, globs: a line only a shell runs


def commands(page: Path) -> list[tuple[int, str, str | None]]:
    """(line number, command, reason it is not run or None) for every ```bash line of ``page``."""
    text = page.read_text()
    quick = text.find("## Quick start") if page == ROOT / "README.md" else -1
    quick_block = BLOCK.search(text, quick).start() if quick >= 0 else -1
    out = []
    for m in BLOCK.finditer(text):
        if m.start() == quick_block:
            continue  # the Quick start block: .ci/run runs it on a fresh clone
        first = text[: m.start(1)].count("\n") + 1
        # The last line before the fence (blank lines aside): the block's hidden marker, if any.
        hidden = HIDDEN.fullmatch(text[: m.start()].rstrip().rsplit("\n", 1)[-1].strip())
        for i, line in enumerate(m.group(1).splitlines()):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            reason = NOT_RUN.search(line)
            cmd = NOT_RUN.sub("", line).strip()
            out.append((first + i, cmd, hidden.group(1) if hidden else reason.group(1) if reason else None))
    return out


def _where(page: Path, line: int) -> str:
    return f"{page.relative_to(ROOT)}:{line}"


def _check_without_running(page: Path, line: int, cmd: str) -> None:
    argv = shlex.split(cmd)
    if argv[0] != "bigtune":
        return  # pip, torchrun, sbatch...: shown for the reader, marked, not ours to parse
    try:
        args = build_parser().parse_args(argv[1:])
    except SystemExit as e:  # argparse's way of saying a flag or verb does not exist
        raise AssertionError(f"{_where(page, line)}: `{cmd}` is not a valid bigtune command line") from e
    recipe = getattr(args, "recipe", None)
    if recipe and (ROOT / recipe).is_file():
        overrides = list(getattr(args, "overrides", None) or [])
        load_recipe(ROOT / recipe, overrides, check=False)  # keys and types; not this machine's limits


def _workspace(tmp_path: Path) -> Path:
    """A folder that looks like the repository root (links to its files), with nothing run yet."""
    ws = tmp_path / "repo"
    ws.mkdir()
    for item in ROOT.iterdir():
        if item.name not in ("runs", ".git", ".venv", "site") and not item.name.startswith("."):
            (ws / item.name).symlink_to(item)
    return ws


def test_the_pages_show_commands_and_mark_the_ones_not_run():
    found = {p.relative_to(ROOT).as_posix(): commands(p) for p in PAGES}
    assert sum(len(c) for c in found.values()) > 40, found
    assert any("bigtune train --resume runs/tiny-opt" == c for _, c, r in found["README.md"] if r is None)
    for page, cmds in found.items():
        for line, cmd, reason in cmds:
            assert cmd.startswith("bigtune ") or cmd == "bigtune" or reason, (
                f"{page}:{line}: `{cmd}` is not a bigtune command; put `<!-- not run: <reason> -->` before its "
                "block or use a ```text block"
            )
        text = (ROOT / page).read_text()
        for m in BLOCK.finditer(text):
            for i, line in enumerate(m.group(1).splitlines()):
                # What a reader copies carries no note for this check: the marker goes in the hidden comment.
                assert not NOT_RUN.search(line), (
                    f"{page}:{text[: m.start(1)].count(chr(10)) + 1 + i}: a visible `# not run:` note; move it into "
                    "`<!-- not run: <reason> -->` on the line before the block"
                )


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if commands(p)], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_command_on_the_page_runs(page, tmp_path):
    ws = _workspace(tmp_path)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    for line, cmd, reason in commands(page):
        if reason is not None:
            _check_without_running(page, line, cmd)
            continue
        argv = shlex.split(cmd)
        if argv[0] == "bigtune" and not SHELL.search(cmd):
            # what the reader's shell would start, run by run_cli (in this process unless it needs its own)
            res = run_cli(*argv[1:], cwd=ws)
            assert res.returncode == 0, f"{_where(page, line)}: `{cmd}` exited {res.returncode}\n{res.stderr[-3000:]}"
            continue
        res = subprocess.run(
            ["bash", "-c", cmd],
            cwd=ws,
            env=env,
            capture_output=True,
            text=True,
            timeout=HANG_GUARD_S,
            stdin=subprocess.DEVNULL,
        )
        assert res.returncode == 0, f"{_where(page, line)}: `{cmd}` exited {res.returncode}\n{res.stderr[-3000:]}"
