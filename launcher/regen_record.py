"""What `launcher regenerate` did, recorded beside its output (OUT.jsonl.regenerate.json), and the
one reader `up` uses to check that training renders the chats as the regeneration did.

A drafter trained on text rendered with one set of chat-template options (Qwen3's enable_thinking)
and served with another loses its acceptance, so the options travel with the data. The record
holds the output's sha256: an edited or replaced file no longer matches it, and its record is
then not the file's (`up` warns instead of refusing).
"""

from __future__ import annotations

import json
from pathlib import Path

from services.run.config import toml_literal
from services.run.files import sha256_file, write_json_atomic

SUFFIX = ".regenerate.json"


def record_path(data: str | Path) -> Path:
    data = Path(data)
    return data.with_name(data.name + SUFFIX)


def write_record(out: Path, fields: dict) -> Path:
    """The record of `out` (written last: a crash before leaves an older record, which no longer matches)."""
    record = dict(fields, out=str(out), bytes=out.stat().st_size, sha256=sha256_file(out))
    path = record_path(out)
    write_json_atomic(path, record)
    return path


def template_kwargs_problem(key: str, data: str, run_kwargs: dict) -> tuple[str, str]:
    """(refusal, warning) for data file `data` (config key `key`) trained with run_kwargs; ("", "")
    when it has no readable record or the record agrees. A record that disagrees refuses only while
    its sha256 is the file's; for an edited file it is a warning. The file is hashed only when the
    options differ: an agreeing record costs one small read, whatever the data's size."""
    try:
        record = json.loads(record_path(data).read_text(encoding="utf-8"))
        kwargs, size, digest = record["chat_template_kwargs"], int(record["bytes"]), str(record["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return "", ""
    if not isinstance(kwargs, dict) or kwargs == run_kwargs:
        return "", ""
    said = (
        f"{key} {data} was regenerated with chat_template_kwargs {json.dumps(kwargs)}, "
        f"the run renders with {json.dumps(run_kwargs)}"
    )
    try:
        same = Path(data).stat().st_size == size and sha256_file(Path(data)) == digest
    except OSError:
        same = False
    if same:
        return f"{said}: set data.chat_template_kwargs = {toml_literal(kwargs)}", ""
    return "", (
        f"{record_path(data).name} says {said}; but {data} changed since (its sha256 differs), "
        "so this is not checked: render as the data was written"
    )
