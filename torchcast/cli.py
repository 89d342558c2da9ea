"""``python -m torchcast track [--json FILE] [--html FILE] [--policy P]
[--violations KINDS] [--nonfinite ACTION] [--health] [--top N] SCRIPT.py
[ARGS...]``: runs a script, unmodified, under
``torchcast.track(all_casts=True)`` and prints the report (to stderr) when
the script ends, also when it raises or calls sys.exit. The exit code is the
script's (1 if it raised; 2, before it runs, for a missing script or an
output file that cannot be written). ``audit`` is another name for the same
command."""
import argparse
import gc
import os
import runpy
import sys
import tempfile
import traceback
from typing import List, Optional

import torch

from .tracker import ranks, track
from .violations import DEFAULT, KINDS, Violations

COMMANDS = ("track", "audit")
PROG = "python -m torchcast track"


def usage() -> str:
    """The track command's usage without "usage: " (``python -m torchcast
    --help`` shows it after 7 spaces): built from the parser, so that it
    names every option; continuation lines are indented to follow it."""
    parser = build_parser()
    # 100 columns whatever the terminal's width.
    parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=100)
    return parser.format_usage()[len("usage: "):].rstrip()


def _violations(spec):
    try:
        return Violations(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _top(text):
    """--top: a count of sites, 0 for the summary lines alone."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a number of sites >= 0 (0: only the summary "
                                         f"lines), got {text!r}")
    return n


def _check_writable(parser, option, path):
    """Exits with argparse's error unless ``path`` can be written: checked
    before the script runs, so that a typo does not cost the whole run. The
    file itself is neither created nor truncated (a probe file is made and
    removed beside it: that is what permissions, read-only file systems
    and ACLs all answer to)."""
    if path is None:
        return
    real = os.path.realpath(path)
    directory = os.path.dirname(real)
    if os.path.isdir(real):
        parser.error(f"{option} {path}: is a directory; name a file in it, e.g. "
                     f"{os.path.join(path, 'report.' + option[2:])}")
    if os.path.exists(real) and not os.access(real, os.W_OK):
        parser.error(f"{option} {path}: the file exists and is not writable; make it writable "
                     "or name another file")
    if not os.path.isdir(directory):
        parser.error(f"{option} {path}: no such directory {directory}; create it first or "
                     "name a file in an existing directory")
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".torchcast-probe-"):
            pass
    except OSError as e:
        parser.error(f"{option} {path}: cannot write in {directory} ({e.strerror}); name a file "
                     "in a writable directory")


def _uses_compile(script: str) -> bool:
    """Whether the script's text calls torch.compile (or any ``compile(``):
    then Dynamo is imported before the track starts."""
    try:
        with open(script, encoding="utf-8", errors="replace") as f:
            return "compile(" in f.read()
    except OSError:
        return False


def build_parser():
    parser = argparse.ArgumentParser(
        prog=PROG,
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
                             # argparse %-formats help: the default's "1%" must be "1%%".
                             f"elements above which it counts (default "
                             f"{DEFAULT.replace('%', '%%')!r}; 'all'; "
                             f"kinds: {', '.join(KINDS)}; e.g. 'overflow,nan,subnormal>1%%')")
    parser.add_argument("--nonfinite", choices=("record", "warn", "raise", "raise_at_op"),
                        help="also find the ops that make NaN/inf from finite inputs and where "
                             "NaN/inf no op made enter (the data, a checkpoint): list each, warn "
                             "once per place, stop (raise) where their NaN/inf first reach a "
                             "top-level module's output, the loss or the gradients an optimizer "
                             "reads, before it writes, or (raise_at_op) stop at the first such "
                             "op, even one whose NaN/inf the program would absorb")
    parser.add_argument("--health", action="store_true",
                        help="also measure each module's outputs and gradients (exponent "
                             "histograms, amax, zeros, subnormals) and print their headroom: what "
                             "a cast to float16, bfloat16, float8_e4m3fn and float8_e5m2 would "
                             "lose, at scale 1 and at a power-of-two amax scale")
    parser.add_argument("--top", type=_top, metavar="N",
                        help="print only the N worst sites (0: only the summary lines)")
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


def _rank_paths(opts):
    """Under torchrun (RANK and WORLD_SIZE set): --json and --html with
    .rankN before the extension, so that every rank writes its own report
    (Report.merge_ranks, called in the script, makes one of them)."""
    rank = int(os.environ["RANK"])
    return tuple(ranks.per_rank_path(p, rank) if p else None for p in (opts.json, opts.html))


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
    parser = build_parser()
    opts = parser.parse_args(argv)
    _check_writable(parser, "--json", opts.json)
    _check_writable(parser, "--html", opts.html)
    if not os.path.isfile(opts.script):
        print(f"python -m torchcast track: no such script: {opts.script}", file=sys.stderr)
        return 2
    if _uses_compile(opts.script):
        # The track installs its pass that measures the casts inside compiled
        # graphs only in a process that has imported Dynamo (importing it
        # costs a second, which a script that never compiles should not pay).
        import torch._dynamo  # noqa: F401
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [opts.script] + opts.args
    sys.path.insert(0, os.path.dirname(os.path.abspath(opts.script)))
    code = 0
    tracking = os.getpid()
    tracked = track(all_casts=True, policy=opts.policy, violations=opts.violations,
                    nonfinite=opts.nonfinite, health=opts.health)
    report = None
    try:
        # The script's end leaves the track: an error (the track's own
        # NonFiniteError included) or Ctrl-C is in the report as what ended it.
        with tracked as report:
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
    # The script's objects are unreachable now; collect them while the
    # interpreter is whole. A gloo process group left for Py_Finalize's
    # collection has its worker thread drop Python objects then, and that
    # thread aborts the process (torch 2.13, also without torchcast).
    gc.collect()
    if report is None or os.getpid() != tracking:
        # A process the script forked, run on to the script's end: its track
        # left its records for the tracking process, which reports them all.
        return code
    if ranks.launched_by_torchrun():
        opts.json, opts.html = _rank_paths(opts)
    print(report.table(limit=opts.top), file=sys.stderr)
    if opts.health:
        print(report.headroom_summary(), file=sys.stderr)
    if opts.json:
        # Serialized, then written atomically: a failure leaves no empty file.
        report.write_json(opts.json, indent=1)
        print(f"torchcast: report written to {opts.json}", file=sys.stderr)
    if opts.html:
        report.to_html(opts.html)
        print(f"torchcast: HTML report written to {opts.html}", file=sys.stderr)
    return code
