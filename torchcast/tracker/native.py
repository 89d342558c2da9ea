"""The tracker's C++ parts, as the compiled extension exposes them
(csrc/tracker_module.cpp), each with what stands in for it in a build
without the extension: its kernels on aten, the dtype watch, the non-finite
watch. Nothing here touches torch.ops.torchcast (_ops.py does).
"""
from .._ops import extension as _C

WITH_EXTENSION = _C is not None
# The tracker's kernels on aten::_to_copy (registered by the extension only: a
# Python kernel there receives the wrapped Python numbers of expressions like
# `t - 1` as ints, and cannot pass them on as the tensors they were).
# install_tracker_kernels(): registers the two, once per process; the first
# track() calls it, so that importing torchcast changes no aten dispatch.
install_tracker_kernels = _C.install_tracker_kernels if WITH_EXTENSION else (lambda: None)
# in_program_cast(): whether this thread is inside a cast the program asked
# for while autocast is on (one that passed aten::_to_copy's autocast keys,
# which autocast's own casts bypass): csrc/program_casts.cpp; always False
# without the extension.
in_program_cast = _C.in_program_cast if WITH_EXTENSION else (lambda: False)
# set_cast_callback(callback or None): callback(src, out, dtype) is called at
# every cast in a thread whose casts no track's dispatch mode sees
# (set_thread_tracked; set_thread_direct: a tracking thread on the direct
# route): csrc/thread_casts.cpp. None without the extension.
set_cast_callback = _C.set_cast_callback if WITH_EXTENSION else None
set_thread_tracked = _C.set_thread_tracked if WITH_EXTENSION else (lambda tracked: None)
set_thread_direct = _C.set_thread_direct if WITH_EXTENSION else (lambda direct: None)
# start_dtype_watch(callback), stop_dtype_watch(), pause_dtype_watch(paused):
# csrc/dtype_watch.cpp, the direct route of track(all_casts=True) (None without
# the extension: the dispatch mode serves every track then).
start_dtype_watch = _C.start_dtype_watch if WITH_EXTENSION else None
stop_dtype_watch = _C.stop_dtype_watch if WITH_EXTENSION else None
pause_dtype_watch = _C.pause_dtype_watch if WITH_EXTENSION else (lambda paused: False)
# pause_thread_casts(paused) -> whether they were: this thread's casts are not
# reported while paused (csrc/thread_casts.cpp).
pause_thread_casts = _C.pause_thread_casts if WITH_EXTENSION else (lambda paused: False)
# The C++ per-op check of track(nonfinite=...) (csrc/cpu/nonfinite_watch.cpp):
# start_nonfinite_watch(callback, skip), stop_nonfinite_watch(),
# take_propagated(), account_for_nonfinite(tensor), pause_nonfinite_watch(paused)
# -> whether it was paused.
# None without the extension.
start_nonfinite_watch = _C.start_nonfinite_watch if WITH_EXTENSION else None
stop_nonfinite_watch = _C.stop_nonfinite_watch if WITH_EXTENSION else None
take_propagated = _C.take_propagated if WITH_EXTENSION else (lambda: 0)
account_for_nonfinite = _C.account_for_nonfinite if WITH_EXTENSION else (lambda tensor: None)
pause_nonfinite_watch = _C.pause_nonfinite_watch if WITH_EXTENSION else (lambda paused: False)
# defer_writes(defer) -> batch: the writes of an optimizer's step, checked
# where next read; check_deferred(): reads those left (the watch's end).
defer_writes = _C.defer_writes if WITH_EXTENSION else (lambda defer: -1)
check_deferred = _C.check_deferred if WITH_EXTENSION else (lambda: None)
# nonfinite_seen(): whether a watched op has written NaN/inf since the start.
nonfinite_seen = _C.nonfinite_seen if WITH_EXTENSION else (lambda: False)
