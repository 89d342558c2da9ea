"""The kernels' canonical summation order in PyTorch: the lanes a sequence is
dealt to and the trees that combine them, as csrc/numerics.h and
csrc/reduce_common.h define them. The cast statistics (cast.py) and
kahan_sum / kahan_mean (reduce.py) are both sums in this order.

Each function takes a policy from compensated.py (how a value joins a lane,
how two partials merge, what a partial's value is). Shapes are batched: every
function works on the last dim, elementwise over the others."""
import torch

# Mirrors csrc/numerics.h.
BLOCK_THREADS = 128
WARP = 32
CHUNK = 1 << 16


def thread_lanes(element_size: int) -> int:
    """How many lanes one CUDA thread owns: a 16-byte load of the input."""
    return 16 // element_size


def halving_tree(s, c, merge):
    """Reduces the last dim (a power of two) by shuffle-down steps: element i
    takes element i + off for off = n/2, n/4, ..., 1."""
    off = s.shape[-1] // 2
    while off:
        s, c = merge((s[..., :off], c[..., :off]), (s[..., off:2 * off], c[..., off:2 * off]))
        off //= 2
    return s[..., 0], c[..., 0]


def block_tree(s, c, merge):
    """block_tree_reduce over the last dim (BLOCK_THREADS values): the tree
    inside each warp, then the same tree over the warps' results."""
    shape = (*s.shape[:-1], BLOCK_THREADS // WARP, WARP)
    s, c = halving_tree(s.reshape(shape), c.reshape(shape), merge)
    return halving_tree(s, c, merge)


def reduce_partials(s, c, merge):
    """reduce_partials over the last dim: thread t folds partials t,
    t + BLOCK_THREADS, ... in sequence, then the block tree combines them."""
    n = s.shape[-1]
    rows = max(1, -(-n // BLOCK_THREADS))
    grid_s = s.new_zeros(*s.shape[:-1], rows * BLOCK_THREADS)
    grid_c = torch.zeros_like(grid_s)
    grid_s[..., :n], grid_c[..., :n] = s, c
    grid_s = grid_s.unflatten(-1, (rows, BLOCK_THREADS))
    grid_c = grid_c.unflatten(-1, (rows, BLOCK_THREADS))
    ts, tc = torch.zeros_like(grid_s[..., 0, :]), torch.zeros_like(grid_c[..., 0, :])
    for r in range(rows):
        ts, tc = merge((ts, tc), (grid_s[..., r, :], grid_c[..., r, :]))
    return block_tree(ts, tc, merge)


def lane_sums(rows, lanes, pol):
    """Cuts each row of rows [k, m] into segments of CHUNK elements and sums
    element e of a segment into lane e % lanes: (s, c) of shape [k, nseg, lanes]."""
    k, m = rows.shape
    nseg = -(-m // CHUNK)
    steps = -(-min(m, CHUNK) // lanes)
    # A single segment is padded to whole steps only; zeros are exact no-ops.
    seg_len = CHUNK if nseg > 1 else steps * lanes
    padded = rows.new_zeros(k, nseg * seg_len)
    padded[:, :m] = rows
    v = padded.view(k, nseg, seg_len // lanes, lanes)
    s = rows.new_zeros(k, nseg, lanes)
    c = torch.zeros_like(s)
    for step in range(steps):
        s, c = pol.add(s, c, v[:, :, step])
    return pol.from_lane(s, c)


def block_partials(rows, vec, pol):
    """One pair per segment of each row, as a CUDA block per chunk makes it:
    BLOCK_THREADS * vec lanes, each thread folding its vec lanes in order into
    an empty sum, then the block tree. [k, m] -> [k, nseg]."""
    s, c = lane_sums(rows, BLOCK_THREADS * vec, pol)
    s, c = s.unflatten(-1, (BLOCK_THREADS, vec)), c.unflatten(-1, (BLOCK_THREADS, vec))
    ts, tc = torch.zeros_like(s[..., 0]), torch.zeros_like(c[..., 0])
    for j in range(vec):
        ts, tc = pol.merge((ts, tc), (s[..., j], c[..., j]))
    return block_tree(ts, tc, pol.merge)


def warp_partials(rows, pol):
    """One pair per segment of each row, as a CUDA warp per segment makes it:
    WARP lanes combined by the in-warp tree. [k, m] -> [k, nseg]."""
    return halving_tree(*lane_sums(rows, WARP, pol), pol.merge)


def thread_partials(rows, pol):
    """One pair per segment of each row, each a single sequential sum.
    [k, m] -> [k, nseg]."""
    s, c = lane_sums(rows, 1, pol)
    return s[..., 0], c[..., 0]


def total(partials, pol):
    """The float64 value of each row from its segment partials."""
    return pol.value(*reduce_partials(*partials, pol.merge))

