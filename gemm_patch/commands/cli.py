"""The gemm-patch command (also python -m gemm_patch).

Every command ends in a documented exit status (EPILOG, the one table, in `gemm-patch --help`). A refusal of strict mode
(GemmPatchError, raised while the patch is applied or while a target module is imported) and a
missing device or call site end in one line on stderr, never in a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

# Exit statuses (``gemm-patch run`` exits with its command's own instead).
EXIT_OK = 0
EXIT_FAILED = 1  # strict-mode refusal, bad GEMM_PATCH_* value, doctor found a wrong backend, demo failed
EXIT_NOT_APPLICABLE = 2  # usage error (argparse's own 2), or nothing to check or show here

DESCRIPTION = """\
gemm-patch: what gemm_patch does to megatron-core in this environment.

gemm_patch lets megatron-core's fused weight-gradient path write fp32 main grads from
bf16/fp16 activations (Megatron-FSDP with gradient-accumulation fusion). `import gemm_patch`
applies the patch; this command reports on it, checks it, and shows it."""

SEE_EXIT_STATUS = "exit status: see `gemm-patch --help`"

EPILOG = """\
exit status:
  0  success: status printed; doctor: the backend in use is right; demo: the fix shown
  1  refused or failed: GEMM_PATCH_STRICT=1 refused to leave a target unpatched, a
     GEMM_PATCH_* variable holds a bad value, doctor found the backend in use wrong or
     missing, or the demo found the call left unpatched (unknown code) or its patched
     run wrong
  2  usage error, or nothing to do here: demo on a megatron-core release without the
     Megatron-FSDP fused wgrad call (0.13.x and older), without torch and megatron-core, or
     with the patch turned off (GEMM_PATCH=0); doctor --device cuda where torch has no CUDA
     device
  run: the exit status of COMMAND (127: not found, 126: cannot be started)
  compare: 0 same: the runs agree (per parameter at iterations 1 and 2, then within the
     drift of a perturbed fusion-off run); 1 they differ, or exactly one run failed; 2 usage
     error, a log without megatron's iteration lines, both runs failed, or not proven
     (nothing shows fusion on in one run and off in the other, or the fusion-on run shows no
     sign of gemm-patch applied); 3 not compared (NaN or inf, a step skipped by the fp16
     loss scaler, an iteration one run logged and the other did not, a later iteration past
     the strict bound with the drift not measured, a cut run that logged nothing after its
     first step); 4 drifts: an iteration after the second past the drift while iterations
     1 and 2 agreed, per parameter or by megatron's values alone (weak evidence); 130/143
     interrupted by SIGINT/SIGTERM (both runs' processes ended)

Each error ends in one line on stderr, starting with "gemm-patch COMMAND:".
GEMM_PATCH_LOG_LEVEL=DEBUG also logs the warnings that importing megatron raises
(status, doctor and demo count them instead of showing them)."""


def _apply_as_on_import() -> None:
    """What ``import gemm_patch`` does in any other process (the package skips it for its own
    command); raises GemmPatchError in strict mode. A bad variable is said once, in the command's
    own words (``gemm-patch status: ...``), not also as a log line."""
    import gemm_patch

    from ..engine import config

    if _config_error() is None or config.strict_requested():  # strict mode refuses it, in one line
        gemm_patch._auto_apply()


def _config_error() -> str | None:
    from ..engine import config, patcher

    if not config.enabled():
        return None
    try:
        patcher.load_config()
    except config.ConfigError as exc:
        return str(exc)
    return None


def import_targets_quietly() -> int:
    """Import every installed target module (so that status describes what the patch did to
    them) with the warnings raised meanwhile held back: megatron warns on import about a
    missing Transformer Engine or apex, which says nothing about gemm_patch. Returns how many
    were held back; each is logged at DEBUG. The warning filters in force (-W,
    PYTHONWARNINGS) still decide which warnings exist; a GemmPatchError propagates."""
    import logging
    import warnings

    from ..engine.patcher import import_target_modules

    with warnings.catch_warnings(record=True) as caught:
        import_target_modules()
    log = logging.getLogger("gemm_patch")
    for w in caught:
        log.debug("warning while importing the target modules: %s:%s: %s: %s",
                  w.filename, w.lineno, w.category.__name__, w.message)
    return len(caught)


def warnings_note(count: int | None) -> str | None:
    """The one line that says how many import warnings were not shown (None: nothing to say,
    or they were shown: logged at DEBUG, the level in force)."""
    import logging

    if not count or logging.getLogger("gemm_patch").isEnabledFor(logging.DEBUG):
        return None
    return (f"  ({count} warning{'s' if count != 1 else ''} from importing megatron suppressed; "
            f"GEMM_PATCH_LOG_LEVEL=DEBUG shows them)")


def _status(args: argparse.Namespace) -> int:
    import gemm_patch

    suppressed = None if args.no_import else import_targets_quietly()
    _start_cuda_if_present()
    st = gemm_patch.status()
    note = warnings_note(suppressed)
    if args.json:
        print(json.dumps(st.as_dict(), indent=2, sort_keys=True))
        if note:  # stdout stays pure JSON
            print(note.strip(), file=sys.stderr)
    else:
        print(st.render(all_targets=args.all, error_below=True))
        if note:
            print(note)
        if not _installed_as_package():
            print("  note: gemm_patch is imported from a source tree, not installed: GEMM_PATCH_AUTO=1 needs "
                  "the package installed (pip install PATH, or a wheel) and does nothing without it; "
                  "`import gemm_patch` and `gemm-patch run` work either way")
    if st.config_error or st.data_error:
        sys.stdout.flush()
        print(f"gemm-patch {args.command}: {st.config_error or st.data_error}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _start_cuda_if_present() -> None:
    """Let the status name the backend in use on the GPU: status() itself never creates a CUDA
    context (in a training process that would land on device 0 before the job picks its own)."""
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        try:
            if torch.cuda.is_available():
                torch.cuda.init()
        except Exception:
            pass


def _installed_as_package() -> bool:
    """Whether the gemm_patch that runs is an installed distribution (wheel or editable), which
    the ``.pth`` start-up hook of GEMM_PATCH_AUTO=1 needs."""
    from importlib import metadata

    try:
        metadata.version("gemm-patch")
    except metadata.PackageNotFoundError:
        return False
    return True


def _demo(args: argparse.Namespace) -> int:
    from .demo import main as demo_main

    return demo_main(note=warnings_note(import_targets_quietly()))


def _doctor(args: argparse.Namespace) -> int:
    from . import doctor

    problem = doctor.device_problem(args.device)
    if problem:
        print(f"gemm-patch doctor: {problem}", file=sys.stderr)
        return EXIT_NOT_APPLICABLE
    suppressed = None if args.no_import else import_targets_quietly()
    return doctor.main(args.device, as_json=args.json, import_targets=False,
                       note=warnings_note(suppressed))


def _run(args: argparse.Namespace) -> int:
    from .launcher import run

    return run(args.cmd)


def _compare(args: argparse.Namespace) -> int:
    from .compare import main as compare_main

    return compare_main(args)


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(prog="gemm-patch", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"gemm-patch {__version__}",
                        help="print gemm-patch's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("status", help="what is installed, what is patched, which backends run",
                       description="Import the target modules, then say what the patch did to each\n"
                       "and which GEMM backends would run.", epilog=SEE_EXIT_STATUS,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="machine-readable (schema 1)")
    p.add_argument("--all", action="store_true", help="every target, also those for code not installed here")
    p.add_argument("--no-import", action="store_true", help="don't import the target modules first")
    p.set_defaults(func=_status)
    p = sub.add_parser("demo", help="the crash, then the fix, on megatron-core's FSDP wgrad path",
                       description="Run megatron-core's Megatron-FSDP fused wgrad call unpatched (the\n"
                       "crash), then patched (fp32 main grads, compared with fp64).", epilog=SEE_EXIT_STATUS,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(func=_demo)
    p = sub.add_parser("doctor", help="check every backend against fp64 on this device; "
                       "non-zero exit if the one in use is wrong or missing",
                       description="Check every GEMM backend against fp64 on this device; exit 1\n"
                       "if the one in use is wrong or missing.", epilog=SEE_EXIT_STATUS,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available, else cpu")
    p.add_argument("--json", action="store_true", help="machine-readable report (schema 1)")
    p.add_argument("--no-import", action="store_true", help="don't import the target modules first")
    p.set_defaults(func=_doctor)
    p = sub.add_parser("run", help="run a command with gemm_patch applied in every Python process "
                       "it starts", usage="gemm-patch run -- COMMAND [ARGS ...]",
                       description="Run COMMAND with gemm_patch applied in every Python process it "
                       "starts; exits with COMMAND's own status.", epilog=SEE_EXIT_STATUS)
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="the command and its arguments")
    p.set_defaults(func=_run)
    from . import compare

    p = sub.add_parser("compare", help="run a training command twice, fusion on under gemm-patch and fusion "
                       "off, and judge each parameter's gradient, megatron's loss and grad norm; step time and memory",
                       usage="gemm-patch compare [OPTIONS] -- COMMAND [ARGS ...]",
                       description="Run COMMAND twice, one after the other: fusion on under gemm-patch (as\n"
                       "`gemm-patch run`) and fusion off (megatron as shipped, GEMM_PATCH=0). Check in\n"
                       "megatron's argument dump that fusion was on in one and off in the other, and in\n"
                       "the log that gemm-patch was applied; judge each parameter's gradient after the\n"
                       "first step (a read-only probe in both runs), then megatron's logged loss and grad\n"
                       "norm per iteration (later ones against the drift of a fusion-off run whose\n"
                       "first-step gradients are perturbed by a rounding); print step time and memory.\n"
                       "Options go before `--`; an option's value that starts with '-' is written\n"
                       "--off-arg=--flag.", epilog=SEE_EXIT_STATUS,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    compare.build_parser(p)
    p.set_defaults(func=_compare)
    return parser


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text.removeprefix("gemm_patch: ")


def main(argv: list[str] | None = None) -> int:
    from .. import GemmPatchError

    args = build_parser().parse_args(argv)
    try:
        if args.func not in (_run, _compare):  # launchers stay unpatched: only their commands matter
            _apply_as_on_import()
        return args.func(args)
    except GemmPatchError as exc:  # strict mode: from apply(), or from a target module's import
        sys.stdout.flush()
        line = _one_line(exc)
        if "GEMM_PATCH_STRICT" not in line:
            line += "; refused because GEMM_PATCH_STRICT=1"
        print(f"gemm-patch {args.command}: {line}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
