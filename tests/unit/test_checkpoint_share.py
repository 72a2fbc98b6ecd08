"""Rank 0's checkpoint reaches a rank whose host has no copy (no shared folder): two real gloo
processes, each with its own run folder."""

import json
import sys

import pytest
import torch
import torch.multiprocessing as mp

from services.drafter.checkpoints import checkpoint as ckpt
from tests.launching import free_port

pytestmark = pytest.mark.slow  # two processes importing torch


def write(run_dir, step: int) -> None:
    ckpt.write_checkpoint(
        ckpt.checkpoints_dir(run_dir),
        step,
        weights={"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)},
        optimizer={"optimizer": {"state": {}, "param_groups": []}},
        rng={"cpu.0": torch.get_rng_state()},
        meta={"step": step, "micro_step": step, "next_g": 2 * step},
        config={"run": {"name": "t"}},
        keep=3,
    )


def rank_main(rank: int, folders: list[str], port: int, out: str) -> None:
    import torch.distributed as dist

    from services.drafter.checkpoints.checkpoint_share import share

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(folders))
    run_dir = folders[rank]
    root = ckpt.checkpoints_dir(run_dir)
    found = None
    if (latest := ckpt.pointer(root, ckpt.LATEST)) is not None:
        found = ckpt.Found(latest, ckpt.verify(latest), {})
    got = share(found, run_dir, rank)
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"path": str(got.path), "next_g": got.batches_done} if got else None, f)
    dist.destroy_process_group()


@pytest.mark.processes
@pytest.mark.skipif(sys.platform != "linux", reason="gloo on loopback")
def test_a_rank_without_the_checkpoint_gets_rank_0s_and_one_with_a_stale_one_too(tmp_path):
    folders = [tmp_path / "host-a", tmp_path / "host-b", tmp_path / "host-c"]
    write(folders[0], 8)
    write(folders[2], 4)  # an older one of its own: rank 0's is the resume point
    mp.spawn(rank_main, args=([str(f) for f in folders], free_port(), str(tmp_path / "got")), nprocs=3)
    answers = [json.loads((tmp_path / f"got.{r}").read_text()) for r in range(3)]
    assert [a["next_g"] for a in answers] == [16, 16, 16]
    for folder, answer in zip(folders, answers):
        assert answer["path"] == str(ckpt.checkpoints_dir(folder) / "step-00000008")
        assert ckpt.pointer(ckpt.checkpoints_dir(folder), ckpt.LATEST).name == "step-00000008"
        ckpt.verify(ckpt.checkpoints_dir(folder) / "step-00000008")  # every file, against rank 0's manifest
