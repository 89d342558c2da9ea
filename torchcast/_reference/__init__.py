"""The pure-PyTorch references of torchcast's kernels: the fallback on devices
without compiled kernels (and every kernel of a build without them), and the
independent statements the tests compare the kernels with, bit for bit.

- compensated.py: the Neumaier step, the inf policy (settled), the partials.
- order.py: the canonical summation order (lanes, blocks, the halving tree).
- rounding.py: narrowing casts rounded once, NaN bits as the kernels write them.
- cast.py: cast_with_stats and its argument checks.
- reduce.py: kahan_sum / kahan_mean and their argument checks.
- adam.py: the adam_step_ kernel and its argument checks.

The statistics' layout and merge rules are torchcast.stats' table.
"""
