"""MindSpore's CPU kernels default to 25 threads per process: msrun ranks sharing a few cores
then spend their time switching threads. ``limit_cpu_threads()`` gives each rank cores / ranks
threads (at least one); the msrun workers call it right after ``set_device("CPU")`` (a second
call, from another module of the same worker, changes nothing)."""

from __future__ import annotations

import os


def limit_cpu_threads() -> int:
    """Set this process's CPU kernel threads to cores / msrun ranks; returns the count."""
    import mindspore as ms

    ranks = int(os.environ.get("MS_WORKER_NUM", "1"))
    threads = max(1, (os.cpu_count() or 1) // max(ranks, 1))
    try:
        ms.device_context.cpu.op_tuning.threads_num(threads)
    except RuntimeError:  # "can not be set repeatedly": another module of the worker did
        pass
    return threads
