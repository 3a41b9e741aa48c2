"""`ninfer slots`: slot files on disk (list, show, rm) and slot actions against a running server
(save, restore, erase through POST /slots/{id}). --json prints machine-readable output."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

import typer

from ninfer.errors import NInferError

app = typer.Typer(name="slots", help="Slot files (list, show, rm) and slot actions on a running server.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

URL = typer.Option("http://127.0.0.1:8080", "--url", help="The server's base URL.")
API_KEY = typer.Option(None, "--api-key", envvar="NINFER_API_KEY", help="The server's API key.")
JSON = typer.Option(False, "--json", help="Print JSON.")


class SlotsError(NInferError):
    """A slot command that failed (a bad file, or the server's error answer)."""


def _describe(path: Path) -> dict[str, Any]:
    from ninfer.engine.session_files import read_session_header

    header = read_session_header(path)
    images = header.get("images") or []
    first = images[0] if images else {}
    stat = path.stat()
    return {"file": path.name, "kind": header.get("kind"), "model": header.get("model"),
            "sessions": len(images), "tokens": sum(len(i.get("session", ())) for i in images),
            "digest": first.get("digest"), "size": stat.st_size,
            "date": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(header.get("created", stat.st_mtime)))}


def _emit(data: Any, as_json: bool, lines: list[str]) -> None:
    if as_json:
        print(json.dumps(data, indent=2))
    else:
        for line in lines:
            print(line)


@app.command("list")
def list_files(folder: Path = typer.Argument(..., help="The --slot-save-path folder."), as_json: bool = JSON) -> None:
    """Slot files in FOLDER with model, tokens, digest, size and date."""
    from ninfer.engine.session_files import SessionFileError

    if not folder.is_dir():
        raise SlotsError(f"{folder} is not a folder")
    rows = []
    for path in sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")):
        try:
            rows.append(_describe(path))
        except SessionFileError:
            continue  # not a slot file
    lines = [f"{'FILE':<24} {'MODEL':<28} {'TOKENS':>7} {'DIGEST':<16} {'SIZE':>10}  DATE"]
    lines += [f"{r['file']:<24} {str(r['model']):<28} {r['tokens']:>7} {str(r['digest']):<16} {r['size']:>10}  {r['date']}"
              for r in rows]
    _emit(rows, as_json, lines)


@app.command("show")
def show(file: Path = typer.Argument(..., help="A slot file."), as_json: bool = JSON) -> None:
    """One slot file: its header (model, compatibility profile, sessions and checkpoints) and size."""
    from ninfer.engine.session_files import read_session_header

    header = read_session_header(file)
    info = _describe(file)
    info["compat"] = header.get("compat")
    info["images"] = [{"tokens": len(i["session"]), "frontier": len(i["token_ids"]), "digest": i["digest"],
                       "pages": i["n_pages"],
                       "checkpoints": list(i["page_checkpoints"]) + ([len(i["token_ids"])] if i["frontier_state"] else [])}
                      for i in header.get("images", [])]
    lines = [f"{k}: {v}" for k, v in info.items() if k not in ("compat", "images")]
    lines += [f"compat.{k}: {v}" for k, v in (info["compat"] or {}).items() if k != "layout"]
    lines += [f"session {n}: {i['tokens']} tokens, frontier {i['frontier']}, digest {i['digest']}, {i['pages']} pages, "
              f"checkpoints {i['checkpoints']}" for n, i in enumerate(info["images"])]
    _emit(info, as_json, lines)


@app.command("rm")
def rm(file: Path = typer.Argument(..., help="A slot file.")) -> None:
    """Delete a slot file (only a ninfer session file)."""
    _describe(file)  # refuses anything that is not a session file
    file.unlink()
    print(f"removed {file}")


def _post(url: str, api_key: Optional[str], slot: int, action: str, body: dict[str, Any]) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.post(f"{url.rstrip('/')}/slots/{slot}", params={"action": action}, json=body, headers=headers,
                       timeout=600)
    except httpx.TransportError as e:
        raise SlotsError(f"cannot reach {url}: {e}") from None
    data = r.json() if r.headers.get("content-type", "").startswith("application/json") else {"raw": r.text}
    if r.status_code != 200:
        err = data.get("error", data)
        raise SlotsError(f"{r.status_code} {err.get('code') or ''}: {err.get('message', r.text)}")
    return data


def _action(url: str, api_key: Optional[str], slot: int, action: str, body: dict[str, Any], as_json: bool) -> None:
    data = _post(url, api_key, slot, action, body)
    _emit(data, as_json, [" ".join(f"{k}={v}" for k, v in data.items())])


@app.command("save")
def save(slot: int = typer.Argument(..., help="The slot id."), filename: str = typer.Argument(...),
         if_digest: Optional[str] = typer.Option(None, "--if-digest", help="Only if the slot holds this session."),
         url: str = URL, api_key: Optional[str] = API_KEY, as_json: bool = JSON) -> None:
    """Save the session in SLOT to FILENAME in the server's --slot-save-path."""
    body: dict[str, Any] = {"filename": filename}
    if if_digest:
        body["if_digest"] = if_digest
    _action(url, api_key, slot, "save", body, as_json)


@app.command("restore")
def restore(slot: int = typer.Argument(...), filename: str = typer.Argument(...), url: str = URL,
            api_key: Optional[str] = API_KEY, as_json: bool = JSON) -> None:
    """Restore FILENAME into SLOT (replacing what it held)."""
    _action(url, api_key, slot, "restore", {"filename": filename}, as_json)


@app.command("erase")
def erase(slot: int = typer.Argument(...),
          if_digest: Optional[str] = typer.Option(None, "--if-digest", help="Only if the slot holds this session."),
          url: str = URL, api_key: Optional[str] = API_KEY, as_json: bool = JSON) -> None:
    """Evict the session in SLOT."""
    _action(url, api_key, slot, "erase", {"if_digest": if_digest} if if_digest else {}, as_json)


def main() -> None:  # pragma: no cover - `python -m ninfer.cli.slots`
    try:
        app()
    except NInferError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
