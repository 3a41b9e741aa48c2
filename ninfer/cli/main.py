"""The `ninfer` command: one Typer app, one module per command."""
from __future__ import annotations

import os
import signal
import sys
from typing import Optional

try:  # a Ctrl+C while the command's first modules import ends it like any other interrupt
    import typer

    from ninfer.errors import ExitCode
    from ninfer.version import version_string
except KeyboardInterrupt:
    print("ninfer: interrupted", file=sys.stderr)
    sys.exit(130)

app = typer.Typer(
    name="ninfer",
    help="Local LLM inference: serve, run, tokenize, convert, benchmark and calibrate.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_state = {"debug": False}


def _version(value: bool) -> None:
    if value:
        print(version_string())
        raise typer.Exit()


@app.callback()
def _root(
    version: Optional[bool] = typer.Option(None, "--version", callback=_version, is_eager=True,
                                           help="Print <VERSION>+<build id> and exit."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors."),
) -> None:
    _state["debug"] = debug


def _register() -> None:
    from ninfer.cli.convert import convert
    from ninfer.cli.run import run
    from ninfer.cli.tokenize import tokenize

    app.command("run", help="Generate from a prompt (chat template applied unless --raw).")(run)
    app.command("tokenize", help="Print the token ids of a text.")(tokenize)
    app.command("convert", help="Convert a GGUF file or Hugging Face folder into a .ninfer artifact.")(convert)
    from ninfer.cli.slots import app as slots_app
    app.add_typer(slots_app, name="slots")
    try:
        from ninfer.cli.serve import serve
    except ImportError:
        pass
    else:
        app.command("serve", help="Serve a model over OpenAI-, Anthropic- and llama.cpp-compatible HTTP APIs.")(serve)
    try:
        from ninfer.cli.bench import bench
    except ImportError:
        pass
    else:
        app.command("bench", help="Benchmark prompt processing and generation (llama-bench style).")(bench)
    from ninfer.cli.calibrate import calibrate

    app.command("calibrate", help="Time the cuda routes on this GPU for a model's shapes and write its device "
                                  "profile.")(calibrate)


def _exit_now(signum: int, frame: object) -> None:
    """SIGINT and SIGTERM until a command installs its own handling: end the process at once
    with 130. Raising KeyboardInterrupt is not safe while native code imports or loads: torch's
    pybind11 turns it into "terminate called", and C code can swallow it, leaving a server that
    ignored the signal. Nothing a command writes needs more (files are written to a temporary
    name and renamed)."""
    os.write(2, b"ninfer: interrupted\n")
    os._exit(ExitCode.INTERRUPTED)


def main(argv: list[str] | None = None) -> None:
    """Entry point and the one place that turns outcomes into exit statuses (ExitCode): errors
    print one line (a traceback only with --debug). SIGINT and SIGTERM end a command at once
    until it installs its own handling (serve does once its event loop runs)."""
    from ninfer.errors import NInferError

    signal.signal(signal.SIGINT, _exit_now)
    signal.signal(signal.SIGTERM, _exit_now)

    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    try:
        _register()
        # without standalone mode click returns a command's exit status (a typer.Exit's, and 130
        # for an interrupt inside the command) instead of exiting with it
        code = app(args=args, standalone_mode=False, prog_name="ninfer")
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        print("ninfer: interrupted", file=sys.stderr)
        sys.exit(ExitCode.INTERRUPTED)
    except Exception as e:  # noqa: BLE001 - the one place that turns errors into exit codes
        if hasattr(e, "show") and hasattr(e, "exit_code"):  # click's (or typer's vendored click's) usage errors
            e.show()  # a bad flag value or usage: exit 1 like every other start-up error
            sys.exit(ExitCode.FAILED)
        if debug:
            raise
        if isinstance(e, NInferError):
            print(f"error: {e}", file=sys.stderr)
        else:
            print(f"error: {type(e).__name__}: {e} (run with --debug for the traceback)", file=sys.stderr)
        sys.exit(ExitCode.FAILED)
    if code == ExitCode.INTERRUPTED:
        print("ninfer: interrupted", file=sys.stderr)
    sys.exit(code if isinstance(code, int) else ExitCode.OK)


if __name__ == "__main__":
    main()
