"""The ``gemm-patch`` command (also ``python -m gemm_patch``)."""

from __future__ import annotations

import argparse
import json
import sys


def _apply_as_on_import() -> str | None:
    """What ``import gemm_patch`` does in any other process (the package skips it for its own
    command); returns the error that strict mode raised, if any."""
    import gemm_patch

    try:
        gemm_patch._auto_apply()
    except gemm_patch.GemmPatchError as exc:
        return str(exc)
    return None


def _status(args: argparse.Namespace) -> int:
    import gemm_patch

    if not args.no_import:
        from .patcher import import_target_modules

        import_target_modules()
    st = gemm_patch.status()
    print(json.dumps(st.as_dict(), indent=2, sort_keys=True) if args.json else st)
    return 1 if st.config_error else 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import main as demo_main

    return demo_main()


def _doctor(args: argparse.Namespace) -> int:
    from .doctor import main as doctor_main

    return doctor_main(args.device, as_json=args.json, import_targets=not args.no_import)


def _run(args: argparse.Namespace) -> int:
    from .launcher import run

    return run(args.cmd)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gemm-patch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("status", help="what is installed, what is patched, which backends run")
    p.add_argument("--json", action="store_true", help="machine-readable (schema 1)")
    p.add_argument("--no-import", action="store_true", help="don't import the target modules first")
    p.set_defaults(func=_status)
    p = sub.add_parser("demo", help="the crash, then the fix, on megatron-core's FSDP wgrad path")
    p.set_defaults(func=_demo)
    p = sub.add_parser("doctor", help="check every backend against fp64 on this device; "
                       "non-zero exit if the one in use is wrong or missing")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available, else cpu")
    p.add_argument("--json", action="store_true", help="machine-readable report (schema 1)")
    p.add_argument("--no-import", action="store_true", help="don't import the target modules first")
    p.set_defaults(func=_doctor)
    p = sub.add_parser("run", help="run a command with gemm_patch applied in every Python process "
                       "it starts", usage="gemm-patch run -- COMMAND [ARGS ...]")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="the command and its arguments")
    p.set_defaults(func=_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.func is not _run:  # the launcher itself stays unpatched: only its command matters
        error = _apply_as_on_import()
        if error:
            print(error, file=sys.stderr)
            return 1
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
