"""The ``hp-cp`` command: ``demo`` (parity report), ``bench`` (measures), ``backends``.

``hp-cp demo`` refuses what cannot work before it starts a rank: more local ranks than the
machine can host, a sequence length that is not positive or that the layout cannot shard,
``--launcher torchrun`` outside torchrun. Each refusal is one line on stderr and exit
status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as md
import os
import sys
from typing import Any

RANKS_PER_CORE = 4
"""Local demo ranks allowed per CPU core (the tests run cp = 8 on two cores)."""

RANK_MEMORY_BYTES = 512 * 2**20
"""Memory budgeted per local demo rank (a process with torch and gloo: about 0.2-0.4 GiB)."""

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun sets for each process it starts."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hp-cp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="CP vs one device on N local gloo ranks (CPU)")
    demo.add_argument("--cp", type=int, default=4, help="number of ranks (default 4)")
    demo.add_argument("--model", choices=["reference", "transformers"], default="reference")
    demo.add_argument("--layout", choices=["contiguous", "load_balanced"], default="contiguous")
    demo.add_argument("--seq-len", type=int, default=None)
    demo.add_argument(
        "--launcher",
        choices=["local", "torchrun"],
        default="local",
        help="local: spawn --cp gloo ranks here; torchrun: this process is one torchrun rank",
    )
    demo.add_argument(
        "--allow-oversubscribe",
        action="store_true",
        help=f"start more local ranks than {RANKS_PER_CORE} per CPU core or than memory allows",
    )
    bench = sub.add_parser("bench", help="traffic, balance, memory and time measures")
    bench.add_argument("args", nargs=argparse.REMAINDER)
    sub.add_parser("backends", help="list installed hp_cp backends")
    # bench's own options (``hp-cp bench --out x``) are not hp-cp's: argparse leaves them over
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "demo":
        problem = demo_refusal(args)
        if problem is not None:
            print(f"hp-cp demo: error: {problem}", file=sys.stderr)
            return 2
        from hp_cp_torch.cli.demo import main as demo_main

        return demo_main(args.cp, args.model, args.layout, args.seq_len, args.launcher)
    if args.command == "bench":
        return command("bench")([*rest, *args.args])
    from hp_cp_core.__main__ import main as backends_main

    return backends_main([])


def command(name: str) -> Any:
    """The ``main(argv) -> int`` of the ``hp-cp`` subcommand ``name`` a layer above this one
    registers (entry points ``hp_cp.commands``: the command line imports no benchmark)."""
    return next(iter(md.entry_points(group="hp_cp.commands", name=name))).load()


def demo_refusal(
    args: argparse.Namespace,
    *,
    cores: int | None = None,
    memory_bytes: int | None = None,
    env: dict[str, str] | None = None,
) -> str | None:
    """Why ``hp-cp demo`` with ``args`` cannot work on this machine, in one line, or ``None``.

    ``cores``, ``memory_bytes`` (available) and ``env`` default to this machine's.
    """
    env = dict(os.environ) if env is None else env
    if args.launcher == "torchrun":
        missing = [k for k in TORCHRUN_ENV if k not in env]
        if missing:
            return (
                f"--launcher torchrun runs inside a torchrun worker, but {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set (torchrun sets RANK, "
                "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT). Start it as "
                "`torchrun --nproc-per-node N -m hp_cp_torch.cli demo --launcher torchrun`, "
                "or drop --launcher to spawn local ranks."
            )
        world = env["WORLD_SIZE"]
        cp = int(world) if world.isdigit() else 0
        if cp < 1:
            return (
                f"WORLD_SIZE={world!r} is not a positive rank count; run the demo under torchrun."
            )
    else:
        cp = args.cp
        if cp < 1:
            return f"--cp must be >= 1, got {cp}."
        problem = None if args.allow_oversubscribe else _capacity_problem(cp, cores, memory_bytes)
        if problem is not None:
            return problem
    if args.seq_len is not None:
        if args.seq_len < 1:
            return (
                f"--seq-len must be a positive number of tokens, got {args.seq_len}; leave it "
                "out for the demo's default length."
            )
        return _layout_problem(args.layout, cp, args.seq_len)
    return None


def _capacity_problem(cp: int, cores: int | None, memory_bytes: int | None) -> str | None:
    cores = cores if cores is not None else _cpu_cores()
    memory_bytes = memory_bytes if memory_bytes is not None else _available_memory()
    by_cores = RANKS_PER_CORE * cores
    by_memory = memory_bytes // RANK_MEMORY_BYTES if memory_bytes is not None else by_cores
    fit = max(1, min(by_cores, by_memory))
    if cp <= fit:
        return None
    gib = "unknown" if memory_bytes is None else f"{memory_bytes / 2**30:.1f} GiB"
    return (
        f"--cp {cp} would start {cp} local processes, but this machine has {cores} CPU "
        f"core(s) and {gib} of available memory; at {RANKS_PER_CORE} ranks per core and "
        f"{RANK_MEMORY_BYTES / 2**30:.1f} GiB per rank it hosts at most {fit}. Use --cp {fit} "
        "or less, run across machines with torchrun (--launcher torchrun), or pass "
        "--allow-oversubscribe to start them anyway."
    )


def _layout_problem(layout: str, cp: int, seq_len: int) -> str | None:
    from hp_cp_core import HpCpError
    from hp_cp_core.layout import SequenceLayout

    try:
        SequenceLayout(layout, cp, seq_len)
    except HpCpError as exc:
        parts = SequenceLayout(layout, cp, 0).n_chunks
        lower = seq_len // parts * parts
        fix = f"--seq-len {lower} or {lower + parts}" if lower else f"--seq-len {parts}"
        return f"{exc} For the demo: {fix}."
    return None


def _cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _available_memory() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` in bytes; ``None`` where there is none."""
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


if __name__ == "__main__":
    sys.exit(main())
