"""`import Merak` for scripts written against the original Merak: the same API as `merak`."""

import sys

import merak
from merak import *  # noqa: F401,F403

sys.modules[__name__] = merak
