"""Process groups let go at interpreter exit, so that gloo's threads stop before Python does.

Note [Clean exit]
~~~~~~~~~~~~~~~~~
A gloo ``ProcessGroup`` runs worker threads. A worker that finishes a collective drops its
reference to the collective's tensors; a tensor that Python also sees is released under the
GIL (``TensorImpl::decref_pyobject``). If that happens while the interpreter is finalising,
CPython ends the thread with ``pthread_exit``, whose unwinding meets a ``noexcept``
destructor, and the process aborts: "terminate called without an active exception", after
the script's work is done. ``dist.destroy_process_group()`` avoids it when it drops the last
reference to a group: the group's destructor joins its workers with the GIL released, before
the interpreter finalises. A group still referenced outlives ``destroy_process_group``, and
its workers race the interpreter's teardown.

hp_cp kept groups referenced after ``destroy_process_group``:

* the :class:`~hp_cp_torch.backend.TorchGroup` (``.pg``, and the desync log's store), held by
  the handle and by every installed layer;
* the handle's ``mesh``, the group the user passed (``enable_cp(model, dist.group.WORLD)``);
* ``torch.distributed.nn.functional``: ten functions whose default argument is
  ``group.WORLD``, evaluated when the module is imported. ``enable_cp`` imports the backend,
  and with it ``torch._dynamo``, which imports that module: after ``init_process_group``,
  the defaults are the world group itself, for as long as the process lives.

A script that ended without ``dist.barrier()`` had a rank abort this way about once in five
runs (issue 49). The barrier hid it: a rank waiting in it releases the GIL, so the workers
finish, and a barrier's work holds no tensor that Python sees.

:func:`release_at_exit` records, by weak reference, the attributes that hold a group; the
first call registers :func:`release`, which ``atexit`` runs while the interpreter is still
whole. It sets those attributes to ``None`` and, once the process group is destroyed, the
defaults above that are process groups too (what they are when the module is imported before
``init_process_group``: the default group). The last reference to each of those groups goes
there, and its destructor joins the workers. A group that the program itself still holds at
exit (an FSDP module at module level, say) is its own to drop. hp_cp leaves no isend / irecv
or collective unfinished and starts no thread: each exchange waits for its requests in the
forward or backward that issued them.
"""

from __future__ import annotations

import atexit
import sys
import weakref
from typing import Any

import torch.distributed as dist

__all__ = ["release", "release_at_exit"]

_HOLDERS: list[tuple[weakref.ref, str]] = []
"""(holder, attribute) pairs that :func:`release` sets to ``None``: the hook's own state."""


def release_at_exit(holder: Any, *attributes: str) -> None:
    """At interpreter exit, set ``holder.<attribute>`` to ``None`` (if ``holder`` is alive)."""
    if not _HOLDERS:
        atexit.unregister(release)  # registered once, however often the list empties
        atexit.register(release)
    _HOLDERS[:] = [(ref, name) for ref, name in _HOLDERS if ref() is not None]
    _HOLDERS.extend((weakref.ref(holder), name) for name in attributes)


def release() -> None:
    """Drop what hp_cp holds of the process groups (Note [Clean exit]); run by ``atexit``."""
    for ref, name in _HOLDERS:
        holder = ref()
        if holder is not None:
            setattr(holder, name, None)
    _HOLDERS.clear()
    functional = sys.modules.get("torch.distributed.nn.functional")
    if functional is not None and not dist.is_initialized():
        for fn in vars(functional).values():
            defaults = getattr(fn, "__defaults__", None)
            if defaults and any(isinstance(d, dist.ProcessGroup) for d in defaults):
                fn.__defaults__ = tuple(
                    None if isinstance(d, dist.ProcessGroup) else d for d in defaults
                )
