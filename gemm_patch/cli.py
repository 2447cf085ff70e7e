"""The ``gemm-patch`` command (also ``python -m gemm_patch``)."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from .targets import TARGETS


def _status(args: argparse.Namespace) -> int:
    import gemm_patch

    if not args.no_import:
        # Import the target modules so the report says what the patch does to them, not
        # merely that it is waiting for them.
        for module in sorted({t.module for t in TARGETS}):
            try:
                importlib.import_module(module)
            except ImportError:
                pass
    st = gemm_patch.status()
    print(json.dumps(st.as_dict(), indent=2, sort_keys=True) if args.json else st)
    return 1 if st.config_error else 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import main as demo_main

    return demo_main()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gemm-patch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("status", help="what is installed, what is patched, which backends run")
    p.add_argument("--json", action="store_true", help="machine-readable (schema 1)")
    p.add_argument("--no-import", action="store_true", help="don't import the target modules first")
    p.set_defaults(func=_status)
    p = sub.add_parser("demo", help="the crash, then the fix, on megatron-core's FSDP wgrad path")
    p.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
