"""What the compiler says about the CUDA kernels, checked; run by
.ci/cuda_stage.sh after its build (docs/cuda.md, "What the compiler says").

Each csrc/cuda/*.cu is compiled once more with the build's own nvcc command
(ninja -t commands) plus --resource-usage (ptxas -v), -lineinfo (source
lines in the SASS; it does not change the code) and --keep, and per kernel:
  - ptxas' registers, stack frame and spills: no spills (but SPILL_ALLOWANCE);
  - no fused multiply-add that the source did not ask for, which would round
    differently from the CPU kernels (built with -ffp-contract=off): in the
    PTX no floating-point mad, and every floating-point mul, add and sub with
    an explicit rounding mode (which ptxas never fuses: what --fmad=false
    makes nvcc write); in the SASS (nvdisasm -g: cuobjdump -sass with the
    source lines) every FFMA/DFMA either refines an IEEE division or square
    root (it lies in the compiler's division, reciprocal or square-root
    subroutine, comes from a source line with a division or square root, or
    reads a MUFU approximation a few instructions before) or is a product's
    exact error, fma(a, b, -a*b), or is an fma the source calls (fmaf, fma,
    adam_common.h's tc_fma: the Adam step fuses where ATen's CPU kernels do,
    and the CPU kernels call the same fma);
  - no floating-point atomics: every kernel's results promise to be
    deterministic. Those the hardware has (RED, REDG, ATOM, ATOMG, ATOMS on
    F16, BF16, F32, F64: sm_90 writes REDG.E.ADD.F32 where the result is
    unused), and the compare-and-swap loops the compiler writes for those it
    lacks (a float add on shared memory: ATOMS.CAST.SPIN after an FADD),
    told from the same loops for 64-bit integers by the float arithmetic in
    the loop.
With --from-build LOG, the files the build compiled are not compiled again:
the build ran with TORCHCAST_NVCC_FLAGS="--resource-usage -lineinfo --keep
--keep-dir OUT_DIR/build" (.ci/cuda_stage.sh), LOG is its output, and each
file's ptxas report is the block after its nvcc command there (ninja prints
a command's output under it); a file ninja found up to date is compiled
again as above.
--control also compiles adam.cu with --fmad=true and requires the PTX check
to find contractible lines there and the SASS check fused multiply-adds in
most of its kernels, and compiles tests/data/sm90_atomics.cu (float atomics
on global memory, their result used or not, on shared memory, in double;
integer ones) with the build's flags and requires each float one, and no
integer one, to be found: the checks can fail.

    python .ci/cuda_facts.py BUILD_TEMP_DIR OUT_DIR [--from-build LOG] [--control] [--jobs N]

Prints a table per kernel template (markdown) and exits 1 if a check fails.
Needs ninja (the build's), nvdisasm (the toolkit's, else Triton's copy in the
CUDA torch's site-packages) and c++filt."""
import argparse
import collections
import re
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

# Instructions after a MUFU approximation within which the FFMA/DFMA
# refining it lie (ptxas interleaves the refinement with other work).
WINDOW = 40
# Spill bytes (stores or loads) a kernel template may have, else none: nvcc
# 13.0 spills a loop-invariant value or two of 14 to 17 of the 80
# cast_stats_kernel instantiations around the calls to the IEEE division's
# slow path (stored at the kernel's or a chunk's start, reloaded per chunk:
# not per element), whatever the register limit. docs/cuda.md lists them.
SPILL_ALLOWANCE = {"cast_stats_kernel": 16}
FMA_OPS = ("FFMA", "DFMA", "HFMA2")
FLOAT_ATOMIC = re.compile(r"^(RED|REDG|REDS|ATOM|ATOMG|ATOMS)\.\S*"
                          r"\b(F16x2|F16|BF16_V2|BF16x2|BF16|F32x2|F32|F64|FTZ)\b")
# A compare-and-swap that closes a loop (its branch back within a few
# instructions), and the float arithmetic that makes that loop a float atomic.
CAS = re.compile(r"^(ATOMS|ATOMG|ATOM)\.(CAST\.SPIN|CAS)\b")
FLOAT_ARITH = re.compile(r"^(FADD|DADD|HADD2|FMUL|DMUL|HMUL2|FMNMX|DMNMX|HMNMX2|FFMA|DFMA|HFMA2)\b")
# Kernels with float atomics and integer ones, for --control (the source of
# tests/data/sm90_atomics.sass, which tests/test_cuda_facts.py reads).
PLANTED_ATOMICS = Path(__file__).resolve().parents[1] / "tests" / "data" / "sm90_atomics.cu"
PLANTED_FLOAT = ("global_unused", "global_used", "shared_add", "double_unused")
PLANTED_INTEGER = ("int_ok", "s64")
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
REGISTER = re.compile(r"(?<![\w.])[-|!]*R(\d+)\b")
# A source line that asks for a fused multiply-add by name.
EXPLICIT_FMA = re.compile(r"\b(tc_fma|fmaf?)\s*\(")


def tool(name):
    """name on PATH, else beside this Python (the venv's ninja), else in the
    CUDA torch's Triton (which carries nvdisasm; the toolkit may not)."""
    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if path is None:
        triton = Path(sysconfig.get_paths()["purelib"]) / "triton" / "backends" / "nvidia" / "bin"
        found = list(triton.glob(name))
        path = str(found[0]) if found else None
    if path is None:
        sys.exit(f"cuda facts: {name} not found (PATH, {Path(sys.executable).parent}, Triton)")
    return path


def nvcc_commands(build):
    """(stem, command, object) of each csrc/cuda/*.cu in the build's ninja file."""
    out = subprocess.run([tool("ninja"), "-C", str(build), "-t", "commands"], check=True,
                         capture_output=True, text=True).stdout
    found = []
    for line in out.splitlines():
        m = re.search(r" -c (\S+/csrc/cuda/(\w+)\.cu) -o (\S+\.o)", line)
        if "nvcc" in line and m:
            found.append((m.group(2), line, m.group(3)))
    if not found:
        sys.exit(f"cuda facts: no nvcc commands for csrc/cuda/*.cu in {build}/build.ninja")
    return found


def compile_kept(stem, command, obj, out, extra=""):
    keep = out / stem
    keep.mkdir(parents=True, exist_ok=True)
    command = command.replace(obj, str(keep / f"{stem}.o"))
    # The flags a --from-build build carries (TORCHCAST_NVCC_FLAGS) give way to these.
    command = re.sub(r" (--keep-dir[ =]\S+|--keep|--resource-usage|-lineinfo)(?=\s|$)", "", command)
    flags = f"--resource-usage -lineinfo --keep --keep-dir {keep} {extra}"
    proc = subprocess.run(["bash", "-c", f"{command} {flags}"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"cuda facts: compiling {stem}.cu failed:\n{proc.stdout}{proc.stderr}")
    (keep / "ptxas.txt").write_text(proc.stdout + proc.stderr)
    return proc.stdout + proc.stderr, keep


def built(stem, log, kept):
    """(ptxas report, keep directory) of stem.cu from the build's output, or
    None where the build did not compile it."""
    blocks = re.split(r"^\[\d+/\d+\] ", log, flags=re.M)
    for block in blocks:
        first, _, rest = block.partition("\n")
        if "nvcc" in first and re.search(rf" -c \S+/csrc/cuda/{stem}\.cu ", first + " "):
            if not (kept / f"{stem}.ptx").exists():
                sys.exit(f"cuda facts: the build compiled {stem}.cu but kept no {stem}.ptx in "
                         f"{kept}: was TORCHCAST_NVCC_FLAGS set?")
            return rest, kept
    return None


def resource_usage(text):
    """{kernel: (registers, stack bytes, spill stores, spill loads)} from ptxas."""
    usage, frame, current = {}, {}, None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            current = m.group(1)
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            current = m.group(1)
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                      line)
        if m and current:
            frame[current] = tuple(int(g) for g in m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            usage[current] = (int(m.group(1)),) + frame.get(current, (0, 0, 0))
    return usage


@dataclass
class Instruction:
    text: str                # without its predicate
    predicated: bool
    line: tuple | None       # (file, line) of the source it comes from
    subroutine: str | None   # the compiler's subroutine it lies in ($__internal_...)
    label: str | None        # a label just before it


def sass_functions(cubin):
    """{kernel: [Instruction]} from nvdisasm -g (the SASS with the source
    line of each instruction: the build for these facts adds -lineinfo)."""
    return parse_sass(subprocess.run([tool("nvdisasm"), "-g", "-c", str(cubin)], check=True,
                                     capture_output=True, text=True).stdout)


def parse_sass(text):
    """{kernel: [Instruction]} of nvdisasm -g -c's text."""
    functions, name, line, subroutine, label = {}, None, None, None, None
    for raw in text.splitlines():
        m = re.match(r"\.text\.(\S+):", raw)
        if m:
            name, line, subroutine, label = m.group(1), None, None, None
            functions[name] = []
            continue
        m = re.match(r'\s*//## File "(.*)", line (\d+)', raw)
        if m:
            line = (m.group(1), int(m.group(2)))
            continue
        m = re.match(r"\s*(\$__internal_\S+|\.L_x_\d+):", raw)
        if m:
            if m.group(1).startswith("$"):
                subroutine = m.group(1)
            label = m.group(1)
            continue
        m = INSTRUCTION.search(raw)
        if m and name:
            instruction = m.group(2)
            predicate = re.match(r"@!?U?P\w+ ", instruction)
            functions[name].append(Instruction(
                instruction[predicate.end():] if predicate else instruction, bool(predicate),
                line, subroutine, label))
            label = None
    return functions


def ptx_contractible(ptx):
    """Floating-point fma/mad ptxas could have fused, or mul/add/sub without a
    rounding mode (which ptxas may fuse): what --fmad=true writes."""
    bad = re.compile(r"^\s*(@%p\d+ )?(mad(\.rn)?\.f(32|64)|(mul|add|sub)(\.ftz)?\.f(32|64))\b")
    return [line.strip() for line in ptx.splitlines() if bad.match(line)]


_SOURCE = {}


def source_line(where):
    """The text of a source line, comments dropped."""
    path, number = where
    if path not in _SOURCE:
        _SOURCE[path] = Path(path).read_text().splitlines() if Path(path).exists() else []
    lines = _SOURCE[path]
    return lines[number - 1].split("//")[0] if 0 < number <= len(lines) else ""


def fma_census(instructions):
    """FFMA/DFMA counts: (refining a division or square root, the exact
    error of a product, called for by name in the source, other). A refinement lies in the compiler's division,
    reciprocal or square-root subroutine, or comes from a source line with a
    division or square root, or reads (a few instructions after) a MUFU
    approximation; code the compiler hoists out of a loop is attributed to
    the loop's line, hence the last rule. The exact error is fma(a, b, -p)
    with p = a * b, as numerics.h's scaled_to_odd computes it (the CPU's fma
    gives the same exact result). One the source calls for comes from a
    line that names fma (EXPLICIT_FMA). An HFMA2 of zero operands (a move of a
    constant) is not counted."""
    # derived: register -> index of the MUFU it derives from. Forward
    # branches carry it to their targets, where the paths' sets join.
    derived, products, joins = {}, {}, collections.defaultdict(dict)
    refining = exact_error = explicit = other = 0
    for i, ins in enumerate(instructions):
        for q, origin in joins.pop(ins.label, {}).items():
            derived[q] = max(origin, derived.get(q, origin))
        op, _, operands = ins.text.partition(" ")
        base = op.split(".")[0]
        is_fma = base in FMA_OPS and not (base == "HFMA2"
                                          and re.match(r"\S+, -?RZ, -?RZ", operands))
        if ins.subroutine is not None:
            if is_fma and re.search(r"div|rcp|sqrt", ins.subroutine):
                refining += 1
            elif is_fma:
                other += 1
            continue
        if base == "BRA":
            target = re.search(r"\((\.L_x_\d+)\)", operands)
            if target:
                for q, origin in derived.items():
                    joins[target.group(1)][q] = max(origin, joins[target.group(1)].get(q, origin))
            if not ins.predicated:
                derived = {}
            continue
        regs = [int(r) for r in REGISTER.findall(operands)]
        if not regs:
            continue
        wide = base.startswith("D") or "64" in op
        writes = not re.match(r"(ST|RED|ATOM|BAR|.*SETP|FCHK|SHFL|CALL|RET|EXIT)", base)
        dest, sources = (regs[0], regs[1:]) if writes else (None, regs)
        origins = [derived[q] for r in sources for q in ((r, r + 1) if wide else (r,))
                   if q in derived and i - derived[q] <= WINDOW]
        if is_fma:
            args = [a.strip() for a in operands.split(",")[1:]]
            negated = re.fullmatch(r"-R(\d+)(\.reuse)?", args[2]) if len(args) == 3 else None
            product = sorted(REGISTER.findall(",".join(args[:2])))
            text = source_line(ins.line) if ins.line else ""
            if origins or re.search(r"/|sqrt", text):
                refining += 1
            elif negated and products.get(int(negated.group(1))) == product:
                exact_error += 1
            elif EXPLICIT_FMA.search(text):
                explicit += 1
            else:
                other += 1
        if dest is not None:
            products.pop(dest, None)
            if base in ("FMUL", "DMUL"):
                products[dest] = sorted(str(r) for r in sources)
            for q in (dest, dest + 1) if wide else (dest,):
                if base == "MUFU":
                    derived[q] = i
                elif origins:
                    derived[q] = min(origins)
                else:
                    derived.pop(q, None)
    return refining, exact_error, explicit, other


def loop_of(instructions, k):
    """The instructions of the loop that instructions[k] closes: from the
    label its branch back (within 4 after it) targets, to it; else the 4
    before it."""
    for after in instructions[k + 1:k + 5]:
        m = re.match(r"BRA\s+`?\(?([.\w$]+)", after.text)
        if m:
            starts = [j for j in range(k, -1, -1) if instructions[j].label == m.group(1)]
            if starts:
                return instructions[starts[0]:k + 1]
            break
    return instructions[max(0, k - 4):k + 1]


def float_atomics(instructions):
    """The mnemonics of the floating-point atomics among instructions: the
    hardware's, and compare-and-swap loops around float arithmetic."""
    found = set()
    for k, i in enumerate(instructions):
        op = i.text.split(" ")[0]
        if FLOAT_ATOMIC.match(i.text):
            found.add(op)
        elif CAS.match(i.text) and any(FLOAT_ARITH.match(j.text) for j in loop_of(instructions, k)):
            found.add(f"{op} loop")
    return sorted(found)


def template_name(mangled):
    demangled = subprocess.run(["c++filt", mangled], capture_output=True, text=True).stdout.strip()
    demangled = demangled.replace("(anonymous namespace)::", "")
    return re.split(r"[<(]", demangled)[0].split("::")[-1]


def check_file(stem, text, keep):
    """Rows (kernel, ...) and failures of one file's kernels."""
    usage = resource_usage(text)
    ptx = (keep / f"{stem}.ptx").read_text()
    failures = [f"{stem}.ptx: {line}" for line in ptx_contractible(ptx)[:5]]
    rows = []
    for name, instructions in sass_functions(keep / f"{stem}.cubin").items():
        regs, stack, spill_st, spill_ld = usage.get(name, (None, 0, 0, 0))
        refining, exact_error, explicit, other = fma_census(instructions)
        atomics = float_atomics(instructions)
        kernel = template_name(name)
        if max(spill_st, spill_ld) > SPILL_ALLOWANCE.get(kernel, 0):
            failures.append(f"{kernel}: {spill_st} bytes spill stores, {spill_ld} loads, more than "
                            f"its allowance of {SPILL_ALLOWANCE.get(kernel, 0)} ({name})")
        if other:
            failures.append(f"{kernel}: {other} FFMA/DFMA neither in a division or square root, "
                            f"nor a product's exact error, nor an fma of the source ({name})")
        if atomics:
            failures.append(f"{kernel}: floating-point atomics {atomics} ({name})")
        rows.append((f"{stem}.cu", kernel, regs, stack, max(spill_st, spill_ld), refining,
                     exact_error, explicit, other, len(atomics)))
    return rows, failures


def summarize(rows):
    """One line per kernel template: its instantiations' ranges."""
    groups = collections.defaultdict(list)
    for row in rows:
        groups[row[:2]].append(row[2:])
    print("| file | kernel | instantiations | registers | stack bytes | spill bytes (spilling) | "
          "FFMA/DFMA refining a division or sqrt | exact product errors | fma of the source | "
          "other FMA | float atomics |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (file, kernel), values in sorted(groups.items()):
        regs = [v[0] for v in values if v[0] is not None]
        span = lambda xs: f"{min(xs)}-{max(xs)}" if min(xs) != max(xs) else f"{xs[0]}"  # noqa: E731
        spilling = sum(v[2] > 0 for v in values)
        print(f"| {file} | {kernel} | {len(values)} | {span(regs) if regs else '?'} | "
              f"{span([v[1] for v in values])} | {max(v[2] for v in values)} ({spilling}) | "
              f"{sum(v[3] for v in values)} | {sum(v[4] for v in values)} | "
              f"{sum(v[5] for v in values)} | {sum(v[6] for v in values)} | "
              f"{sum(v[7] for v in values)} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build", type=Path, help="the build's temp directory (build.ninja)")
    parser.add_argument("out", type=Path, help="where the kept PTX and cubins go")
    parser.add_argument("--control", action="store_true",
                        help="also check that a --fmad=true compile of adam.cu, and planted "
                        "float atomics, fail the checks")
    parser.add_argument("--from-build", type=Path, metavar="LOG",
                        help="the build's output; it kept its PTX and cubins in OUT/build")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    commands = nvcc_commands(args.build)
    log = args.from_build.read_text() if args.from_build else ""

    def facts_of(command):
        stem = command[0]
        from_build = built(stem, log, args.out / "build") if log else None
        if from_build is not None:
            print(f"cuda facts: {stem}.cu: the build's own PTX, cubin and ptxas report")
            return from_build
        return compile_kept(*command, args.out)

    with ThreadPoolExecutor(args.jobs) as pool:
        compiled = list(pool.map(facts_of, commands))
        if args.control:
            stem, command, obj = next(c for c in commands if c[0] == "adam")
            control = pool.submit(compile_kept, "adam",
                                  command.replace("--fmad=false", "--fmad=true"), obj,
                                  args.out / "control")
            source = re.search(r" -c (\S+) -o ", command).group(1)
            control_atomics = pool.submit(
                compile_kept, PLANTED_ATOMICS.stem,
                command.replace(f" -c {source} ", f" -c {PLANTED_ATOMICS} "), obj,
                args.out / "control")
    rows, failures = [], []
    for (stem, _, _), (text, keep) in zip(commands, compiled):
        r, f = check_file(stem, text, keep)
        rows += r
        failures += f
    summarize(rows)
    if args.control:
        control_rows, caught = check_file("adam", *control.result())
        in_sass = [f for f in caught if "FFMA/DFMA" in f]
        in_ptx = [f for f in caught if f.startswith("adam.ptx")]
        # Each check must catch the contractions: the PTX one before ptxas,
        # the SASS one in most kernels (a contraction on a line with a
        # division or square root reads as the division's refinement).
        if not in_ptx or 2 * len(in_sass) < len(control_rows):
            failures.append(f"control: in adam.cu compiled with --fmad=true the checks found "
                            f"{len(in_ptx)} contractible PTX lines and fused multiply-adds in the "
                            f"SASS of {len(in_sass)} of {len(control_rows)} kernels")
        else:
            print(f"\ncontrol: adam.cu compiled with --fmad=true fails the check, as it must: "
                  f"contractible PTX lines ({len(in_ptx)} shown), and fused multiply-adds in the "
                  f"SASS of {len(in_sass)} of {len(control_rows)} kernels (in the others every "
                  "contraction sits on a line with a division or square root)")
        _, caught = check_file(PLANTED_ATOMICS.stem, *control_atomics.result())
        flagged = {k for k in PLANTED_FLOAT + PLANTED_INTEGER
                   if any(f.startswith(f"{k}: floating-point atomics") for f in caught)}
        missed = [k for k in PLANTED_FLOAT if k not in flagged]
        wrong = [k for k in PLANTED_INTEGER if k in flagged]
        if missed or wrong:
            failures.append(f"control: in {PLANTED_ATOMICS.name} the float atomics of "
                            f"{missed} were not found, and integer ones of {wrong} were")
        else:
            print("control: the planted float atomics fail the check, as they must: "
                  + "; ".join(f for f in caught if "floating-point atomics" in f))
    for f in failures:
        print(f"cuda facts: FAILED: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
