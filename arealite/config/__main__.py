"""Inspect arealite configs from a shell.

    python -m arealite.config show   [CFG] [key=value ...]   effective config as YAML (api_key masked)
    python -m arealite.config schema                         JSON schema of the config
    python -m arealite.config docs                           Markdown reference (docs/config_reference.md)

Exit status: 0 when the config is valid, 1 when it is not (problems on stderr),
2 on a usage error. To validate a run's config in full, the names of its algorithm
pieces, reward function and workflow included, use `python -m arealite.check`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from arealite.config.loader import ConfigError, dump_config, load_config, split_config_args
from arealite.config.schema import ArealiteConfig


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
    sub.add_parser("schema", help="print the JSON schema")
    sub.add_parser("docs", help="print the Markdown config reference")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["check"]:  # the full check needs the registries above config/
        print("python -m arealite.config check moved: run `python -m arealite.check "
              + " ".join(argv[1:]) + "` (it also checks the algorithm, reward and workflow names)",
              file=sys.stderr)
        return 2
    args = parser.parse_args(argv)

    if args.command == "schema":
        print(json.dumps(ArealiteConfig.model_json_schema(), indent=2))
        return 0
    if args.command == "docs":
        from arealite.config.docs import render_reference

        sys.stdout.write(render_reference())
        return 0

    path, overrides = split_config_args(args.args)
    try:
        cfg = load_config(path, overrides, check_paths=args.check_paths)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 1
    sys.stdout.write(dump_config(cfg, mask_secrets=not args.show_secrets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
