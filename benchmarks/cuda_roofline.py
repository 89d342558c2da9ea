"""The roofline on paper: for each CUDA kernel, the bytes it must read and
write per element, and the time it may take at 2^28 elements to reach 85% of
the copy bandwidth of an H100 (about 3.35 TB/s) and an H200 (about 4.8 TB/s).
Arithmetic from the kernels' operands, not a measurement: the table the first
GPU run (benchmarks/cuda_bench.py) is judged against; docs/cuda.md shows it.
Partials, histograms and the Adam step's tensor list are left out (at most a
few bytes per 65,536 elements).

    python benchmarks/cuda_roofline.py
"""
N = 2 ** 28
TARGET = 0.85
BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}  # bytes/s
SIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1,
        "float8_e5m2": 1, "int16": 2}
# cast_with_stats' lossy pairs (torchcast/_reference/cast.py's LOSSY_PAIRS).
CAST_PAIRS = [("float64", "float32"), ("float64", "float16"), ("float64", "float8_e4m3fn"),
              ("float32", "float16"), ("float32", "float8_e4m3fn"),
              ("float16", "bfloat16"), ("bfloat16", "float8_e4m3fn")]
# block formats: element bits, elements per scale byte.
BLOCK = {"mxfp8": (8, 32), "mxfp4": (4, 32), "nvfp4": (4, 16)}


def adam_bytes(param, state, mode, amsgrad=False, grad_scale=False):
    """Reads p, g, m, v (vmax, compensation); writes p, m, v (vmax,
    compensation, and g when the kernel unscales it)."""
    p, s = SIZE[param], SIZE[state]
    comp = {"none": 0, "stochastic": 0, "kahan": p, "remainder": SIZE["int16"]}[mode]
    vmax = s if amsgrad else 0
    read = 2 * p + 2 * s + vmax + comp
    write = p + 2 * s + vmax + comp + (p if grad_scale else 0)
    return read + write


def rows():
    for src, dst in CAST_PAIRS:
        yield "cast_with_stats", f"{src} -> {dst}", SIZE[src] + SIZE[dst]
    for dtype in ("float64", "float32", "bfloat16"):
        yield "kahan_sum, kahan_mean", f"{dtype}, one output", SIZE[dtype]
    for dtype in ("float64", "float32", "bfloat16", "float8_e4m3fn"):
        yield "tensor_health", dtype, SIZE[dtype]
    for src in ("float32", "bfloat16"):
        for fmt, (bits, block) in BLOCK.items():
            yield "block_cast", f"{src} -> {fmt}", SIZE[src] + bits / 8 + 1 / block
    for param, state, mode in [("float32", "float32", "none"), ("float32", "float32", "kahan"),
                               ("bfloat16", "float32", "kahan"),
                               ("bfloat16", "float32", "remainder"),
                               ("bfloat16", "bfloat16", "stochastic")]:
        yield "adam_step_", f"{param} params, {state} moments, {mode}", \
            adam_bytes(param, state, mode)
    yield "adam_step_", "float32, kahan, amsgrad, grad_scale", \
        adam_bytes("float32", "float32", "kahan", amsgrad=True, grad_scale=True)


def main():
    names = list(BANDWIDTH)
    print("| kernel | case | bytes/element | " +
          " | ".join(f"{n} at {TARGET:.0%} of {BANDWIDTH[n] / 1e12:g} TB/s" for n in names) + " |")
    print("|---|---|---:|" + "---:|" * len(names))
    for kernel, case, nbytes in rows():
        times = [N * nbytes / (TARGET * BANDWIDTH[n]) * 1e3 for n in names]
        cells = " | ".join(f"{t:.3f} ms" for t in times)
        print(f"| {kernel} | {case} | {nbytes:g} | {cells} |")


if __name__ == "__main__":
    main()
