"""``python -m hp_cp_torch.bench``: the same as ``hp-cp bench``."""

import sys

from hp_cp_torch.bench.suite import main

sys.exit(main())
