"""``python -m torchcast track [--json FILE] [--html FILE] [--policy P]
[--violations KINDS] [--nonfinite ACTION] [--health] [--top N] SCRIPT.py [ARGS...]``: runs a script, unmodified, under ``torchcast.track(all_casts=True)`` and
prints the report (to stderr) when the script ends, also when it raises or
calls sys.exit. The exit code is the script's (1 if it raised). ``audit`` is
another name for the same command."""
import argparse
import os
import runpy
import sys
import traceback
from typing import List, Optional

import torch

from .tracker import track
from .violations import DEFAULT, KINDS, Violations

COMMANDS = ("track", "audit")


def _violations(spec):
    try:
        return Violations(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m torchcast track",
        description="Run a Python script under torchcast.track(all_casts=True): every cast "
                    "PyTorch performs is measured, attributed to its module and line, and "
                    "reported when the script ends. Options go before SCRIPT; everything "
                    "after SCRIPT is passed to it.")
    parser.add_argument("--json", metavar="FILE",
                        help="also write the report as JSON to FILE")
    parser.add_argument("--html", metavar="FILE",
                        help="also write the report as one self-contained HTML page to FILE")
    parser.add_argument("--policy", choices=("record", "warn", "raise"), default="record",
                        help="what a violating cast does: record it (default), warn once per "
                             "site, or raise at the first one")
    parser.add_argument("--violations", metavar="KINDS", default=DEFAULT, type=_violations,
                        help="which losses are violations, each with the fraction of a cast's "
                             f"elements above which it counts (default {DEFAULT!r}; 'all'; "
                             f"kinds: {', '.join(KINDS)}; e.g. 'overflow,nan,subnormal>1%%')")
    parser.add_argument("--nonfinite", choices=("record", "warn", "raise"),
                        help="also check every op for NaN/inf made from finite inputs: list "
                             "each such op, warn once per place, or stop at the first one")
    parser.add_argument("--health", action="store_true",
                        help="also measure each module's outputs and gradients (exponent "
                             "histograms, amax, zeros, subnormals) and print their headroom")
    parser.add_argument("--top", type=int, metavar="N",
                        help="print only the N worst sites")
    parser.add_argument("script", metavar="SCRIPT.py")
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS")
    return parser


def _exit_code(exc):
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


_INTERNAL = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (torch.__file__, __file__))


def _print_script_error(exc, script):
    """The traceback from the script's first frame to its last frame outside
    torch and torchcast: a violation raised by track shows the script's line,
    not the dispatcher's internals."""
    frames = traceback.extract_tb(exc.__traceback__)
    path = os.path.abspath(script)
    first = next((i for i, f in enumerate(frames) if os.path.abspath(f.filename) == path), 0)
    frames = frames[first:]
    last = max((i for i, f in enumerate(frames)
                if not os.path.abspath(f.filename).startswith(_INTERNAL)), default=len(frames) - 1)
    lines = ["Traceback (most recent call last):\n"]
    lines += traceback.format_list(frames[:last + 1])
    lines += traceback.format_exception_only(type(exc), exc)
    sys.stderr.write("".join(lines))


def main(argv: Optional[List[str]] = None) -> int:
    """Runs the track command.

    Args:
        argv: the arguments after ``track`` (default: sys.argv[1:], without a
            leading "track" or "audit").

    Returns:
        The script's exit code (1 if it raised, 2 if it is missing).
    """
    if argv is None:
        argv = sys.argv[1:]
        if argv[:1] and argv[0] in COMMANDS:
            argv = argv[1:]
    opts = build_parser().parse_args(argv)
    if not os.path.isfile(opts.script):
        print(f"python -m torchcast track: no such script: {opts.script}", file=sys.stderr)
        return 2
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [opts.script] + opts.args
    sys.path.insert(0, os.path.dirname(os.path.abspath(opts.script)))
    code = 0
    try:
        with track(all_casts=True, policy=opts.policy, violations=opts.violations,
                   nonfinite=opts.nonfinite, health=opts.health) as report:
            try:
                runpy.run_path(opts.script, run_name="__main__")
            except SystemExit as e:
                code = _exit_code(e)
            except KeyboardInterrupt:
                code = 130
            except Exception as e:  # the script's error: shown, then the report
                _print_script_error(e, opts.script)
                code = 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    print(report.table(limit=opts.top), file=sys.stderr)
    if opts.json:
        with open(opts.json, "w") as f:
            f.write(report.to_json(indent=1))
        print(f"torchcast: report written to {opts.json}", file=sys.stderr)
    if opts.html:
        report.to_html(opts.html)
        print(f"torchcast: HTML report written to {opts.html}", file=sys.stderr)
    return code
