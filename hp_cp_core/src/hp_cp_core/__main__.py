"""``python -m hp_cp_core``: the installed backends as a table (``--json`` for JSON)."""

from __future__ import annotations

import argparse
import json
import sys

from hp_cp_core.plugins import PluginHost


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hp_cp_core", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    rows = PluginHost(autoload=True).report()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no hp_cp backends installed; try `pip install hp-cp-torch`")
        return 0
    print(f"{'backend':<14}{'distribution':<22}{'version':<10}status")
    for r in rows:
        status = "ok" if r["status"] == "ok" else f"error: {r['error']}"
        print(f"{r['name']:<14}{r['dist'] or '-':<22}{r['version'] or '-':<10}{status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
