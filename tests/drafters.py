"""Starting real drafter processes from tests: `python -m services.drafter [--synthetic] --device cpu`."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def spawn(run_dir, *args, rank=0, world_size=1, port=None, preexec_fn=None, synthetic=True):
    """One drafter rank (synthetic data, or from the targets over ZMQ); with world_size > 1, a gloo
    rank rendezvousing on `port`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "MASTER_", "RANK", "WORLD_SIZE"))}
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    if world_size > 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return subprocess.Popen([sys.executable, "-m", "services.drafter", "--run-dir", str(run_dir),
                             *(["--synthetic"] if synthetic else []), "--rank", str(rank), "--world-size", str(world_size),
                             "--device", "cpu", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)
