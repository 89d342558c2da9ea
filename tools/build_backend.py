"""setuptools' build backend, with the build requirements the extension needs.

An isolated build (``pip install .`` or ``pip wheel .`` without
``--no-build-isolation``) installs only what the backend asks for. The
compiled extension needs torch and ninja; a TORCHCAST_NO_EXTENSION=1 build
needs neither, so they are asked for only when the extension is built."""
import os

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (the PEP 517 hooks)

_EXTENSION_REQUIRES = ["torch>=2.13", "ninja"]


def _extension_requires():
    return [] if os.environ.get("TORCHCAST_NO_EXTENSION") == "1" else list(_EXTENSION_REQUIRES)


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + _extension_requires()


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + _extension_requires()
