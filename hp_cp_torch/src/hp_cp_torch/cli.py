"""The ``hp-cp`` command: ``demo`` (parity report), ``bench`` (measures), ``backends``."""

from __future__ import annotations

import argparse
import sys


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
    bench = sub.add_parser("bench", help="traffic, balance, memory and time measures")
    bench.add_argument("args", nargs=argparse.REMAINDER)
    sub.add_parser("backends", help="list installed hp_cp backends")
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.cp < 1:
            parser.error("--cp must be >= 1")
        from hp_cp_torch.demo import main as demo_main

        return demo_main(args.cp, args.model, args.layout, args.seq_len, args.launcher)
    if args.command == "bench":
        from hp_cp_torch.bench import main as bench_main

        return bench_main(args.args)
    from hp_cp_core.__main__ import main as backends_main

    return backends_main([])


if __name__ == "__main__":
    sys.exit(main())
