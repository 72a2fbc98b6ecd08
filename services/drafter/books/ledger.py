"""The batch ledger: which global batch index each step of this rank trained.

One JSONL file per rank under <run_dir>/ledger/. A line is written after the optimizer step that
used the batch. On resume from a checkpoint at step s, lines for steps >= s are dropped (that work
is redone from the checkpoint), so the ledger always describes the weights' actual lineage and
"every batch trained exactly once" can be checked from it. A step is a micro-step, the same on
every rank, so a cut at step s is one point of the run even when a resume changed the number of
drafters: rank 0 also cuts the files of ranks that the resumed run does not have. Each line also
names the target incarnation that served the batch and the digest of its token ids
(services/batch.token_digest), so an audit can tell which process produced what, and rebuild
batch g to compare.
"""

from __future__ import annotations

import json
from pathlib import Path

from services.run.files import write_text_atomic


class Ledger:
    def __init__(self, run_dir: str | Path, rank: int, start_step: int = 0, world_size: int | None = None):
        self.path = Path(run_dir) / "ledger" / f"drafter-{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        truncate_jsonl(self.path, keep_through_step=start_step - 1)
        if rank == 0 and world_size is not None:  # ranks of an earlier launch with more drafters
            for path in self.path.parent.glob("drafter-*.jsonl"):
                if _rank_of(path) is not None and _rank_of(path) >= world_size:
                    truncate_jsonl(path, keep_through_step=start_step - 1)
        self._file = open(self.path, "a")

    def record(self, step: int, g: int, tokens: int, provenance: dict | None = None) -> None:
        """provenance: {incarnation, digest}: which target process served batch g, and a digest of
        its token ids (none for an empty batch, or a synthetic one)."""
        self._file.write(json.dumps({"step": step, "g": g, "tokens": tokens, **(provenance or {})}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def truncate_jsonl(path: Path, keep_through_step: int) -> None:
    """Drop lines with step > keep_through_step, and lines cut by a crash (ledger and metrics)."""
    if not path.exists():
        return
    keep = [
        line for line in path.read_text().splitlines() if _step(line) is not None and _step(line) <= keep_through_step
    ]
    write_text_atomic(path, "".join(line + "\n" for line in keep))


def _rank_of(path: Path) -> int | None:
    try:
        return int(path.stem.split("-", 1)[1])
    except (IndexError, ValueError):
        return None


def _step(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None  # a line cut by a crash mid-write: not part of the lineage


def read_all(run_dir: str | Path) -> list[dict]:
    """Every ledger entry of every rank (for tests and reports)."""
    entries = []
    for path in sorted((Path(run_dir) / "ledger").glob("drafter-*.jsonl")):
        for line in path.read_text().splitlines():
            if _step(line) is not None:
                entries.append(dict(json.loads(line), rank=int(path.stem.split("-")[1])))
    return entries
