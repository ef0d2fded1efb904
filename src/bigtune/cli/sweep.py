"""``bigtune sweep`` and ``bigtune report``: run a ladder of variants, plan it, or report on it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bigtune.recipe import RecipeError
from bigtune.sweep.ladder import SweepError, SweepStopped, format_rows, plan_sweep, run_sweep

# A variant "produced a result" when it trained, ran out of memory, or was refused with its reason
# (e.g. a missing optional package): the sweep did its job. Only a failure (error, crash, time-out)
# makes the exit status non-zero.
RESULT_STATUSES = ("ok", "oom", "refused")
SWEEP_EXIT_CODES = (
    "exit status: 0 when every variant produced a result (ok, oom, or refused with its reason; an unmet "
    "expect: is flagged in the table and the report, not in the exit status), 1 when a variant failed (error, "
    "crash, time-out), 2 for a bad sweep file or override, 130 / 143 when Ctrl-C / SIGTERM stopped the sweep "
    "(run the same command again to continue)."
)


def add_cli(subparsers) -> None:
    """Add the ``sweep`` and ``report`` verbs to bigtune's argparse subparsers."""
    s = subparsers.add_parser(
        "sweep",
        help="run a ladder of variants of one recipe, one process each (OOM is a "
        "result), then write the comparison report",
        epilog=SWEEP_EXIT_CODES,
    )
    s.add_argument("sweep_file", help="sweep YAML (e.g. ladders/llm-single.yaml)")
    s.add_argument("--tiny", action="store_true", help="apply the sweep's tiny: block (tiny models on the CPU)")
    s.add_argument("--rerun", action="store_true", help="run variants again even if they finished (ok or oom)")
    s.add_argument("--out", help="sweep folder (default runs/<sweep name>, with -tiny under --tiny)")
    s.add_argument("--timeout", type=float, metavar="SECONDS", help="kill a variant after this long (status timeout)")
    s.add_argument("--only", nargs="+", metavar="NAME", help="run only these variants")
    s.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe key in every variant (before the variant's own overrides)",
    )
    s.add_argument(
        "--track",
        action="append",
        choices=["mlflow", "wandb", "tensorboard"],
        metavar="BACKEND",
        help="log every variant to mlflow, wandb or tensorboard (repeatable; sets tracking.backends): with mlflow, "
        "one run of the ladder holds a nested run per variant",
    )
    s.add_argument("--no-report", action="store_true", help="do not write the report at the end")
    s.add_argument(
        "--plan-only",
        metavar="GPU",
        help="run nothing: plan every variant on this GPU (catalog name, "
        "e.g. h100-80gb) and print predicted peak, FITS/OOM and step time; --json for tools",
    )
    s.add_argument("--json", action="store_true", help="with --plan-only: print the plans as JSON")
    s.add_argument(
        "--data-lengths",
        action="store_true",
        help="with --plan-only: plan each variant at its data's "
        "own lengths (the longest sample for the peak) instead of full max_seq_length rows",
    )
    s.set_defaults(func=main_sweep)
    r = subparsers.add_parser(
        "report",
        help="write report.md, results.csv, report.html (inline SVG plots) and "
        "the plots as .svg and .png for a sweep folder or one run folder",
    )
    r.add_argument("path", help="a sweep folder (holding sweep.json) or a run folder (holding summary.json)")
    r.add_argument("--out", help="where to write the report (default: the folder itself)")
    r.add_argument("--open", action="store_true", help="print the report's file:// address")
    r.set_defaults(func=main_report)


def main_sweep(args) -> int:
    """``bigtune sweep``: exit status as ``SWEEP_EXIT_CODES`` says."""
    from bigtune.recipe import parse_override

    try:
        extra = dict(parse_override(o) for o in (getattr(args, "overrides", None) or []))
        if getattr(args, "track", None):  # after --set, so the flag wins, as for train
            extra["tracking.backends"] = list(dict.fromkeys(args.track))
        if getattr(args, "plan_only", None):
            return plan_sweep(
                args.sweep_file,
                args.plan_only,
                tiny=args.tiny,
                only=args.only,
                extra=extra,
                as_json=args.json,
                data_lengths=args.data_lengths,
            )
        rows = run_sweep(
            args.sweep_file,
            out_dir=args.out,
            tiny=args.tiny,
            rerun=args.rerun,
            timeout_s=args.timeout,
            only=args.only,
            extra=extra,
        )
    except (SweepError, RecipeError) as e:
        print(f"bigtune: error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, SweepStopped) as e:
        print(
            "bigtune: sweep interrupted; the running variant was stopped and recorded as interrupted. Run the "
            "same command again to continue (finished variants are skipped).",
            file=sys.stderr,
        )
        return 143 if isinstance(e, SweepStopped) else 130
    print(format_rows(rows))
    if not getattr(args, "no_report", False) and rows:
        out = Path(rows[0]["run_dir"]).parent
        try:
            from bigtune.sweep.report import write_report

            res = write_report(out)
            print(f"report: {res['html']} (plots also as .svg and .png)")
        except Exception as e:  # noqa: BLE001 - the runs are recorded; a report problem must not hide them
            print(
                f"bigtune: warning: could not write the report ({type(e).__name__}: {e}); try `bigtune report {out}`",
                file=sys.stderr,
            )
    chosen = [r for r in rows if not args.only or r["variant"] in args.only]
    failed = [r for r in chosen if r.get("status") not in RESULT_STATUSES]
    return 0 if not failed else 1


def main_report(args) -> int:
    """``bigtune report``: write the report files and print a summary; 2 when the folder holds no results."""
    from bigtune.sweep.report import ReportError, write_report

    try:
        res = write_report(args.path, out_dir=args.out)
    except ReportError as e:
        print(f"bigtune: error: {e}", file=sys.stderr)
        return 2
    print(res["text"])
    print(
        "wrote: "
        + ", ".join(str(res[k]) for k in ("markdown", "csv", "html"))
        + " and "
        + ", ".join(Path(p).name for p in res["svgs"] + res["pngs"])
    )
    if args.open:
        print(Path(res["html"]).resolve().as_uri())
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m bigtune.sweep sweep|report ...`` (the same verbs before they are wired into ``bigtune``)."""
    ap = argparse.ArgumentParser(prog="bigtune")
    sub = ap.add_subparsers(dest="verb", required=True)
    add_cli(sub)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
