"""Compensated float32 sums (csrc/numerics.h, csrc/reduce_common.h): the
Neumaier step, the one inf policy, and the policies order.py sums with.

A compensated pair (s, c) is a float32 sum s and the error c it has lost so
far. The cast statistics, kahan_sum / kahan_mean and the Adam step's Kahan
update all build on neumaier_add and settled."""
import torch


def neumaier_add(s, c, v):
    """Neumaier's step: (s + v, c plus what that addition lost), which also
    keeps the low bits of s when v is the larger term."""
    t = s + v
    s_bigger = s.abs() >= v.abs()
    big = torch.where(s_bigger, s, v)
    small = torch.where(s_bigger, v, s)
    return t, c + ((big - t) + small)


def settled(s, c):
    """c, or 0 once s is not finite.

    The one inf policy of every compensated pair. Neumaier's correction turns
    an inf or an overflow into NaN ((inf - inf) in (big - t)), so a c beside
    a non-finite s is noise that must not reach the value: without it s + c
    is what plain IEEE arithmetic gives for inf, -inf, NaN and overflow."""
    return torch.where(torch.isfinite(s), c, torch.zeros_like(c))


class Compensated:
    """Compensated float32 partials (CompensatedSum in csrc/reduce_common.h).

    Every pair it makes is settled. The cast kernels settle only the final
    value (neumaier_value) and the reductions settle each merge; both give
    the same bits, because s never depends on c and, once not finite, stays
    so: settling earlier zeroes only a c that the value would drop anyway."""
    acc = torch.float32
    add = staticmethod(neumaier_add)

    @staticmethod
    def from_lane(s, c):
        return s, settled(s, c)

    @staticmethod
    def merge(a, b):
        """Folds the pair b = (s2, c2) into a = (s, c): s2 by a Neumaier step,
        c2 plainly (the compensations are tiny)."""
        s, c = neumaier_add(a[0], a[1], b[0])
        return s, settled(s, c + b[1])

    @staticmethod
    def value(s, c):
        """The pair's value in float64: exact unless the exponents of s and c
        are more than 29 apart, and then rounded once."""
        return s.double() + c.double()


class PlainDouble:
    """float64 inputs: a plain float64 sum in the same order (c stays 0)."""
    acc = torch.float64

    @staticmethod
    def add(s, c, v):
        return s + v, c

    @staticmethod
    def from_lane(s, c):
        return s, torch.zeros_like(c)

    @staticmethod
    def merge(a, b):
        return a[0] + b[0], a[1]

    @staticmethod
    def value(s, c):
        return s
