"""audit(): one forward and backward of a model before training, checked for
the dtype and device mistakes that break or quietly degrade it; every finding
comes with a concrete fix. The model and the optimizer are left exactly as
they were."""
import dataclasses
import json
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from .stats import short_dtype_name
from .tracker import Report, track
from .tracker.modules import autocast_on, current_module
from .tracker.report_table import undone_upcast_message
from .violations import STRICT

_SEVERITIES = ("error", "warning", "info")


@dataclasses.dataclass(frozen=True)
class Finding:
    """One problem ``torchcast.audit`` found, with its fix. Frozen; prints as
    ``[severity] kind at where: message`` and the fix on the next line.

    Attributes:
        kind (str): what was found: "mixed_dtypes", "mixed_devices",
            "optimizer_state", "optimizer_params", "input_dtype",
            "input_device", "target_dtype", "graph_cut", "imag_dropped",
            "lossy_cast", "rounding", "undone_upcast" (a manual upcast that
            autocast casts back at the same line), "promotion" (an op whose
            float64 operand made its result float64), or "forward_error", "loss_error",
            "backward_error" for an exception in that phase.
        severity (str): "error" (fails, or computes something else than
            meant), "warning" (loses precision or time) or "info" (expected
            rounding, shown for the record).
        where (str): a module path, parameter name, loss function or source
            line (file:line).
        message (str): what is wrong, with the dtypes and devices involved.
        fix (str): a concrete change that removes it.
    """

    kind: str
    severity: str
    where: str
    message: str
    fix: str

    def to_dict(self) -> Dict[str, str]:
        """Returns:
            dict: the five fields by name (JSON-serializable)."""
        return dataclasses.asdict(self)

    def __str__(self):
        return f"[{self.severity}] {self.kind} at {self.where}: {self.message}\n    fix: {self.fix}"


class AuditReport:
    """What ``torchcast.audit`` returns. Prints as a summary line, the
    findings, then the casts.

    Args:
        findings (list of Finding): in any order; kept sorted by severity.
        casts (torchcast.Report): the casts recorded during the audit.
        ran_backward (bool): whether the backward pass ran to its end.

    Attributes:
        findings (list of Finding): errors first, then warnings, then infos.
        casts (torchcast.Report): every cast met in forward and backward
            (``track(all_casts=True)``), with its stats and site.
        ran_backward (bool): as passed; False when there was no loss to
            differentiate or the forward, loss or backward raised.
    """

    def __init__(self, findings: List[Finding], casts: Report, ran_backward: bool) -> None:
        order = {s: i for i, s in enumerate(_SEVERITIES)}
        self.findings = sorted(findings, key=lambda f: order[f.severity])
        self.casts = casts
        self.ran_backward = ran_backward

    def of_kind(self, kind: str) -> List[Finding]:
        """Args:
            kind (str): a ``Finding.kind``, e.g. "input_dtype".

        Returns:
            list of Finding: the findings of that kind, worst first.
        """
        return [f for f in self.findings if f.kind == kind]

    @property
    def errors(self) -> List[Finding]:
        """list of Finding: the findings of severity "error"."""
        return [f for f in self.findings if f.severity == "error"]

    @property
    def ok(self) -> bool:
        """bool: True when there is no error and no warning (infos only)."""
        return all(f.severity == "info" for f in self.findings)

    def __str__(self):
        counts = {s: sum(f.severity == s for f in self.findings) for s in _SEVERITIES}
        lines = [f"torchcast.audit: {counts['error']} errors, {counts['warning']} warnings, "
                 f"{counts['info']} notes"
                 + ("" if self.ran_backward else " (backward did not run)")]
        lines += [str(f) for f in self.findings]
        lines += ["", "casts on the way (forward and backward):", str(self.casts)]
        return "\n".join(lines)

    def to_dict(self) -> Dict[str, Any]:
        """Returns:
            dict: the report as plain data, with ``format`` and ``version``
            keys, the findings as ``Finding.to_dict`` gives them and the
            casts as ``Report.to_dict``."""
        return {"format": "torchcast.audit.AuditReport", "version": 1,
                "ran_backward": self.ran_backward,
                "findings": [f.to_dict() for f in self.findings], "casts": self.casts.to_dict()}

    def to_json(self, **kwargs: Any) -> str:
        """Args:
            **kwargs: passed to ``json.dumps`` (e.g. ``indent=2``).

        Returns:
            str: ``to_dict()`` as strict JSON (``allow_nan=False``).
        """
        return json.dumps(self.to_dict(), allow_nan=False, **kwargs)


def _by_key(named, key):
    groups = {}
    for name, t in named:
        groups.setdefault(key(t), []).append(name)
    return groups


def _listing(groups):
    def names(ns):
        return ", ".join(ns[:3]) + (f", ... ({len(ns)} in all)" if len(ns) > 3 else "")
    return "; ".join(f"{k}: {names(ns)}" for k, ns in groups.items())


def _model_findings(model):
    named = list(model.named_parameters()) + list(model.named_buffers())
    found = []
    floating = _by_key([(n, t) for n, t in named if t.is_floating_point()],
                       lambda t: short_dtype_name(t.dtype))
    if len(floating) > 1:
        major = max(floating, key=lambda k: len(floating[k]))
        found.append(Finding(
            "mixed_dtypes", "warning", type(model).__name__,
            f"floating parameters and buffers come in {len(floating)} dtypes: "
            f"{_listing(floating)}. Every op where they meet promotes or fails.",
            f"model.to(torch.{major}) once after building it; if the mix is meant (e.g. "
            "float32 norms in a low-precision model), keep the weights in one dtype and use "
            "torch.autocast instead."))
    devices = _by_key(named, lambda t: str(t.device))
    if len(devices) > 1:
        found.append(Finding(
            "mixed_devices", "error", type(model).__name__,
            f"parameters and buffers live on {len(devices)} devices: {_listing(devices)}.",
            "model.to(device) once, before building the optimizer."))
    return found


def _optimizer_findings(model, optimizer):
    names = {p: n for n, p in model.named_parameters()}
    found = []
    foreign = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names.get(p)
            if name is None:
                foreign += 1
                continue
            state = optimizer.state.get(p)  # .get: optimizer.state is a defaultdict
            for key, value in (state or {}).items():
                # Only per-element states: scalars such as Adam's "step" live on
                # the CPU in float32 by design.
                if not isinstance(value, torch.Tensor) or value.shape != p.shape:
                    continue
                if value.dtype != p.dtype or value.device != p.device:
                    found.append(Finding(
                        "optimizer_state", "error", f"{name} state[{key!r}]",
                        f"optimizer state is {short_dtype_name(value.dtype)} on {value.device}, "
                        f"its parameter {short_dtype_name(p.dtype)} on {p.device}: the next "
                        "step() fails or mixes precisions.",
                        "optimizer.load_state_dict(optimizer.state_dict()) casts every "
                        "state to its parameter's dtype and device; or build the optimizer "
                        "after model.to(...)/model.half()."))
    if foreign:
        found.append(Finding(
            "optimizer_params", "error", type(optimizer).__name__,
            f"{foreign} of the optimizer's tensors are not parameters of this model: it "
            "would update another model's weights.",
            "build the optimizer from this model: type(optimizer)(model.parameters(), ...)."))
    return found


_CLASS_INDEX_LOSSES = (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss, F.cross_entropy, F.nll_loss)
_BINARY_LOSSES = (torch.nn.BCEWithLogitsLoss, torch.nn.BCELoss,
                  F.binary_cross_entropy_with_logits, F.binary_cross_entropy)
_REGRESSION_LOSSES = (torch.nn.MSELoss, torch.nn.L1Loss, torch.nn.SmoothL1Loss, torch.nn.HuberLoss,
                      F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss)


def _is(loss_fn, family):
    return any(loss_fn is f or (isinstance(f, type) and isinstance(loss_fn, f)) for f in family)


def _target_findings(loss_fn, output, target, model):
    """Target dtype checks; ``output`` may be None (the forward failed): then
    only what the target alone tells is checked, against the model's dtype."""
    if not isinstance(target, torch.Tensor):
        return []
    if not isinstance(output, torch.Tensor):
        output = None
    out_dtype = output.dtype if output is not None else next(
        (p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    where = getattr(loss_fn, "__name__", type(loss_fn).__name__)
    t, o = short_dtype_name(target.dtype), short_dtype_name(out_dtype)
    if _is(loss_fn, _CLASS_INDEX_LOSSES):
        if target.is_floating_point():
            if output is None:
                return []  # probabilities or indices: the output's shape tells
            if target.shape == output.shape:
                if target.dtype != output.dtype:
                    return [Finding("target_dtype", "warning", where,
                                    f"class-probability targets are {t}, the logits {o}: the "
                                    "loss is computed in the wider dtype.",
                                    f"target.to(torch.{o}) once, where the targets are made.")]
                return []
        if target.dtype not in (torch.int64, torch.uint8):
            return [Finding("target_dtype", "error", where,
                            f"class-index targets are {t}; the loss expects int64 (long) class "
                            "indices.",
                            "target = target.long(), or build it with dtype=torch.long "
                            "(torch.as_tensor(labels, dtype=torch.long)).")]
        return []
    family = ("binary" if _is(loss_fn, _BINARY_LOSSES)
              else "regression" if _is(loss_fn, _REGRESSION_LOSSES) else None)
    if family is None or not out_dtype.is_floating_point:
        return []
    if not target.is_floating_point():
        severity = "error" if family == "binary" else "warning"
        consequence = ("the loss fails" if family == "binary"
                       else "it is converted on every call")
        return [Finding("target_dtype", severity, where,
                        f"{family} loss with {t} targets and {o} outputs: {consequence}.",
                        f"target.to(torch.{o}) once, where the targets are made.")]
    if target.dtype != out_dtype:
        return [Finding("target_dtype", "warning", where,
                        f"targets are {t}, the outputs {o}: the loss is promoted to the wider "
                        "dtype and its gradient cast back.",
                        f"target.to(torch.{o}) once, where the targets are made.")]
    return []


class _InputCheck:
    """A global forward pre-hook (only during the audit) comparing each
    module's floating inputs with its own weights."""

    def __init__(self):
        self.findings = {}

    def __call__(self, module, args):
        weights = [p for p in module.parameters(recurse=False) if p.is_floating_point()]
        if not weights:
            return
        w = weights[0]
        where = current_module() or type(module).__name__
        for i, x in enumerate(args):
            if not isinstance(x, torch.Tensor):
                continue
            if x.device != w.device and (where, "device") not in self.findings:
                self.findings[(where, "device")] = Finding(
                    "input_device", "error", where,
                    f"input {i} is on {x.device}, the weights of {type(module).__name__} on "
                    f"{w.device}.", f"move the batch once: x = x.to({str(w.device)!r}).")
            if (x.is_floating_point() and x.dtype != w.dtype
                    and not autocast_on(x.device.type)
                    and (where, "dtype") not in self.findings):
                self.findings[(where, "dtype")] = Finding(
                    "input_dtype", "error", where,
                    f"input {i} is {short_dtype_name(x.dtype)}, the weights of "
                    f"{type(module).__name__} {short_dtype_name(w.dtype)}"
                    + (" (float64 is what numpy arrays hold)" if x.dtype == torch.float64 else "")
                    + ".",
                    f"convert the data once where it is loaded: "
                    f"torch.as_tensor(array, dtype=torch.{short_dtype_name(w.dtype)}) (or "
                    f"x.to(torch.{short_dtype_name(w.dtype)})), not in every forward.")


def _cast_findings(report):
    found = [Finding("undone_upcast", "warning", up.site, undone_upcast_message(up) + ".",
                     "torch.autocast(device_type, enabled=False) around the region (and drop the "
                     "manual casts autocast undoes)")
             for up, _ in report.undone_upcasts()]
    undone = {key for up, back in report.undone_upcasts() for key in (up.key, back.key)}
    for r in report.records:
        s = r.stats
        violations = r.violations(report.rtol, report.atol, report.kinds)
        if r.key in undone and not violations:  # said once, above
            continue
        if r.origin.startswith("promotion"):
            found.append(Finding(
                "promotion", "warning", r.site,
                f"{r.origin}: float64 and {short_dtype_name(r.src_dtype)} operands, "
                f"{r.calls} calls, {s.numel} result elements in float64.",
                "make the float64 operand (often a target or a constant from numpy) "
                f"{short_dtype_name(r.src_dtype)} where it is created, e.g. "
                f"torch.as_tensor(array, dtype=torch.{short_dtype_name(r.src_dtype)})."))
            continue
        if not violations and not (r.measured and s.inexact):
            continue
        src, dst = short_dtype_name(r.src_dtype), short_dtype_name(r.dtype)
        what = f"{r.origin} {src}->{dst}, {r.calls} calls, {s.numel} elements"
        if r.graph_cuts:
            found.append(Finding(
                "graph_cut", "error", r.site,
                f"{what}: a tensor that requires grad is cast to {dst}; nothing before this "
                "line gets a gradient through it.",
                "if an integer index is meant, say so with x.detach().to(...); if the value "
                "must carry gradient, keep it floating (torch.round/floor keep the graph) or "
                "use a straight-through estimator: x + (x.round() - x).detach()."))
        elif r.imag_dropped:
            found.append(Finding(
                "imag_dropped", "error", r.site,
                f"{what}: {r.imag_dropped} nonzero imaginary parts dropped.",
                "take x.real or x.abs() explicitly, or keep a complex dtype."))
        elif violations:
            hint = ("use bfloat16 (float32's range) or torch.amp.GradScaler for float16"
                    if r.dtype == torch.float16 else f"rescale the values or keep {src}")
            found.append(Finding(
                "lossy_cast", "warning", r.site,
                f"{what}: {', '.join(violations)} (max rel err {s.max_rel_err:.3g}).",
                f"{hint}; torchcast.safe_to(x, torch.{dst}, policy='raise') at this line "
                "stops at the first such cast."))
        elif r.origin in ("autocast", "backward"):
            found.append(Finding(
                "rounding", "info", r.site,
                f"{what}: {s.inexact} rounded (max rel err {s.max_rel_err:.3g}), as "
                f"{r.origin} casts do.",
                "expected; wrap precision-sensitive code in "
                "torch.autocast(device_type, enabled=False) to keep it in float32."))
        else:
            found.append(Finding(
                "rounding", "warning" if r.src_dtype == torch.float64 else "info", r.site,
                f"{what}: {s.inexact} rounded (max rel err {s.max_rel_err:.3g}).",
                f"if {dst} is meant, convert once where the data is made "
                f"(torch.as_tensor(array, dtype=torch.{dst})) and mark deliberate casts with "
                f"torchcast.safe_to; if {src} precision matters, keep {src} end to end."))
    return found


class _Preserved:
    """Leaves the model as it was: gradients, buffers (running statistics),
    and the random number generators that dropout draws from."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.grads = [(p, p.grad) for p in self.model.parameters()]
        for p, _ in self.grads:
            p.grad = None
        self.buffers = [(m, name, b, b.detach().clone()) for m in self.model.modules()
                        for name, b in m._buffers.items() if b is not None]
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            for m, name, b, saved in self.buffers:
                m._buffers[name] = b
                b.copy_(saved)
        for p, g in self.grads:
            p.grad = g
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        return False


def _call(model, inputs):
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _outputs(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _outputs(o)]
    return []


def _error(kind, where, exc, fix):
    return Finding(kind, "error", where, f"{type(exc).__name__}: {exc}".splitlines()[0], fix)


def audit(model: torch.nn.Module, example_inputs: Any,
          optimizer: Optional[torch.optim.Optimizer] = None, *,
          target: Optional[torch.Tensor] = None,
          loss_fn: Optional[Callable[..., torch.Tensor]] = None) -> AuditReport:
    """Checks one training step of ``model`` for the dtype and device
    mistakes that break it or quietly degrade it, before training: runs one
    forward and backward on ``example_inputs`` under
    ``torchcast.track(all_casts=True)`` and reports, each with a fix:

    - parameters and buffers of mixed dtypes or devices;
    - module inputs whose dtype or device differs from the weights they meet
      (float64 numpy data into a float32 model), outside autocast;
    - targets of the wrong dtype for ``loss_fn`` (int32 class indices, integer
      targets for BCE, float64 targets that promote the loss);
    - optimizer states whose dtype or device differs from their parameter,
      and optimizer tensors that are not this model's parameters;
    - the casts with losses met in forward and backward (overflow, underflow,
      graph cuts, dropped imaginary parts, and rounding).

    Exceptions in forward, loss or backward become findings. Run it under
    ``torch.autocast`` to audit an autocast step. Nothing of the model
    (parameters, gradients, buffers), the optimizer or the random number
    generators changes; the optimizer does not step.

    Args:
        model (torch.nn.Module): the model to check.
        example_inputs (Tensor, tuple, list or dict): one batch: a tensor,
            the positional inputs as a tuple or list, or the keyword inputs
            as a dict.
        optimizer (torch.optim.Optimizer, optional): its states and params
            are checked against the model's.
        target (Tensor, optional): the targets for ``loss_fn``; pass both or
            neither.
        loss_fn (Callable, optional): called as ``loss_fn(output, target)``,
            a function or a module (such as ``torch.nn.CrossEntropyLoss()``);
            without it the loss is the sum of the floating outputs that
            require grad.

    Returns:
        AuditReport: the findings, worst first, and the casts met.

    Raises:
        TypeError: ``model`` is not a torch.nn.Module, or only one of
            ``target`` and ``loss_fn`` is given.

    Example::

        >>> report = torchcast.audit(model, batch, optimizer, target=labels,
        ...                          loss_fn=torch.nn.functional.cross_entropy)
        >>> print(report)
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"torchcast.audit: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    if (target is None) != (loss_fn is None):
        raise TypeError("torchcast.audit: pass target and loss_fn together (or neither)")
    findings = _model_findings(model)
    if optimizer is not None:
        findings += _optimizer_findings(model, optimizer)
    check = _InputCheck()
    ran_backward = False
    # Every loss from the first element (STRICT): audit grades each finding itself.
    with _Preserved(model), track(all_casts=True, policy="record", violations=STRICT) as casts:
        handle = torch.nn.modules.module.register_module_forward_pre_hook(check)
        try:
            out = _call(model, example_inputs)
            failure = None
        except Exception as e:  # the audit reports what breaks the step
            out, failure = None, e
        finally:
            handle.remove()
        findings += list(check.findings.values())
        if failure is not None:
            findings.append(_error("forward_error", type(model).__name__, failure,
                                   "see the findings above for its cause" if check.findings
                                   else "run the forward alone to see the failing line"))
        if loss_fn is not None:
            findings += _target_findings(loss_fn, out, target, model)
        loss = None
        if out is not None and loss_fn is not None:
            try:
                loss = loss_fn(out, target)
            except Exception as e:
                findings.append(_error("loss_error", getattr(loss_fn, "__name__",
                                                             type(loss_fn).__name__), e,
                                       "fix the target's dtype or shape as found above"))
        elif out is not None:
            terms = [o.sum() for o in _outputs(out) if o.is_floating_point() and o.requires_grad]
            loss = sum(terms) if terms else None
        if loss is not None and loss.requires_grad:
            try:
                loss.backward()
                ran_backward = True
            except Exception as e:
                findings.append(_error("backward_error", "backward", e,
                                       "see the findings above for its cause"))
    findings += _cast_findings(casts)
    return AuditReport(findings, casts, ran_backward)


__all__ = ["AuditReport", "Finding", "audit"]
