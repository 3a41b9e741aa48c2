"""Layering rules of DESIGN.md, checked on the source with `ast`: kernels/ imports nothing from
engine/; engine/ imports nothing from server/ and raises engine errors, never errors that carry
HTTP facts (the server maps engine errors to HTTP at its edge); the server reads model facts from
the engine (LoadedModel.facts), never from the artifact or its metadata."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ninfer"
HTTP_KEYWORDS = {"status", "status_code"}  # an error constructed with these carries an HTTP status
# what the server would need to compute model facts itself: the artifact, its weight table, the file format
ARTIFACT_MODULES = ("ninfer.engine.artifact", "ninfer.engine.models", "ninfer.engine.quant", "ninfer.engine.convert",
                    "ninfer.formats", "safetensors", "struct")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `source`, relative ones resolved against
    `module`; `from a import b` yields both a and a.b (b may be a submodule)."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def http_errors_raised(source: str) -> list[tuple[int, str]]:
    """(line, what) for each mention of RequestError and each exception built with an HTTP status."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(_mark_raised(ast.parse(source))):
        if isinstance(node, ast.Name) and node.id == "RequestError":
            found.append((node.lineno, "RequestError"))
        elif isinstance(node, ast.Attribute) and node.attr == "RequestError":
            found.append((node.lineno, "RequestError"))
        elif isinstance(node, ast.alias) and node.name.rpartition(".")[2] == "RequestError":
            found.append((getattr(node, "lineno", 0), "import RequestError"))
        elif isinstance(node, ast.Call) and _is_error(node):
            for kw in node.keywords:
                if kw.arg in HTTP_KEYWORDS:
                    found.append((node.lineno, f"{ast.unparse(node.func)}({kw.arg}=...)"))
    return found


def _is_error(call: ast.Call) -> bool:
    # an exception being built: raised right here, or a class named *Error / *Exception
    name = ast.unparse(call.func).rpartition(".")[2]
    return name.endswith(("Error", "Exception")) or getattr(call, "raised", False)


def _mark_raised(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            node.exc.raised = True  # type: ignore[attr-defined]
    return tree


def artifact_reads(source: str) -> list[tuple[int, str]]:
    """(line, expression) for each read of a loaded model's artifact metadata or path
    (`loaded.meta`, `state.loaded.path`, ...): the facts object is the server's one source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ("meta", "path"):
            base = node.value
            if (isinstance(base, ast.Name) and base.id == "loaded") or \
                    (isinstance(base, ast.Attribute) and base.attr == "loaded"):
                found.append((node.lineno, ast.unparse(node)))
    return found


def violations(subpackage: str, *forbidden: str) -> list[str]:
    out = []
    for path in sorted((PACKAGE / subpackage).rglob("*.py")):
        module = module_name(path)
        for line, name in imported_modules(path.read_text(), module, path.name == "__init__.py"):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                out.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
    return out


def test_the_checks_can_fail() -> None:
    assert ("ninfer.engine.quant" in {n for _, n in imported_modules("from ..engine.quant import X",
                                                                      "ninfer.kernels.launchers")})
    assert ("ninfer.engine" in {n for _, n in imported_modules("from ninfer import engine", "ninfer.kernels.x")})
    assert ("ninfer.server.http" in {n for _, n in imported_modules("import ninfer.server.http", "ninfer.engine.x")})
    assert ("ninfer.engine.errors" in {n for _, n in imported_modules("from . import errors", "ninfer.engine",
                                                                       is_package=True)})
    assert http_errors_raised("raise RequestError('full', status=429)")
    assert http_errors_raised("raise errors.RequestError('x')")
    assert http_errors_raised("raise Overloaded('full', status_code=429)")
    assert http_errors_raised("err = OverloadedError('full', status=429)")
    assert not http_errors_raised("raise EngineOverloaded(12)")
    assert not http_errors_raised("seq = Sequence(status=SeqStatus.WAITING)")  # not an error: engine state
    assert artifact_reads("n = loaded.meta.config.vocab_size") and artifact_reads("p = str(state.loaded.path)")
    assert not artifact_reads("p = state.loaded.facts.path")


def test_kernels_import_nothing_from_engine() -> None:
    assert violations("kernels", "ninfer.engine") == []


def test_engine_imports_nothing_from_server() -> None:
    assert violations("engine", "ninfer.server") == []


@pytest.mark.parametrize("path", sorted((PACKAGE / "engine").rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_engine_raises_no_http_errors(path: Path) -> None:
    """The engine raises ninfer/engine/errors.py classes; HTTP status, type and code are the server's."""
    assert http_errors_raised(path.read_text()) == []


def test_server_reads_model_facts_not_artifacts() -> None:
    assert violations("server", *ARTIFACT_MODULES) == []
    reads = [f"{p.relative_to(PACKAGE.parent)}:{line} reads {expr}" for p in sorted((PACKAGE / "server").rglob("*.py"))
             for line, expr in artifact_reads(p.read_text())]
    assert reads == []


CHAT_PROTOCOLS = ("openai_chat", "responses", "anthropic")


@pytest.mark.parametrize("protocol", CHAT_PROTOCOLS)
def test_chat_protocols_import_no_other_protocol(protocol: str) -> None:
    """Each chat protocol is a decoder and an encoder over the one chat path (chat_request,
    chat_run, chat_output); what they share lives there, not in another protocol's module."""
    path = PACKAGE / "server" / f"{protocol}.py"
    others = [f"ninfer.server.{p}" for p in CHAT_PROTOCOLS if p != protocol]
    names = [name for _, name in imported_modules(path.read_text(), f"ninfer.server.{protocol}")]
    assert [n for n in names if any(n == o or n.startswith(o + ".") for o in others)] == []
    assert "ninfer.server.chat_run.run_chat" in names  # the one generation loop


def test_the_server_app_imports_without_torch() -> None:
    """torch loads with the model, after the listener is up: a server module that imports it at
    module level delays start-up and races a failed load's shutdown (a Granian abort was seen)."""
    import subprocess
    import sys

    code = "import sys, ninfer.server.app; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
