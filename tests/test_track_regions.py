"""A track never misses a torch.compile'd region silently: the ops Inductor
fuses into its kernels never dispatch, so the report (text, JSON, HTML) names
each compiled region and what the track could not watch inside it; what can
be seen inside is (an overflowing matmul runs as a kernel of its own)."""
import json
import subprocess
import sys
import textwrap

import pytest
import torch

import torchcast
from torchcast.tracker import NonFiniteError


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.fc(x)) * 2


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = torch.compile(Block())
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.block(x))


@pytest.fixture(scope="module")
def overflowing():
    """A model whose compiled block's matmul overflows float32, compiled
    before any track (a region the tracks below did not compile)."""
    torch.manual_seed(0)
    model = Model()
    with torch.no_grad():
        model.block._orig_mod.fc.weight.fill_(1e38)
    model(torch.ones(4, 8))
    return model


def regions_of(report):
    """(function, compiled_in_track, unwatched) of the regions of this file."""
    return [(r.function, r.compiled_in_track, r.unwatched) for r in report.compiled_regions
            if r.file == __file__]


@pytest.mark.parametrize("action", ["record", "raise_at_op"])
def test_an_overflow_inside_a_compiled_block_is_named(overflowing, action):
    x = torch.ones(4, 8)
    if action == "raise_at_op":
        with pytest.raises(NonFiniteError) as caught:
            with torchcast.track(nonfinite="raise_at_op") as report:
                overflowing(x)
        origin = caught.value.origin
    else:
        with torchcast.track(nonfinite="record") as report:
            overflowing(x)
        origin = report.first_nonfinite
    assert origin is not None and origin.op == "aten::addmm" and origin.module == "block"
    assert origin.posinf == 32
    (function, in_track, unwatched), = regions_of(report)
    assert function == "forward" and not in_track
    assert len(unwatched) == 1 and "kernels Inductor fuses" in unwatched[0]
    assert "torch.compile'd region" in str(report)


def test_health_names_the_modules_it_cannot_see(overflowing):
    with torchcast.track(health=True) as report:
        overflowing(torch.ones(4, 8))
    modules = {row.module for row in report.health}
    assert "block" in modules and "block.fc" not in modules
    (function, _, unwatched), = regions_of(report)
    assert unwatched == ("the health of the modules inside it (their hooks do not run)",)
    back = type(report).from_json(report.to_json())
    assert back.compiled_regions == report.compiled_regions
    listed = json.loads(report.to_json())["compiled_regions"]
    assert [r["function"] for r in listed if r["file"] == __file__] == ["forward"]


def test_the_html_page_lists_them(overflowing, tmp_path):
    with torchcast.track(nonfinite="record", health=True) as report:
        overflowing(torch.ones(4, 8))
    report.to_html(str(tmp_path / "r.html"))
    page = (tmp_path / "r.html").read_text()
    # (regions compiled by other tests of this process are listed too)
    assert "Not watched: " in page and "torch.compile region" in page
    assert "kernels Inductor fuses" in page and "test_track_regions.py" in page


def test_a_region_compiled_in_a_track_is_marked_as_run_there():
    # A process that has compiled many frames (the whole suite) may have
    # reached Dynamo's limits: start afresh so that this one compiles.
    torch.compiler.reset()
    f = torch.compile(lambda t: torch.exp(t * 100.0))  # overflows inside one fused kernel
    with torchcast.track(nonfinite="record") as report:
        y = f(torch.ones(3))
    assert torch.isinf(y).all()
    assert report.first_nonfinite is None  # the fused kernel never dispatched
    here = [r for r in regions_of(report) if r[1]]  # (regions compiled before are listed too)
    (function, _, unwatched), = here
    assert function == "<lambda>" and "kernels Inductor fuses" in unwatched[0]


def test_a_track_without_watches_lists_nothing(overflowing):
    with torchcast.track() as report:
        overflowing(torch.ones(4, 8))
    assert report.compiled_regions == []


@pytest.mark.slow
def test_the_cli_measures_casts_inside_a_block_the_script_compiles(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""\
        import torch
        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(8, 8)
            def forward(self, x):
                return self.fc(x).half()
        block = torch.compile(Block())
        y = block(torch.randn(4, 8))
        """))
    out = tmp_path / "r.json"
    run = subprocess.run([sys.executable, "-m", "torchcast", "track", "--json", str(out),
                          str(script)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    records = json.loads(out.read_text())["records"]
    assert [(r["module"], r["line"], r["dtype"]) for r in records] == \
        [("Block", 7, "torch.float16")]
