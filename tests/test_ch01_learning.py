"""Chapter 01's training job, run from the chapter's own cells at quick size, learns clearly above chance.

Issue #24: every training job of the workbook must learn, and a test must fail when it does not. Chapter 01
trains on the whole training set (its shuffled loader) and scores the whole validation set, so no subset can
drop classes; this test runs the notebook's ``make_loader``, ``batches`` and ``train_step`` cells with its loop
and sizes, and checks the accuracy the chapter prints beside the chance level.

The margin: 2x chance (1/6 -> 33.3%). Measured on 2026-11-24 (CPU, one thread, quick data set, seeds 0-4 for the
model, the shuffling and the augmentation): final validation accuracy 64.5%, 62.9%, 59.0%, 57.4% and 67.2%
(3.4x-4.0x chance; after epoch 2 already 38.7%-56.3%). The worst seed is 24 points above the margin, so a
pass is no accident and a failure means the job stopped learning (e.g. a class-sorted prefix of the data).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from helpers.chapters.ch01 import training
from helpers.pipeline import data, models, train
from helpers.ui import codecells

#: Chapter 01's quick data set (``data.default_sizes()`` in quick mode) and its setup cell's settings.
QUICK_DATA = dict(n_train=640, n_val=256, image_size=80, num_classes=6, seed=0)
CROP, BATCH_SIZE, WIDTH, EPOCHS = 64, 32, 16, 4
MARGIN = 2.0


def _chapter_cells(seed: int) -> dict[str, Any]:
    ns: dict[str, Any] = {"torch": torch, "F": F, "DataLoader": DataLoader, "DEVICE": torch.device("cpu"), "SEED": seed}
    for cell in codecells.pipeline_cells("01"):
        exec(compile(cell, "<chapter 01 pipeline cell>", "exec"), ns)  # noqa: S102 - our own notebook
    return ns


def test_chapter_01_trains_and_scores_on_every_class(tmp_path) -> None:
    """The loader the chapter trains with draws from every class in its first epoch (no class-sorted prefix)."""
    info = data.make_shapes_dataset(root=tmp_path, n_train=48, n_val=24, image_size=32, num_classes=4, seed=5)
    ns = _chapter_cells(seed=0)
    ds = data.ShapesDataset(info.train_dir, crop_size=24)
    assert ds.targets == sorted(ds.targets)  # the folder is class-sorted: a prefix would hold the first classes
    first = next(iter(ns["make_loader"](ds, 8)))[1]
    assert len(set(first.tolist())) > 1  # shuffled: the very first batch mixes classes


@pytest.mark.slow
def test_chapter_01_job_learns_clearly_above_chance(tmp_path) -> None:
    info = data.make_shapes_dataset(root=tmp_path, **QUICK_DATA)
    seed = 0
    ns = _chapter_cells(seed)
    train_ds = data.ShapesDataset(info.train_dir, crop_size=CROP, augment=True)
    val_ds = data.ShapesDataset(info.val_dir, crop_size=CROP, augment=False)
    train_loader = ns["make_loader"](train_ds, BATCH_SIZE)
    val_loader = DataLoader(val_ds, batch_size=2 * BATCH_SIZE)  # every validation image, in order
    model = models.build_model(width=WIDTH, num_classes=len(train_ds.classes), seed=seed)
    optimizer = train.make_optimizer(model)
    chance = 1 / len(train_ds.classes)
    torch.manual_seed(seed)
    accuracies = []
    for _ in range(EPOCHS):
        model.train()
        for x, y in ns["batches"](train_loader):
            ns["train_step"](model, optimizer, x, y)
        accuracies.append(training.evaluate(model, val_loader, "cpu"))
    assert set(val_ds.targets) == set(range(6)) and len(val_ds) == QUICK_DATA["n_val"]
    assert accuracies[-1] >= MARGIN * chance, (accuracies, chance)
