"""A plugin with a misspelled hook name."""

from hp_cp_core import hookimpl


@hookimpl
def hp_cp_extract_ori_kvv(module, key):  # noqa: ANN001, ANN201 - typo on purpose
    return key
