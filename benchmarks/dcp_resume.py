"""Scenario 12: what detctx's entry adds to a ``torch.distributed.checkpoint`` save and load.

One process (DCP without a process group): a 4-layer MLP of 1M parameters
(4 MiB of float32) with AdamW's state (twice that again), and an elastic
loader; ``dcp.save`` / ``dcp.load`` of ``{"model", "optim"}`` against the same
with ``"detctx": detctx.dcp_resume_state(loader)``, into a temporary folder.
The bytes are the checkpoint folder's and the entry's own. On several ranks
saving adds one ``all_gather_object`` of each rank's resume state (about the
entry's size per rank), not measured here.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

import detctx
from benchmarks.harness import Result, Row, Settings, Table, measure, repeated
from benchmarks.harness import preserved_process_state as preserved

SCENARIO = "12 DCP checkpoint"
WIDTH = 512


class Points(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 1024

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.randn(WIDTH)


def folder_bytes(path: str) -> int:
    return sum(file.stat().st_size for file in Path(path).rglob("*") if file.is_file())


def run(settings: Settings) -> Result:
    import torch.distributed.checkpoint as dcp

    with preserved(), tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        # DCP says it saves in one process, and that it overwrites the last checkpoint.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
        with detctx.deterministic(seed=0):
            model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)))
            optimizer = torch.optim.AdamW(model.parameters())
            model(torch.randn(8, WIDTH)).sum().backward()
            optimizer.step()
        loader = detctx.elastic_loader(Points(), batch_size=32, seed=1)
        next(iter(loader))

        entry = detctx.dcp_resume_state(loader).state_dict()["ranks"]

        def state(with_detctx: bool, blob: bytes | None = None) -> dict[str, Any]:
            saved: dict[str, Any] = {"model": model.state_dict(), "optim": optimizer.state_dict()}
            if with_detctx:
                saved["detctx"] = detctx.dcp_resume_state(loader)
            if blob is not None:
                saved["blob"] = blob
            return saved

        plain, full = os.path.join(root, "plain"), os.path.join(root, "with_detctx")
        for path, with_detctx in ((plain, False), (full, True)):
            dcp.save(state(with_detctx), checkpoint_id=path)
        blob = os.path.join(root, "blob")
        stats = measure(
            {
                "save": repeated(lambda: dcp.save(state(True), checkpoint_id=full)),
                "save plain": repeated(lambda: dcp.save(state(False), checkpoint_id=plain)),
                "save bytes": repeated(
                    lambda: dcp.save(state(False, bytes(len(entry))), checkpoint_id=blob)
                ),
                "load": repeated(lambda: dcp.load(state(True), checkpoint_id=full)),
                "load plain": repeated(lambda: dcp.load(state(False), checkpoint_id=plain)),
                "entry": repeated(detctx.dcp_resume_state(loader).state_dict),
                "resume_state": repeated(lambda: detctx.resume_state(loader)),
            },
            settings,
        )
        sizes = (folder_bytes(plain), folder_bytes(full), len(entry))
    plain_text = "the same without detctx's entry"
    return Result(
        [
            Row(
                SCENARIO,
                "dcp.save with dcp_resume_state",
                stats["save"],
                plain_text,
                stats["save plain"],
            ),
            Row(
                SCENARIO,
                "dcp.load with dcp_resume_state",
                stats["load"],
                plain_text,
                stats["load plain"],
            ),
            Row(
                SCENARIO,
                "dcp.save with dcp_resume_state",
                stats["save"],
                "the same with a bytes entry of that size instead",
                stats["save bytes"],
                note="DCP writes any non-tensor entry its own way",
            ),
            Row(
                SCENARIO,
                "dcp_resume_state(loader).state_dict()",
                stats["entry"],
                "resume_state(loader)",
                stats["resume_state"],
                note="one process: no gather",
            ),
        ],
        [
            Table(
                "DCP checkpoint bytes",
                ["checkpoint", "bytes"],
                [
                    ["model + AdamW state", f"{sizes[0]:,}"],
                    ["model + AdamW state + detctx", f"{sizes[1]:,}"],
                    ["detctx's entry (one rank's RNGs and the loader)", f"{sizes[2]:,}"],
                ],
                note="the folder DCP writes (data files and .metadata); on W ranks the entry "
                "holds W resume states",
            )
        ],
    )
