"""The launcher's arithmetic and bookkeeping in this process: `launcher plan`'s split, the live
progress line, a fresh rendezvous store per drafter group. With real processes:
tests/e2e/test_launcher_plan.py, tests/e2e/test_launcher_runs.py."""

import pytest

from launcher.gpu_split import best, splits


def test_the_split_follows_the_slower_role():
    rows = splits(8, a=9_200, b=33_668)  # 27B-class target: about 3.7 targets per drafter
    assert [r["targets"] for r in rows] == [1, 2, 3, 4, 5, 6, 7]
    pick = best(rows)
    assert (pick["targets"], pick["drafters"], pick["bound"]) == (6, 2, "target")
    assert pick["tok_s"] == 6 * 9_200 and pick["drafter_busy"] == pytest.approx(6 * 9_200 / (2 * 33_668))
    pick = best(splits(8, a=33_000, b=54_000))  # 8B-class target
    assert (pick["targets"], pick["drafters"], pick["tok_s"]) == (5, 3, 162_000)
    assert best(splits(2, a=10.0, b=10.0))["tok_s"] == 10.0


def test_live_line_shows_the_metrics_window():
    from launcher.progress import ProgressLine

    window = {"step": 300, "loss": 4.17, "tau": 3.59, "tokens_per_s": 11700.0, "data_wait_frac": 0.1, "steps": 10}
    text = ProgressLine().format(step=305, total=1000, window=window)
    assert text.startswith("step 305/1000 30.5% ETA ") and text.endswith(" | loss 4.170 τ 3.59 11.7 Ktok/s")


def test_each_drafter_group_meets_in_a_fresh_store_across_launches(tmp_path):
    """A resumed run is a new launcher on the same run dir. A FileStore the last launch left behind
    holds the old group's gloo addresses; a rank that read them would connect to dead ports
    ('connectFullMesh ... Connection refused', seen in CI)."""
    from launcher.supervisor import Supervisor
    from launcher.topology import parse_gpu_spec
    from services.run.config import load_config

    cfg, workers = load_config(None, []), parse_gpu_spec("0:target,1-2:drafter")
    used = []
    for _ in range(2):  # two launches of the same run, as `up` then `up --resume`
        sup = Supervisor(tmp_path, cfg, workers, "cpu")
        for _ in range(2):  # a start and a group restart within one launch
            sup._new_dist_store()
            path = sup.dist_store()
            assert not path.exists(), f"{path.name} holds an earlier group's keys"
            path.write_bytes(b"stale keys")  # what a killed group leaves behind
            used.append(path)
    assert oct(used[0].parent.stat().st_mode & 0o777) == "0o700"
