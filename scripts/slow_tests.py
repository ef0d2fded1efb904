"""Write tests/slow_tests.txt, the tests `pytest -m "not slow"` leaves out, from a timed run of the suite.

    .venv/bin/python -m pytest -q -n 2 --junitxml=/tmp/suite.xml
    .venv/bin/python scripts/slow_tests.py /tmp/suite.xml            # tests over 3 s (setup + call)

A test is slow when it took longer than --over seconds in that run (setup, call and teardown together).
tests/conftest.py marks the listed ones `slow` at collection, beside those marked in their own file, so the
fast tier follows the measured suite instead of someone's guess. Parametrised cases are listed one by one.
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "slow_tests.txt"


def node_id(case: ET.Element) -> str:
    """pytest's node id of a junit testcase: classname ``tests.test_x`` (or ``tests.test_x.TestY``) + name."""
    parts = case.get("classname", "").split(".")
    module = [p for p in parts if p.startswith("test_")]
    path = "/".join(parts[: parts.index(module[0]) + 1]) + ".py" if module else "/".join(parts) + ".py"
    classes = parts[parts.index(module[0]) + 1 :] if module else []
    return "::".join([path, *classes, case.get("name", "")])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("junit", type=Path, help="pytest --junitxml output of a whole-suite run")
    ap.add_argument("--over", type=float, default=3.0, help="seconds above which a test is slow (default 3)")
    args = ap.parse_args(argv)
    times: dict[str, float] = defaultdict(float)
    for case in ET.parse(args.junit).getroot().iter("testcase"):
        times[node_id(case)] += float(case.get("time", 0))
    slow = sorted(n for n, t in times.items() if t > args.over)
    fast_s = sum(t for n, t in times.items() if t <= args.over)
    header = (
        f"# Tests over {args.over:g} s in a timed run of the suite (scripts/slow_tests.py); conftest marks them slow.\n"
        f"# {len(slow)} of {len(times)} tests; the other {len(times) - len(slow)} took {fast_s:.0f} s of worker time.\n"
    )
    tmp = OUT.with_suffix(".tmp")
    tmp.write_text(header + "".join(f"{n}\n" for n in slow))
    tmp.replace(OUT)
    print(f"{OUT.relative_to(ROOT)}: {len(slow)} slow of {len(times)}; the fast tier's worker time {fast_s:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
