"""Attribution past library code: a cast made inside a library (files under
site-packages and the standard library, or directories given to
set_library_dirs) is recorded at the user's line that called into it, with
the library frame as ``via``."""
import importlib
import inspect
import json
import os
import sys
import sysconfig
import textwrap
import threading

import pytest
import torch

import torchcast
from torchcast.tracker import library_dirs, set_library_dirs
from torchcast.tracker.sites import short_path, user_site

LIBRARY = textwrap.dedent("""
    import sys

    import torch

    from torchcast.tracker.sites import user_site


    class HalfModel(torch.nn.Linear):
        def half(self):  # an override, as transformers' PreTrainedModel.half
            return super().half()


    @torch.no_grad()
    def to_half(x):
        return x.half()


    def where_am_i():
        return user_site(sys._getframe(), skip_own=False)


    def record_site(out):
        out.append(user_site(sys._getframe(), skip_own=False))
""")


@pytest.fixture
def fakelib(tmp_path, monkeypatch):
    """A library package in a directory declared as library code."""
    (tmp_path / "fakelib").mkdir()
    (tmp_path / "fakelib" / "__init__.py").write_text("")
    (tmp_path / "fakelib" / "modeling.py").write_text(LIBRARY)
    monkeypatch.syspath_prepend(str(tmp_path))
    previous = set_library_dirs(library_dirs() + (str(tmp_path),))
    module = importlib.import_module("fakelib.modeling")
    yield module
    set_library_dirs(previous)
    sys.modules.pop("fakelib.modeling", None)
    sys.modules.pop("fakelib", None)


def line_in(module, text):
    lines = inspect.getsource(module).splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def test_a_libraries_override_is_attributed_to_the_users_call(fakelib):
    model = fakelib.HalfModel(4, 4)
    with torchcast.track(all_casts=True) as report:
        model.half(); call_line = inspect.currentframe().f_lineno  # noqa: E702
    (record,) = report.records
    assert (record.file, record.line) == (__file__, call_line)
    assert record.via == f"fakelib/modeling.py:{line_in(fakelib, 'return super().half()')}"
    assert record.calls == 2 and record.stats.numel == 20  # weight and bias
    assert record.site.endswith(f"via {record.via}")
    assert f"via {record.via}" in str(report)
    back = torchcast.Report.from_json(report.to_json())
    assert [r.key for r in back.records] == [record.key]
    assert json.loads(report.to_json())["records"][0]["via"] == record.via


def test_a_no_grad_library_helper_is_attributed_to_its_caller(fakelib):
    with torchcast.track(all_casts=True) as report:
        fakelib.to_half(torch.ones(3)); call_line = inspect.currentframe().f_lineno  # noqa: E702
    (record,) = report.records
    assert (record.file, record.line) == (__file__, call_line)
    assert record.via == f"fakelib/modeling.py:{line_in(fakelib, 'return x.half()')}"


def test_without_library_dirs_the_library_line_is_the_site(fakelib):
    previous = set_library_dirs(())
    try:
        with torchcast.track(all_casts=True) as report:
            fakelib.to_half(torch.ones(3))
    finally:
        set_library_dirs(previous)
    (record,) = report.records
    assert record.file.endswith(os.path.join("fakelib", "modeling.py")) and record.via is None


def test_only_library_frames_give_the_outermost_one_with_the_innermost_as_via(fakelib):
    """A thread that runs library code only (threading's own frames are the
    standard library's): the site is the outermost library frame, the
    innermost is ``via``."""
    found = []
    thread = threading.Thread(target=fakelib.record_site, args=(found,))
    thread.start()
    thread.join()
    (site,) = found
    assert os.path.basename(site.file) == "threading.py"
    assert site.via == f"fakelib/modeling.py:{line_in(fakelib, 'out.append(user_site(')}"
    assert fakelib.where_am_i() == (__file__, inspect.currentframe().f_lineno,
                                    f"fakelib/modeling.py:{line_in(fakelib, 'return user_site(')}")


def test_library_dirs_are_site_packages_and_the_standard_library():
    paths = sysconfig.get_paths()
    for key in ("purelib", "stdlib"):
        assert os.path.abspath(paths[key]) + os.sep in library_dirs()
    purelib = os.path.abspath(paths["purelib"])
    assert short_path(os.path.join(purelib, "transformers", "modeling_utils.py")) == \
        os.path.join("transformers", "modeling_utils.py")
    assert user_site(sys._getframe(), skip_own=False).file == __file__
