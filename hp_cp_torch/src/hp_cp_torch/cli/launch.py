"""Run a function on N local gloo ranks (spawned processes) and collect what each returns.

Used by ``hp-cp demo``, the benchmark and the tests: one job runs many cases, since starting
a process group costs seconds. A rank that hangs is killed after ``timeout`` and reported.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import signal
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PR_SET_PDEATHSIG = 1
"""Linux ``prctl`` option: the signal a process gets when its parent dies."""


def _die_with_parent(parent: int) -> None:
    """On Linux, have the kernel kill this rank when the process that launched it dies, and
    leave at once if it has already died (elsewhere the parent's own cleanup is all)."""
    if sys.platform.startswith("linux"):
        # no libc prctl (OSError, AttributeError): the parent's cleanup still runs
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def _worker(
    rank: int,
    world: int,
    port: int,
    fn: Callable,
    args: tuple,
    out_dir: str,
    pg_timeout: float | None = None,
    parent: int | None = None,
) -> None:
    if parent is not None:
        _die_with_parent(parent)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    timeout = dist.constants.default_pg_timeout
    if pg_timeout is not None:
        timeout = datetime.timedelta(seconds=pg_timeout)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    torch.manual_seed(0)
    try:
        result: Any = ("ok", fn(rank, world, *args))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result = ("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    _leave(store, rank, world)


FINISH_WAIT_S = 300.0
"""How long rank 0, the store's host, waits at the end for the other ranks to finish."""


def _leave(store: Any, rank: int, world: int) -> None:
    """Tear down this rank's process group, rank 0 last. Rank 0's process hosts the store, and a
    rank still making a group (a device mesh's, say) when a peer has already returned or raised
    needs it: without the wait it fails with "Broken pipe" instead of its own result."""
    with contextlib.suppress(Exception):  # a rank that died is reported by the parent
        store.set(f"hp_cp_finished_{rank}", "1")
        if rank == 0:
            keys = [f"hp_cp_finished_{k}" for k in range(world)]
            store.wait(keys, datetime.timedelta(seconds=FINISH_WAIT_S))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def run_ranks(
    world: int, fn: Callable, *args: Any, timeout: float = 600, pg_timeout: float | None = None
) -> list[Any]:
    """``fn(rank, world, *args)`` on every rank; returns the list of results or raises.

    Args:
        world: number of ranks (processes).
        fn: a picklable ``fn(rank, world, *args)``.
        args: more arguments for ``fn``.
        timeout: seconds the whole job may take before its ranks are killed as hung.
        pg_timeout: the default process group's collective timeout in seconds (torch's
            default, 30 minutes, when ``None``); a collective a peer never joins fails after
            this long.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.get_context("spawn")
        job = (world, _free_port(), fn, args, out_dir, pg_timeout, os.getpid())
        procs = [ctx.Process(target=_worker, args=(k, *job)) for k in range(world)]
        try:
            for p in procs:
                p.start()
            for p in procs:
                p.join(timeout)
            hung = [k for k, p in enumerate(procs) if p.is_alive()]
        finally:  # also on Ctrl-C or an error here: no rank outlives its job
            for p in procs:
                if p.is_alive():
                    p.kill()
        if hung:
            raise TimeoutError(f"ranks {hung} did not finish within {timeout}s (hang)")
        results = []
        for k in range(world):
            path = os.path.join(out_dir, f"rank{k}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {k} died without a result (exit {procs[k].exitcode})")
            status, value = torch.load(path, weights_only=False)
            if status == "error":
                raise AssertionError(value)
            results.append(value)
        return results
