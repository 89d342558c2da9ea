// track(nonfinite="record"/"warn") on CPU programs: every op checked in C++,
// through a RecordFunction callback of the tracking thread (nonfinite_watch.cpp).
#pragma once

#include <Python.h>

#include <cstdint>
#include <string>
#include <vector>

namespace torchcast {

// Starts checking this thread's CPU ops (and those of the autograd threads
// it starts): callback(op, overload, outputs, inputs, before, entered, batch) is
// called, with the GIL, for each op whose floating output holds NaN/inf
// while every floating input and float argument was finite (an origin;
// entered None), or while an input held NaN/inf that no watched op made
// (an entry; entered: the indices of those inputs); batch: None, or for an
// origin among an optimizer step's deferred writes (defer_writes) its batch.
// An op whose callee made them leaves it to the callee. before: per input,
// the amax (a list for a tensor list) of an input the op wrote to, read
// before it did; else None.
// Ops named in skip ("aten::empty", ...), views of an input and torchcast's
// own ops (but safe_to's cast result) are not checked. Call with the GIL
// held; one watch per thread.
void start_nonfinite_watch(PyObject* callback, const std::vector<std::string>& skip);

// Stops this thread's watch.
void stop_nonfinite_watch();

// How many op calls made NaN/inf only from inputs that held some, since the
// last call (every thread's watch).
int64_t take_propagated();

// Records t's storage as one whose NaN/inf, if it holds any, are accounted
// for elsewhere (a collective's output: ranks.py judges what arrives there;
// what an optimizer's step wrote), so that the ops reading it do not take
// them for NaN/inf entering.
void account_for_nonfinite(const at::Tensor& t);

// Whether a watched op has written NaN/inf since the watch started.
bool nonfinite_seen();

// From defer_writes(true) to defer_writes(false) (an optimizer's step), the
// ops of this thread that write to their inputs are not read: each write is
// noted, and checked where an op next reads it and makes NaN/inf from it, or
// by check_deferred; an origin found so is reported with the batch number
// defer_writes(true) returned (-1 when turning off).
int64_t defer_writes(bool defer);

// Reads every noted write not checked yet (the watch's end), reporting the
// origins; forgets them.
void check_deferred();

// Pauses (or resumes) the check in this thread: the tracker's own ops.
// Returns whether it was paused.
bool pause_nonfinite_watch(bool paused);

}  // namespace torchcast
