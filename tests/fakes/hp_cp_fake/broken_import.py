"""A plugin whose import fails, as a backend with a missing framework would."""

import hp_cp_framework_that_does_not_exist  # noqa: F401
