"""Importing torchcast leaves aten's dispatch as it was: the tracker's kernels
on aten::_to_copy are registered by the first track(), once per process, and
stay (destroying a kernel other threads dispatch through crashes them)."""
import json
import subprocess
import sys

import pytest

from torchcast import _ops

# Per dispatch key, the aten ops with a kernel registered there, and the
# dispatch table of aten::_to_copy, where the tracker's kernels go.
PROBE = """
import json, sys, torch
def table():
    keys = {}
    for name in torch._C.DispatchKey.__members__:
        try:
            ops = torch._C._dispatch_get_registrations_for_dispatch_key(name)
        except RuntimeError:
            continue
        keys[name] = sorted(op for op in ops if op.startswith("aten::"))
    return {"keys": keys, "to_copy": torch._C._dispatch_dump("aten::_to_copy")}
tables = {"torch": table()}
import torchcast
tables["import"] = table()
with torchcast.track():
    pass
tables["track"] = table()
print(json.dumps(tables))
"""


@pytest.fixture(scope="module")
def tables():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout)


def test_import_registers_nothing_on_aten(tables):
    assert tables["import"] == tables["torch"]


@pytest.mark.skipif(not _ops.WITH_EXTENSION, reason="the build without the extension "
                    "registers no tracker kernels on aten")
def test_the_first_track_installs_the_tracker_kernels(tables):
    before, after = tables["torch"]["to_copy"], tables["track"]["to_copy"]
    assert "thread_casts.cpp" not in before and "program_casts.cpp" not in before
    lines = [line for line in after.splitlines()
             if "thread_casts.cpp" in line or "program_casts.cpp" in line]
    keys = sorted(line.split(":")[0] for line in lines)
    assert keys == ["ADInplaceOrView", "AutocastCPU", "AutocastCUDA", "AutocastMPS",
                    "AutocastXPU"], after
