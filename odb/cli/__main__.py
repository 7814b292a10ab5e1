"""``python -m odb.cli``: the ``odb`` command (what each rank of ``odb train`` runs)."""

import sys

from odb.cli import main

sys.exit(main())
