"""Models nobody here wrote, for the tracker benchmark: torchvision's
resnet18 and a 2-layer GPT-2 from transformers (random init).

Installed without dependencies, so that torch stays the pinned one
(torchvision's wheel needs its own torch build for its compiled ops, so
only its pure-Python model code is loaded), into the folder named by the
environment variable TORCHCAST_THIRDPARTY (default: benchmarks/.thirdparty,
beside this file; a relative path is taken from the current directory).
From the repository root:

    DIR=${TORCHCAST_THIRDPARTY:-benchmarks/.thirdparty}
    pip install --no-deps --target "$DIR/vision" torchvision==0.28.0 pillow==13.0.0
    pip install --no-deps --target "$DIR/hf" transformers==5.25.0 \\
        huggingface-hub==2.4.0 tokenizers==0.23.3 safetensors==0.8.0 pyyaml==6.0.4 \\
        regex==2026.11.19 tqdm==4.70.1 typer==0.29.2 kernels==0.19.1 httpx==0.29.0 \\
        httpx2==2.16.2 httpcore==1.0.9 httpcore2==2.16.2 anyio==4.16.0 h11==0.16.0 \\
        idna==3.20 certifi==2026.10.19.post1 sniffio==1.3.1 hf-xet==1.8.0 click==8.5.1 \\
        rich==15.0.0 shellingham==1.5.4 truststore==0.10.5

The two live in separate directories: transformers imports torchvision when
it can, which fails without torchvision's compiled ops; and transformers is
imported here, before the torchvision stand-in package below exists, since
it decides once, at import, whether torchvision is there.
"""
import importlib
import os
import sys
import types

import torch

HERE = os.path.abspath(os.environ.get("TORCHCAST_THIRDPARTY") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), ".thirdparty"))


def available() -> bool:
    """Whether both are installed as the module docstring says."""
    return (os.path.isdir(os.path.join(HERE, "vision", "torchvision"))
            and os.path.isdir(os.path.join(HERE, "hf", "transformers")))


def resnet18() -> torch.nn.Module:
    """torchvision's resnet18, from its model code alone (torchvision's
    package __init__ loads its compiled ops, built for another torch)."""
    root = os.path.join(HERE, "vision")
    if root not in sys.path:
        sys.path.append(root)
    package = os.path.join(root, "torchvision")
    for name, path in (("torchvision", package), ("torchvision.models", package + "/models"),
                       ("torchvision.transforms", package + "/transforms")):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [path]
            sys.modules[name] = module
    functional = importlib.import_module("torchvision.transforms.functional")
    sys.modules["torchvision.transforms"].InterpolationMode = functional.InterpolationMode
    return importlib.import_module("torchvision.models.resnet").resnet18()


def gpt2() -> torch.nn.Module:
    """A 2-layer GPT-2 language model (d_model 128, 4 heads, vocabulary
    1000, 128 positions), randomly initialized."""
    config = _gpt2.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000,
                              n_positions=128, bos_token_id=0, eos_token_id=0)
    return _gpt2.GPT2LMHeadModel(config)


_gpt2 = None
if available():
    sys.path.append(os.path.join(HERE, "hf"))
    _gpt2 = importlib.import_module("transformers.models.gpt2")
