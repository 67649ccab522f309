"""``python -m hp_cp_torch.cli``: the ``hp-cp`` command (also under ``torchrun``)."""

import sys

from hp_cp_torch.cli.commands import main

sys.exit(main())
