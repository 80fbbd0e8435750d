"""A checkpoint resumed into a loader built differently is refused by name, with or without -O."""

from __future__ import annotations

import json

import pytest
from conftest import run_python
from resume_changes import outcomes

pytestmark = pytest.mark.slow

pytest.importorskip("torchdata.stateful_dataloader")

NAMED = {
    "num_workers 2 -> 0": "num_workers was 2, is 0 now",
    "num_workers 2 -> 1": "num_workers was 2, is 1 now",
    "num_workers 2 -> 3": "num_workers was 2, is 3 now",
    "batch_size 8 -> 4": "batch_size was 8, is 4 now",
    "drop_last False -> True": "drop_last was False, is True now",
    "dataset length 12 -> 4": "the dataset's length was 12, is 4 now",
    "dataset length 12 -> 8": "the dataset's length was 12, is 8 now",
    "dataset length 12 -> 20": "the dataset's length was 12, is 20 now",
    "shuffle -> a RandomSampler": (
        "the sampler's kind was 'torchdata.stateful_dataloader.sampler.RandomSampler', "
        "is 'torch.utils.data.sampler.RandomSampler' now"
    ),
    "shuffle -> in order": "is 'torch.utils.data.sampler.SequentialSampler' now",
    "rank 0 -> rank 1": "rank was 0, is 1 now",
    "world size 1 -> 2": "world size was 1, is 2 now",
}


def assert_each_change_refused_by_name(results: dict[str, str]) -> None:
    assert results.pop("unchanged") == "exact"
    assert set(results) == set(NAMED)
    for case, message in results.items():
        assert NAMED[case] in message, (case, message)
        assert "To resume, " in message
    # from 1 rank to 2 (as rank 1, or rank 0) no rank 1 checkpoint exists: what to do instead
    for case in ("rank 0 -> rank 1", "world size 1 -> 2"):
        assert "run on the 1 rank that saved it" in results[case]
        assert "detctx.elastic_loader" in results[case]
        assert "rank 1 wrote" not in results[case]
    assert "build the loader as it was when the state was saved" in results["batch_size 8 -> 4"]


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_a_state_saved_with_two_workers_batches_of_8_and_12_items_fits_only_that_loader() -> None:
    # Saved with num_workers=2, batch_size=8, 12 items, shuffle=True, rank 0 of 1; each
    # case builds the loader one step off and resumes it; nothing changes when refused.
    assert_each_change_refused_by_name(outcomes())


def test_under_python_dash_o_the_same_changes_are_refused_the_same_way() -> None:
    # torchdata's own checks are assert statements, which -O removes.
    out = run_python(
        "import runpy, sys; print(sys.flags.optimize); sys.argv = ['resume_changes.py']; "
        "runpy.run_module('resume_changes', run_name='__main__')",
        timeout=300,
        env={"PYTHONOPTIMIZE": "1"},
    )
    optimize, results = out.strip().splitlines()[-2:]
    assert optimize == "1"
    assert_each_change_refused_by_name(json.loads(results))
