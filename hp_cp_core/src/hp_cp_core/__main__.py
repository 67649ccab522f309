"""``python -m hp_cp_core``: the core version, the active discovery switches and the
backends discovery loaded, as a table (``--json`` for JSON).

The ``api`` column is the backend API each plugin declares (``hp_cp_backend_api``) and what
this core makes of it: ``current``, ``adapted`` (0.1, run with placeholder order tokens and a
``DeprecationWarning`` where that is correct) or ``unusable`` (:mod:`hp_cp_core.versions`)."""

from __future__ import annotations

import argparse
import json
import sys

from hp_cp_core import __version__
from hp_cp_core.plugins import GUIDE, PluginHost, active_switches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hp_cp_core", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    switches = active_switches()
    rows = PluginHost().report()  # honours HP_CP_PLUGINS / HP_CP_DISABLE_PLUGIN_AUTOLOAD
    if args.json:
        print(json.dumps({"core": __version__, "switches": switches, "backends": rows}, indent=2))
        return 0
    shown = ", ".join(f"{k}={v}" for k, v in switches.items()) or "none"
    print(f"hp-cp-core {__version__}; discovery switches: {shown}")
    if not rows:
        if "HP_CP_DISABLE_PLUGIN_AUTOLOAD" in switches or "HP_CP_PLUGINS" in switches:
            print("no hp_cp backends loaded: the switches above turned discovery off")
        else:
            print(
                "no hp_cp backends installed; try `pip install hp-cp-torch` or "
                f"`pip install hp-cp-mindformers`, or write one ({GUIDE})"
            )
        return 0
    print(f"{'backend':<14}{'distribution':<22}{'version':<10}{'api':<18}status")
    for r in rows:
        status = "ok" if r["status"] == "ok" else f"error: {r['error']}"
        api = f"{r['backend_api'] or '?'} {r['api_status']}" if r["api_status"] else "-"
        print(f"{r['name']:<14}{r['dist'] or '-':<22}{r['version'] or '-':<10}{api:<18}{status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
