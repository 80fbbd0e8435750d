"""The ranks of one run recorded with ``detctx.recording`` in each rank share a run identity
through the process group's store, so a folder mixing two runs' ranks is told apart, and a
recording that only some ranks start does not wait for the others."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_python

from detctx._compare.reading import read_trace

RANKS = """
import os, sys, torch, torch.distributed as dist
from helpers import fork_ranks
import detctx

folder, store, only_rank_0 = sys.argv[1], sys.argv[2], sys.argv[3] == "1"

def run_rank(rank):
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    os.environ.pop("DETCTX_RECORD_RUN", None)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    for recording in range(2):
        if rank == 0 or not only_rank_0:
            with detctx.recording(f"{folder}/{recording}"):
                torch.ones(3).mul(rank + 1)
    dist.destroy_process_group()

fork_ranks(run_rank, 2)
"""


@pytest.mark.slow
@pytest.mark.parametrize("only_rank_0", [False, True])
def test_the_ranks_of_one_recording_share_its_identity_and_none_waits(
    only_rank_0: bool, tmp_path: Path
) -> None:
    run_python(RANKS, str(tmp_path), str(tmp_path / "store"), "1" if only_rank_0 else "0")
    identities = []
    for recording in range(2):
        ranks = [0] if only_rank_0 else [0, 1]
        runs = {read_trace(tmp_path / str(recording) / f"rank{r}.trace").run for r in ranks}
        assert len(runs) == 1
        identities.append(runs.pop())
    # Each recording its own identity, and none the placeholder of an unshared one.
    assert len(set(identities)) == 2 and "unshared" not in identities
