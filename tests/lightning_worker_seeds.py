"""A Lightning fit whose data loader workers report their seeds, for ``test_lightning.py``.

``python tests/lightning_worker_seeds.py OUT_DIR [--reference] [--strategy S --devices N]
[--detctx-loader]`` fits one epoch on CPU with two loader
workers and writes ``OUT_DIR/seeds-RANK.json``: ``{worker: torch seed}`` for the
items that rank trained on. ``--reference``: ``seed_everything(SEED, workers=True)``
instead of ``DeterministicCallback(seed=SEED)``; ``--detctx-loader``: the loader
has ``detctx.loader_generator()`` and ``detctx.seed_worker``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from lightning_fit import SEED, framework, trainer
from torch.utils.data import DataLoader, Dataset

import detctx


class WorkerSeeds(Dataset[tuple[int, str, torch.Tensor]]):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> tuple[int, str, torch.Tensor]:
        info = torch.utils.data.get_worker_info()
        assert info is not None
        return info.id, str(torch.initial_seed()), torch.randn(4)


class Model(framework().LightningModule):  # type: ignore[misc]
    def __init__(self, out_dir: str, detctx_loader: bool) -> None:
        super().__init__()
        self.out_dir, self.detctx_loader = out_dir, detctx_loader
        self.net = torch.nn.Linear(4, 1)
        self.seeds: dict[int, str] = {}

    def train_dataloader(self) -> DataLoader[Any]:
        if self.detctx_loader:
            return DataLoader(
                WorkerSeeds(),
                batch_size=2,
                num_workers=2,
                generator=detctx.loader_generator(),
                worker_init_fn=detctx.seed_worker,
            )
        return DataLoader(WorkerSeeds(), batch_size=2, num_workers=2)

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        workers, seeds, x = batch
        for worker, seed in zip(workers.tolist(), seeds):
            self.seeds.setdefault(worker, seed)
        return self.net(x).sum()  # type: ignore[no-any-return]

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_fit_end(self) -> None:
        (Path(self.out_dir) / f"seeds-{self.global_rank}.json").write_text(json.dumps(self.seeds))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--detctx-loader", action="store_true")
    args = parser.parse_args()

    from detctx.integrations.lightning import DeterministicCallback

    model = Model(args.out_dir, args.detctx_loader)
    options: dict[str, Any] = {"strategy": args.strategy, "devices": args.devices, "max_epochs": 1}
    if args.reference:
        framework().seed_everything(SEED, workers=True)
    else:
        options["callbacks"] = [DeterministicCallback(seed=SEED)]
    trainer(**options).fit(model)


if __name__ == "__main__":
    main()
