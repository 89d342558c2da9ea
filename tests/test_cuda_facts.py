""".ci/cuda_facts.py's search for floating-point atomics, on the SASS that
nvcc 13.0 writes for sm_90 (tests/data/sm90_atomics.sass, of
tests/data/sm90_atomics.cu): REDG where the result is unused, ATOMG where
it is used, the compare-and-swap loop ATOMS.CAST.SPIN for a float add on
shared memory are found; integer atomics, and the same loop for 64-bit
integers on shared memory, are not. (CI's CUDA stage runs the script
itself, whose --control plants float atomics.)"""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.source_tree


@pytest.fixture(scope="module")
def facts():
    spec = importlib.util.spec_from_file_location("cuda_facts", ROOT / ".ci" / "cuda_facts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_float_atomics_are_found_and_integer_ones_are_not(facts):
    text = (ROOT / "tests" / "data" / "sm90_atomics.sass").read_text()
    found = {name: facts.float_atomics(ins) for name, ins in facts.parse_sass(text).items()}
    assert found == {
        "_Z6int_okPjj": [],
        "_Z3s64Pyy": [],
        "_Z13double_unusedPdd": ["REDG.E.ADD.F64.RN.STRONG.GPU"],
        "_Z13global_unusedPff": ["REDG.E.ADD.F32.FTZ.RN.STRONG.GPU"],
        "_Z11global_usedPffS_": ["ATOMG.E.ADD.F32.FTZ.RN.STRONG.GPU"],
        "_Z10shared_addPff": ["ATOMS.CAST.SPIN loop"],
    }
