"""Optional Weights & Biases logging (drafter rank 0): the figures TensorBoard gets, under the same
names (train/…, eval/…, spec/…), when `log.wandb_project` is set.

wandb is an optional extra (`pip install 'dflash-service[wandb]'`). With log.wandb_project set and
wandb missing, the drafter stops while starting with one line that says so (exit 2), rather than
training for hours without the logs that were asked for. Where the run goes is wandb's own
business: WANDB_API_KEY / `wandb login`, WANDB_ENTITY, WANDB_MODE=offline (no network; `wandb
sync` later), WANDB_DIR (default: the run dir, so its files sit in <run_dir>/wandb).

One W&B run per run dir: its id is kept in <run_dir>/wandb_id, so a resume continues the same
W&B run. The x axis is the optimizer step, logged as the `step` field (W&B's own step counter must
only grow, and a resume goes back to the checkpoint's step).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from services.run.config import ConfigError

ID_FILE = "wandb_id"
PREFIXES = ("train", "eval", "spec")


def missing_message() -> str:
    return (
        "log.wandb_project is set but the wandb package is not installed: pip install 'dflash-service[wandb]' "
        "(or pip install wandb), or leave log.wandb_project empty"
    )


class WandbLog:
    def __init__(self, run_dir: str | Path, project: str, config: dict):
        try:
            import wandb
        except ImportError:
            raise ConfigError(missing_message()) from None
        run_dir = Path(run_dir)
        id_file = run_dir / ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(6)
        id_file.write_text(run_id + "\n")
        try:
            self.run = wandb.init(
                project=project,
                name=run_dir.name,
                id=run_id,
                resume="allow",
                config=config,
                dir=os.environ.get("WANDB_DIR") or str(run_dir),
            )
        except Exception as exc:  # not logged in, no network, bad entity: say it in one line
            raise ConfigError(
                f"log.wandb_project={project!r}: W&B did not start ({type(exc).__name__}: {exc}); "
                "`wandb login`, or WANDB_MODE=offline to log locally"
            ) from None
        self.run.define_metric("step")
        for prefix in PREFIXES:
            self.run.define_metric(f"{prefix}/*", step_metric="step")

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log({"step": step, **values})

    def close(self) -> None:
        self.run.finish()
