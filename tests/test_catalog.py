"""The router catalog (server/catalog.py): --models-dir scanning, the preset INI, option precedence."""
from pathlib import Path

import pytest

from ninfer.errors import ConfigError
from ninfer.server.catalog import build_catalog, read_preset, scan_models_dir

SERVE = {"kv-capacity", "max-context", "model-suspend", "temperature", "chat-template"}


def touch(p: Path, text: str = "") -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def test_models_dir_files_subfolders_and_hf_folders(tmp_path: Path) -> None:
    touch(tmp_path / "small.ninfer")
    touch(tmp_path / "q4.gguf")
    touch(tmp_path / "notes.txt")
    touch(tmp_path / "qwen" / "weights.ninfer")
    touch(tmp_path / "two" / "a.gguf")
    touch(tmp_path / "two" / "b.gguf")  # several: not a model folder
    touch(tmp_path / "hf" / "config.json", "{}")
    touch(tmp_path / "hf" / "model.safetensors")
    touch(tmp_path / "empty" / "readme.md")
    assert scan_models_dir(tmp_path) == {
        "hf": str(tmp_path / "hf"), "q4": str(tmp_path / "q4.gguf"), "qwen": str(tmp_path / "qwen" / "weights.ninfer"),
        "small": str(tmp_path / "small.ninfer")}
    with pytest.raises(ConfigError, match="no such directory"):
        scan_models_dir(tmp_path / "missing")


def test_models_dir_name_clash(tmp_path: Path) -> None:
    touch(tmp_path / "m.ninfer")
    touch(tmp_path / "m" / "x.gguf")
    with pytest.raises(ConfigError, match="two models are named 'm'"):
        scan_models_dir(tmp_path)


PRESET = """
; global options
[*]
max-context = 4096
kv-capacity = 8192

# a model of its own
[chat]
model = /models/chat.ninfer
alias = assistant, gpt-4o
load-on-startup = true
kv-capacity = 65536
model-suspend = true

[small]
temperature = 0.2
"""


def test_preset_precedence_aliases_and_dir_models(tmp_path: Path) -> None:
    touch(tmp_path / "dir" / "small.ninfer")
    touch(tmp_path / "dir" / "other.gguf")
    preset = touch(tmp_path / "p.ini", PRESET)
    cat = build_catalog(str(tmp_path / "dir"), str(preset), SERVE, command_line={"max-context": "2048"})
    assert list(cat.entries) == ["other", "small", "chat"]
    chat = cat.entries["chat"]
    assert chat.path == "/models/chat.ninfer" and chat.aliases == ["assistant", "gpt-4o"] and chat.load_on_startup
    # command line > model section > [*]
    assert chat.options == {"max-context": "2048", "kv-capacity": "65536", "model-suspend": "true"}
    small = cat.entries["small"]
    assert small.path == str(tmp_path / "dir" / "small.ninfer") and not small.load_on_startup
    assert small.options == {"max-context": "2048", "kv-capacity": "8192", "temperature": "0.2"}
    assert cat.entries["other"].options == {"max-context": "2048", "kv-capacity": "8192"}
    assert cat.find("gpt-4o") is chat and cat.find("small") is small and cat.find("nope") is None


@pytest.mark.parametrize("text,message", [
    ("[m]\nmodel = x.ninfer\nport = 9000\n", "port is the router's option"),
    ("[m]\nmodel = x.ninfer\nbatch-size = 4\n", "unknown serve option 'batch-size'"),
    ("[*]\nmodel = x.ninfer\n", "model belongs in a model's own section"),
    ("[m]\nkv-capacity = 1\n", r"\[m\]: no model = PATH"),
    ("[m]\nmodel = x\nload-on-startup = maybe\n", "expected true or false"),
    ("[m]\nmodel = x\n[m]\nmodel = y\n", "already exists"),
    ("[a]\nmodel = x\nalias = b\n[b]\nmodel = y\n", "model name 'b' is used by both"),
    ("not an ini", "File contains no section headers"),
])
def test_preset_errors_name_the_file_section_and_key(tmp_path: Path, text: str, message: str) -> None:
    preset = touch(tmp_path / "bad.ini", text)
    with pytest.raises(ConfigError, match=message):
        build_catalog(None, str(preset), SERVE)


def test_preset_missing_and_empty_catalog(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        read_preset(tmp_path / "none.ini")
    with pytest.raises(ConfigError, match="the catalog is empty"):
        build_catalog(str(tmp_path), None, SERVE)
    with pytest.raises(ConfigError, match="needs --models-dir or --models-preset"):
        build_catalog(None, None, SERVE)
