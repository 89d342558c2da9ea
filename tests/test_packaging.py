"""How torchcast is installed: the torch-version check at import, the build
without the compiled extension, and the schemas both builds define."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import torchcast
from torchcast import _loader, _ops
from torchcast._schemas import SCHEMAS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(torchcast.__file__)))


def run_python(code):
    """Runs code in a fresh interpreter that imports this torchcast."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=300)


def fake_build_info(torch_version, with_extension):
    """Code that makes the next `import torchcast` see this build record."""
    return f"""
        import sys, types
        info = types.ModuleType("torchcast._build_info")
        info.TORCH_VERSION = {torch_version!r}
        info.WITH_EXTENSION = {with_extension!r}
        info.WITH_CUDA = False
        sys.modules["torchcast._build_info"] = info
    """


def test_same_minor_version_loads():
    _loader.check_torch_version("2.13.0+cpu", "2.13.1+cu130")
    _loader.check_torch_version("2.14.1", "2.14.0a0+git1234")


MAJOR, MINOR = (int(v) for v in torch.__version__.split(".")[:2])


@pytest.mark.parametrize("built", [f"{MAJOR}.{MINOR - 1}.0+cpu", f"{MAJOR}.{MINOR + 1}.1+cu130",
                                   f"{MAJOR + 1}.{MINOR}.0"])
def test_other_minor_version_is_a_clear_import_error(built):
    with pytest.raises(ImportError) as e:
        _loader.check_torch_version(built, torch.__version__)
    message = str(e.value)
    assert built in message and torch.__version__ in message
    assert "pip install --no-build-isolation -e ." in message


@pytest.mark.skipif(not _ops.WITH_EXTENSION, reason="this install has no compiled extension")
def test_import_under_another_torch_fails_before_loading_the_extension():
    run = run_python(fake_build_info(f"{MAJOR}.{MINOR - 1}.0", True) + """
        try:
            import torchcast
        except ImportError as e:
            print("ImportError:", e)
        print("loaded:", "torchcast._C" in sys.modules)
    """)
    assert run.returncode == 0, run.stderr
    assert ("ImportError: torchcast's compiled extension was built against torch "
            f"{MAJOR}.{MINOR - 1}.0") in run.stdout
    assert torch.__version__ in run.stdout
    assert "loaded: False" in run.stdout  # refused before the library was loaded


@pytest.mark.skipif(not _ops.WITH_EXTENSION, reason="this install has no compiled extension")
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_python_schemas_match_the_compiled_ones(name):
    op, _, overload = name.partition(".")
    compiled = getattr(getattr(torch.ops.torchcast, op), overload or "default")._schema
    assert str(torch._C.parse_schema("torchcast::" + SCHEMAS[name])) == str(compiled)


def same_bits(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_build_without_extension_gives_the_same_results(tmp_path):
    """The pure-PyTorch build, in a fresh interpreter, against this one: the
    same bits for a cast, a reduction and an Adam step, and one warning that
    points at the caller's line."""
    code = """
        import warnings
        import torch

        def work():
            torch.manual_seed(0)
            x = torch.randn(5000, dtype=torch.float64) * 1e4
            y, stats = torch.ops.torchcast.cast_with_stats(x, torch.float16)
            total = torchcast.kahan_sum(x.float().view(50, 100), 1)
            p = torch.nn.Parameter(x[:64].bfloat16())
            p.grad = x[64:128].bfloat16()
            torchcast.optim.AdamW([p]).step()
            return y, stats, total, p.detach()
    """
    run = run_python(fake_build_info(None, False) + code + f"""
        import torchcast
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = work()
        slow = [w for w in caught if "without its compiled extension" in str(w.message)]
        print("warnings:", len(slow), slow[0].filename)
        assert "torchcast._C" not in sys.modules
        torch.save(result, {str(tmp_path / "noext.pt")!r})
    """)
    assert run.returncode == 0, run.stderr
    assert "warnings: 1 <string>" in run.stdout  # once, at the caller, not in the dispatcher
    namespace = {"torchcast": torchcast}
    exec(textwrap.dedent(code), namespace)
    for ours, theirs in zip(namespace["work"](), torch.load(tmp_path / "noext.pt")):
        assert same_bits(ours, theirs)
