"""The router's catalog: which models a `--models-dir` and a `--models-preset` INI name, and the serve
options each one is configured with (the spec's "Several models (router)").

- `--models-dir DIR`: every `.ninfer` or `.gguf` directly in DIR under its file stem, and every
  subdirectory holding exactly one of them, or a Hugging Face folder (config.json + safetensors),
  under the subdirectory's name.
- `--models-preset FILE`: llama.cpp's preset INI. `[*]` holds options for every model; any other
  section is a model: `model = PATH`, `alias = a, b`, `load-on-startup = true`, and any serve option
  without its leading dashes (`kv-capacity = 65536`; a flag is `model-suspend = true`). A section named
  after a model of the directory configures it and needs no path. `;` and `#` start comments.
- Precedence: options given on the command line > the model's section > `[*]`.

Pure Python: values stay strings (flags "true"/"false"); the CLI converts them with the serve command's
own option types, so a preset value is checked exactly as the same flag on the command line.
"""
from __future__ import annotations

import configparser
from dataclasses import dataclass, field
from pathlib import Path

from ninfer.errors import ConfigError

MODEL_SUFFIXES = (".ninfer", ".gguf")
SECTION_KEYS = ("model", "alias", "load-on-startup")  # a model section's own keys, not serve options
# the router process's own options, never a model's: listener, auth, limits on every body, logs, the
# catalog and its timers, CPU threads (one plan for the process), the public name (a model's is its
# file, folder or section name)
ROUTER_ONLY = ("host", "port", "api-key", "models-dir", "models-preset", "models-max", "models-autoload",
               "no-models-autoload", "stats-port", "cors", "max-request-mib", "log-level", "log-stats-interval-ms",
               "log-stats-panel", "request-log-jsonl", "request-log-max-mib", "request-log-keep", "threads",
               "model-id", "unload-idle-seconds", "sleep-idle-seconds")


@dataclass(slots=True)
class CatalogEntry:
    name: str
    path: str
    aliases: list[str] = field(default_factory=list)
    load_on_startup: bool = False
    options: dict[str, str] = field(default_factory=dict)  # serve option (no dashes) -> value as written


@dataclass(slots=True)
class Catalog:
    entries: dict[str, CatalogEntry]  # by name, in catalog order

    def find(self, name: str) -> CatalogEntry | None:
        """The entry called `name` or carrying it as an alias."""
        if name in self.entries:
            return self.entries[name]
        return next((e for e in self.entries.values() if name in e.aliases), None)


def scan_models_dir(directory: str | Path) -> dict[str, str]:
    """name -> path of every model the directory serves (see the module docstring)."""
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise ConfigError(f"--models-dir {str(directory)!r}: no such directory")
    found: dict[str, str] = {}
    for p in sorted(root.iterdir()):
        if p.is_file() and p.suffix in MODEL_SUFFIXES:
            name, path = p.stem, str(p)
        elif p.is_dir():
            files = [f for f in sorted(p.iterdir()) if f.is_file() and f.suffix in MODEL_SUFFIXES]
            if len(files) == 1:
                name, path = p.name, str(files[0])
            elif not files and (p / "config.json").is_file() and any(p.glob("*.safetensors")):
                name, path = p.name, str(p)
            else:
                continue  # none or several: not a model folder
        else:
            continue
        if name in found:
            raise ConfigError(f"--models-dir {str(directory)!r}: two models are named {name!r} "
                              f"({found[name]} and {path})")
        found[name] = path
    return found


def _truth(value: str, where: str) -> bool:
    v = value.strip().lower()
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off"):
        return False
    raise ConfigError(f"{where}: expected true or false, got {value!r}")


def read_preset(path: str | Path) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """([*] options, {section: its keys}) of a preset INI, keys lower-cased, in file order."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"--models-preset {str(path)!r}: no such file")
    parser = configparser.ConfigParser(comment_prefixes=("#", ";"), inline_comment_prefixes=None,
                                       interpolation=None, default_section="\0none", strict=True)
    try:
        parser.read_string(p.read_text(encoding="utf-8"), source=str(p))
    except (configparser.Error, UnicodeDecodeError) as e:
        raise ConfigError(f"--models-preset {str(path)!r}: {str(e).splitlines()[0]}") from None
    common = dict(parser["*"]) if parser.has_section("*") else {}
    sections = {s: dict(parser[s]) for s in parser.sections() if s != "*"}
    return common, sections


def build_catalog(models_dir: str | None, preset: str | None, serve_options: set[str],
                  command_line: dict[str, str] | None = None) -> Catalog:
    """The catalog of `models_dir` and `preset` with each model's merged serve options.

    serve_options: the serve command's option names without dashes (what a preset may set);
    command_line: options given explicitly on the command line, which win over the preset."""
    if not models_dir and not preset:
        raise ConfigError("a router needs --models-dir or --models-preset")
    dir_models = scan_models_dir(models_dir) if models_dir else {}
    common, sections = read_preset(preset) if preset else ({}, {})
    where = f"--models-preset {preset!r}"

    def options(keys: dict[str, str], section: str) -> dict[str, str]:
        out = {}
        for key, value in keys.items():
            if key in SECTION_KEYS:
                if section == "*":
                    raise ConfigError(f"{where} [*]: {key} belongs in a model's own section")
                continue
            if key in ROUTER_ONLY:
                raise ConfigError(f"{where} [{section}]: {key} is the router's option, not a model's")
            if key not in serve_options:
                raise ConfigError(f"{where} [{section}]: unknown serve option {key!r}")
            out[key] = value
        return out

    base = options(common, "*")
    entries: dict[str, CatalogEntry] = {n: CatalogEntry(n, p) for n, p in dir_models.items()}
    for name, keys in sections.items():
        own = options(keys, name)
        path = keys.get("model")
        if name in entries:
            entry = entries[name]
            if path:
                entry.path = str(Path(path).expanduser())
        elif path:
            entry = entries[name] = CatalogEntry(name, str(Path(path).expanduser()))
        else:
            raise ConfigError(f"{where} [{name}]: no model = PATH and no model of that name in --models-dir")
        entry.aliases = [a.strip() for a in keys.get("alias", "").split(",") if a.strip()]
        if "load-on-startup" in keys:
            entry.load_on_startup = _truth(keys["load-on-startup"], f"{where} [{name}] load-on-startup")
        entry.options = {**base, **own}
    for entry in entries.values():
        if not entry.options:
            entry.options = dict(base)
        entry.options.update(command_line or {})
    if not entries:
        raise ConfigError("the catalog is empty: no model in --models-dir and no model section in --models-preset")
    names: dict[str, str] = {}
    for entry in entries.values():
        for n in (entry.name, *entry.aliases):
            if n in names and names[n] != entry.name:
                raise ConfigError(f"model name {n!r} is used by both {names[n]!r} and {entry.name!r}")
            names[n] = entry.name
    return Catalog(entries)
