"""`import Merak` for scripts written against the original Merak: the same API as `merak`."""

import sys

import merak

sys.modules[__name__] = merak
