import os
import sys

from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))  # numpy_ref and other test helpers

settings.register_profile("torchcast", deadline=None, print_blob=True)
settings.load_profile("torchcast")
