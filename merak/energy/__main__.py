"""``python -m merak.energy plan|serve|report ...``: the ``merak energy`` commands in a process
that imports only `merak.energy` (and what the command needs), as the background planner of
``energy_mode="auto"`` runs."""

import sys

from merak.energy.cli import main

sys.exit(main(sys.argv[1:]))
