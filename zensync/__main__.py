"""``python -m zensync``: the ``zensync`` command line (needed where the console script is not,
e.g. ``mpiexec -n 2 python -m mpi4py -m zensync tune``)."""

import sys

from zensync.cli import main

sys.exit(main())
