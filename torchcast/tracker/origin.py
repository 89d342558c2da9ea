"""A non-finite origin (track(nonfinite=...)) as data: the record of the op
that first made NaN or ±inf, or where NaN/inf no watched op made entered
(an entry), with its step, rank and whether its NaN/inf reached; how the
reports say it (``describe``) and order it. nonfinite.py finds the origins;
nonfinite_origin.py holds the error and warning that carry one.
"""
import dataclasses
import math
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..stats import dtype_from_name, short_dtype_name
from .json_floats import float_from_json
from .sites import short_path

# NonFiniteOrigin.rank left out: the rank of the process that makes the origin.
_CURRENT_RANK = -1


def current_rank() -> Optional[int]:
    """This process's rank in the default process group, None outside one."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return dist.get_rank()
    except Exception:  # the group is being torn down
        return None


@dataclasses.dataclass
class InputInfo:
    """A floating input of a non-finite origin."""

    dtype: torch.dtype
    shape: Tuple[int, ...]
    # The largest |x| (its inputs are finite at an origin); -1 for an input
    # the op wrote to that was known finite and not read again.
    amax: float
    overwritten: bool = False  # the op wrote to it: amax is read before the op ran

    def to_dict(self) -> Dict[str, Any]:
        return {"dtype": str(self.dtype), "shape": list(self.shape), "amax": self.amax,
                "overwritten": self.overwritten}

    def describe(self) -> str:
        """e.g. "float16[3] amax 1 (before the op wrote to it)"."""
        if self.overwritten and self.amax < 0:  # kFiniteUnread (csrc/cpu/nonfinite_watch.cpp)
            return (f"{short_dtype_name(self.dtype)}{list(self.shape)} finite before the op "
                    "wrote to it (as the op before it left it; not read again)")
        return (f"{short_dtype_name(self.dtype)}{list(self.shape)} amax {self.amax:.4g}"
                + (" (before the op wrote to it)" if self.overwritten else ""))


@dataclasses.dataclass
class NonFiniteOrigin:
    """An op that produced NaN or ±inf from finite inputs.

    ``module`` is the running module's path in forward and, in backward, the
    path of the module whose forward made the autograd node (``node``, e.g.
    "AddmmBackward0"). ``file``/``line`` are the user's frame (in backward,
    the line that started it, such as ``loss.backward()``), ``via`` the
    library frame it came through. ``nan``, ``posinf``, ``neginf`` count the
    first call's output; ``count`` how many calls at this place were origins.
    ``note`` says what the op gives in a wider dtype. ``worker`` is the
    DataLoader worker id (the pid of another forked process) of an origin
    found in a process forked inside the track, None in the track's own
    process: the label "[worker N]" that cast sites of workers carry.
    ``time`` is ``time.monotonic()`` when the origin was found (on a GPU,
    when its flags were read): the clock is the machine's, so it orders the
    origins of worker processes among the track's own.

    ``step`` is the step the origin first happened in, counted as
    ``step_kind`` says: "optimizer step" when the block ran an optimizer's
    ``step()`` (any ``torch.optim.Optimizer``) in the track's thread, the
    number of the step being built (1 + the optimizer steps taken before it
    since the block began); else "call of Net", the number of calls of the
    first top-level module the block ran (Net; a module called while no
    other module runs; other top-level modules, such as a loss module,
    belong to its steps) begun since the block began, the one running or
    the last one (0 before the first): ``step_phrase`` writes "call 3 of
    Net". ``reached`` says whether its NaN/inf reached, in
    the same step, the block's outputs, the loss or the gradients and
    parameters the step leaves (True; ``reached_at`` says which, and
    ``reached_step`` in which step, counted as ``step``), or were absorbed
    (False: everything checked at the end of its step was finite); None
    while its step runs, for an origin in a worker process, and where the
    block ended by an exception before the step did. An origin that happens
    again is reached if any of its calls reached; ``absorbed_steps`` counts
    the steps in which its calls were absorbed. When NaN/inf reach, every
    undecided origin of the step is marked reached (which one's values they
    were is not traced): one absorbed in other steps is likely a bystander,
    and is listed after those never absorbed. The rule: reach.py.

    In backward, ``forward``, ``forward_file`` and ``forward_line`` name the
    forward method of the module that made ``node`` and where it is defined
    (e.g. "Linear.forward", ".../linear.py", 124): the op's own forward line
    is not recorded (that would take a walk of the Python stack at every
    forward op; docs/numerics.md).
    """

    op: str
    module: Optional[str]
    phase: str
    node: Optional[str]
    file: str
    line: int
    via: Optional[str]
    dtype: torch.dtype
    nan: int
    posinf: int
    neginf: int
    inputs: List[InputInfo]
    note: str
    count: int = 1
    worker: Optional[int] = None
    step: Optional[int] = None
    step_kind: Optional[str] = None  # "optimizer step" or "call of Net" (step_phrase)
    reached: Optional[bool] = None
    reached_at: Optional[str] = None  # e.g. "the loss (a tensor backward() ran from)"
    reached_step: Optional[int] = None
    absorbed_steps: int = 0  # the steps in which its calls' NaN/inf were absorbed
    forward: Optional[str] = None  # in backward: e.g. "Linear.forward"
    forward_file: Optional[str] = None
    forward_line: Optional[int] = None
    # Across torch.distributed ranks (ranks.py): the rank that found it (None
    # outside a process group; left out, the process's rank when made);
    # for NaN/inf that arrived through a collective (its output non-finite,
    # this rank's input finite: a propagation, not an origin), the
    # collective ("all_reduce", "reduce_scatter", "all_gather", ...), its
    # number ("group#n"), and the ranks whose input was non-finite (None:
    # not known; Report.merge_ranks fills it).
    rank: Optional[int] = _CURRENT_RANK
    arrived_through: Optional[str] = None
    from_ranks: Optional[List[int]] = None
    collective: Optional[str] = None
    # An entry (entries.py): NaN/inf that no watched op made came into this
    # op through the arguments this says, e.g. "argument 'mat1': the input
    # of Net (the top-level module)"; None for an op that made them.
    entered: Optional[str] = None
    # Not part of what an origin is: two reports of the same origins are equal.
    time: Optional[float] = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        if self.rank is _CURRENT_RANK:
            self.rank = current_rank()

    @property
    def key(self) -> tuple:
        return (self.op, self.module, self.phase, self.node, self.file, self.line, self.via,
                self.worker, self.rank, self.entered)

    def describe(self) -> str:
        """One paragraph: what, where, in which step, whether it reached the
        outputs or the loss, and why."""
        where = f"{short_path(self.file)}:{self.line}" + (f" via {self.via}" if self.via else "")
        if self.worker is not None:
            where += f" [worker {self.worker}]"
        if self.rank is not None:
            where += f" [rank {self.rank}]"
        if self.phase == "backward":
            made = (f"made by {self.module}'s forward" if self.module
                    else "made outside any tracked module's forward")
            if self.module and self.forward:
                made += f" ({self.forward}, {short_path(self.forward_file)}:{self.forward_line})"
            phase = f"in backward, in the gradient of {self.node}, {made}"
            where += " (the line that ran backward)"
        else:
            # (outside any module an op may be the loss's, or a load_state_dict's
            # copy, or an assignment to the data: no forward to name)
            phase = (f"in {self.module}'s forward" if self.module
                     else "outside any tracked module")
        if self.step is not None:
            where += f", in {step_phrase(self.step_kind, self.step)}"
        reach = self.reach_text()
        reach = f" {reach[0].upper()}{reach[1:]}." if reach else ""
        found = ", ".join(f"{n} {what}" for n, what in
                          ((self.nan, "NaN"), (self.posinf, "+inf"), (self.neginf, "-inf")) if n)
        inputs = "; ".join(i.describe() for i in self.inputs) or "no floating tensor inputs"
        if self.arrived_through is not None:
            return (f"{found} arrived through the {self.arrived_through} ({self.op}) "
                    f"{phase}, at {where}: this rank's input to it was finite (amax: {inputs}), "
                    f"its {short_dtype_name(self.dtype)} output was not, so they were made "
                    f"{self.came_from()}: a propagation, not an origin.{reach}")
        if self.entered is not None:
            return (f"{found} entered at {self.op} {phase}, at {where}, through {self.entered}: "
                    f"no op this track watched made them, they came with the values it was "
                    f"given.{reach} Inputs: {inputs}.")
        return (f"{self.op} made {found} in its {short_dtype_name(self.dtype)} output from finite "
                f"inputs {phase}, at {where}.{reach} Inputs: {inputs}. {self.note}").rstrip()

    def came_from(self) -> str:
        """Where an arrival's NaN/inf were made, e.g. "on rank 1 (whose
        input to it was non-finite)"."""
        ranks = self.from_ranks
        if ranks is None:
            return "on another rank (Report.merge_ranks names which)"
        if not ranks:
            return ("by the collective itself: every rank's input was finite (a sum that "
                    "overflowed)")
        names = ", ".join(map(str, ranks))
        return (f"on rank{'s' if len(ranks) > 1 else ''} {names} (whose input to it was "
                "non-finite)")

    def reach_text(self) -> str:
        """Whether its NaN/inf reached the outputs or the loss, e.g.
        "reached the loss (a tensor backward() ran from) at optimizer step
        3", "absorbed (the step's outputs, loss and gradients stayed
        finite, or GradScaler skipped the step)"; "" where not decided."""
        if self.reached:
            step = f" at {step_phrase(self.step_kind, self.reached_step)}" \
                if self.reached_step is not None else ""
            text = f"reached {self.reached_at}{step}"
            if self.absorbed_steps:
                text += (f", but was absorbed in {self.absorbed_steps} other "
                         f"step{'s' if self.absorbed_steps > 1 else ''}: the NaN/inf that "
                         "reached may be another origin's of that step")
            return text
        if self.reached is False:
            return ("absorbed (the step's outputs, loss and gradients stayed finite, or GradScaler "
                    "skipped the step)")
        return ""

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready values (dtypes as strings)."""
        d = dataclasses.asdict(self)
        d["dtype"] = str(self.dtype)
        d["inputs"] = [i.to_dict() for i in self.inputs]
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "NonFiniteOrigin":
        """An origin from its ``to_dict()`` form (or that form read back from
        JSON, where an input's amax may be "inf", "-inf" or "nan")."""
        d = dict(d)
        d.setdefault("rank", None)  # a report written before ranks were recorded
        d["dtype"] = dtype_from_name(d["dtype"])
        d["inputs"] = [InputInfo(dtype_from_name(i["dtype"]), tuple(i["shape"]),
                                 float_from_json(i["amax"], "an input's amax"),
                                 i.get("overwritten", False))
                       for i in d["inputs"]]
        return cls(**d)


def step_phrase(kind: Optional[str], step: int) -> str:
    """A step as the reports write it: "optimizer step 3", "call 3 of Net",
    "the time before the first call of Net" (step 0)."""
    if kind is not None and kind.startswith("call of "):
        name = kind[len('call of '):]
        return f"call {step} of {name}" if step else f"the time before the first call of {name}"
    return f"{kind} {step}"


def reach_rank(reached: Optional[bool], absorbed_steps: int = 0) -> int:
    """Where an origin goes in the reports (``NonFiniteOrigin.reached`` and
    ``absorbed_steps``): those whose NaN/inf reached the outputs, the loss
    or the gradients and were never absorbed first (0), then those that
    reached but were absorbed in other steps (1: likely bystanders of
    another origin of the step that reached), then the undecided (2), then
    the absorbed (3); a stable sort keeps time order within each.

    Args:
        reached: the origin's ``reached``.
        absorbed_steps: the origin's ``absorbed_steps``.
    """
    if reached:
        return 1 if absorbed_steps else 0
    return 3 if reached is False else 2


def origin_order(origin: NonFiniteOrigin) -> tuple:
    """The order of the origins of several ranks: by step (none last), made
    on a rank before arrived through a collective, then rank and time."""
    return (origin.step is None, origin.step or 0, origin.arrived_through is not None,
            origin.rank if origin.rank is not None else -1,
            origin.time if origin.time is not None else math.inf)
