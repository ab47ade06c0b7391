"""Inspect arealite configs from a shell.

    python -m arealite.config show   [CFG] [key=value ...]   effective config as YAML (api_key masked)
    python -m arealite.config check  [CFG] [key=value ...]   validate, model/data paths included
    python -m arealite.config schema                         JSON schema of the config
    python -m arealite.config docs                           Markdown reference (docs/config_reference.md)

Exit status: 0 when the config is valid, 1 when it is not (problems on stderr),
2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from arealite.config.loader import ConfigError, check_launch, dump_config, load_config
from arealite.config.schema import ArealiteConfig


def _split_config(items: Sequence[str]) -> tuple[str | None, list[str]]:
    """`[CFG] key=value ...`: the first item is the file unless it is an override."""
    items = list(items)
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m arealite.config",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="print the effective config as YAML")
    show.add_argument("args", nargs="*", metavar="CFG | key=value")
    show.add_argument("--check-paths", action="store_true", help="also require model/data paths to exist")
    show.add_argument("--show-secrets", action="store_true", help="print server.api_key instead of ***")
    check = sub.add_parser("check", help="validate a config, paths included")
    check.add_argument("args", nargs="*", metavar="CFG | key=value")
    check.add_argument("--no-paths", action="store_true", help="do not check model/data paths")
    check.add_argument("--launch", action="store_true", help="also run the local launcher's checks")
    sub.add_parser("schema", help="print the JSON schema")
    sub.add_parser("docs", help="print the Markdown config reference")
    args = parser.parse_args(argv)

    if args.command == "schema":
        print(json.dumps(ArealiteConfig.model_json_schema(), indent=2))
        return 0
    if args.command == "docs":
        from arealite.config.docs import render_reference

        sys.stdout.write(render_reference())
        return 0

    path, overrides = _split_config(args.args)
    try:
        if args.command == "show":
            cfg = load_config(path, overrides, check_paths=args.check_paths)
            sys.stdout.write(dump_config(cfg, mask_secrets=not args.show_secrets))
            return 0
        cfg = load_config(path, overrides, check_paths=not args.no_paths)
        if args.launch:
            check_launch(cfg)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 1
    print(f"OK: {path or 'defaults'}" + (f" with {len(overrides)} override(s)" if overrides else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
