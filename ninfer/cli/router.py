"""`ninfer serve --models-dir/--models-preset`: the router's catalog turned into one ModelSpec per
model. Each model's options (command line > its preset section > [*]) are parsed by the serve
command itself, so a preset value is checked exactly as the same flag on the command line, and a
bad one stops start-up naming the model.

Typer runs on its own vendored copy of click, so its objects are recognised by what they are (an
option's param_type_name, a parameter source's name), not by click's classes."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ninfer.errors import ConfigError
from ninfer.server.catalog import ROUTER_ONLY, build_catalog
from ninfer.server.router import ModelSpec


def _is_option(param: Any) -> bool:
    return getattr(param, "param_type_name", None) == "option"


def _options(command: Any) -> dict[str, Any]:
    """The serve command's options by name without dashes (--no-x of a paired flag included)."""
    out: dict[str, Any] = {}
    for param in command.params:
        if _is_option(param):
            for opt in (*param.opts, *param.secondary_opts):
                if opt.startswith("--"):
                    out[opt[2:]] = param
    return out


def explicit_options(ctx: Any) -> dict[str, str]:
    """The options given on the command line (or through their environment variable), as a
    preset would spell them: name without dashes -> value ("true"/"false" for a flag)."""
    out: dict[str, str] = {}
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name)
        if not _is_option(param) or getattr(source, "name", None) not in ("COMMANDLINE", "ENVIRONMENT"):
            continue
        value = ctx.params[param.name]
        name = next(o for o in param.opts if o.startswith("--"))[2:]
        out[name] = ("true" if value else "false") if param.is_flag else str(value)
    return out


def to_argv(options: dict[str, str], known: dict[str, Any]) -> list[str]:
    """Serve arguments for option values as a preset spells them."""
    argv: list[str] = []
    for name, value in options.items():
        option = known[name]
        if option.is_flag:
            on = value.strip().lower() in ("true", "1", "yes", "on")
            if not on and value.strip().lower() not in ("false", "0", "no", "off"):
                raise ConfigError(f"{name} = {value!r}: expected true or false")
            if on or option.secondary_opts:
                argv.append("--" + name if on else option.secondary_opts[0])
        else:
            argv += ["--" + name, value]
    return argv


def explicit_argv(ctx: Any) -> list[str]:
    """The serve arguments given on the command line (GET /models shows them as status.args);
    the API key's value is never shown."""
    options = explicit_options(ctx)
    if "api-key" in options:
        options["api-key"] = "<redacted>"
    return to_argv(options, _options(ctx.command))


def router_models(ctx: Any, models_dir: str | None, preset: str | None,
                  setup: Callable[[dict[str, Any]], tuple[Any, Callable[[], Any]]]) -> list[ModelSpec]:
    """One ModelSpec per catalog model; `setup` turns serve parameters into (ServerConfig, load)."""
    known = _options(ctx.command)
    command_line = {k: v for k, v in explicit_options(ctx).items() if k not in ROUTER_ONLY}
    catalog = build_catalog(models_dir, preset, set(known), command_line)
    specs = []
    for entry in catalog.entries.values():
        args = to_argv(entry.options, known)
        try:
            params = ctx.command.make_context("serve", [entry.path, *args]).params
            config, load = setup(params)
        except ConfigError as e:
            raise ConfigError(f"model {entry.name!r}: {e}") from None
        except Exception as e:  # click's usage errors (a bad value for the option's type)
            if not hasattr(e, "format_message"):
                raise
            raise ConfigError(f"model {entry.name!r}: {e.format_message()}") from None
        specs.append(ModelSpec(name=entry.name, path=entry.path, aliases=tuple(entry.aliases), args=tuple(args),
                               load_on_startup=entry.load_on_startup, load=_loader(load, config)))
    return specs


def _loader(load: Callable[[], Any], config: Any) -> Callable[[], tuple[Any, Any]]:
    return lambda: (load(), config)
