"""A second distribution that registers the backend name ``torch``."""

from hp_cp_core import hookimpl


@hookimpl
def hp_cp_backend(module):  # noqa: ANN001, ANN201
    return None
