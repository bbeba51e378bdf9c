"""Chapter 04's data sets and collate functions, in a module (not the notebook) so that spawn workers import them."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate, get_worker_info

from ...core.validate import check_choice, check_float, check_int


def passthrough_collate(batch: Any) -> Any:  # for data sets that batch in ``__getitems__``
    return batch


def light_uint8_collate(items: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, list[int]]:
    """uint8 images as one shared-memory tensor, labels as a plain list: each tensor crosses from a worker with
    its own shared-memory handle to open and map, a tiny pickled list needs none."""
    return default_collate([x for x, _ in items]), [int(y) for _, y in items]


class CheapDataset(Dataset):
    """Items that cost almost nothing (views into a bank of ``bank`` random images): the DataLoader's per-batch
    overhead in the main process is what limits throughput."""

    def __init__(self, n: int, image_size: int = 64, output: str = "float", bank: int = 64, seed: int = 0) -> None:
        self.n = check_int("n", n, 1, 10_000_000)
        self.image_size = check_int("image_size", image_size, 1, 1024)
        self.output = check_choice("output", output, ("float", "uint8"))
        bank = check_int("bank", bank, 1, 4096)
        g = torch.Generator().manual_seed(check_int("seed", seed, 0, 2**63 - 1))
        data = torch.randint(0, 256, (bank, 3, self.image_size, self.image_size), dtype=torch.uint8, generator=g)
        self.bank = data if output == "uint8" else data.float().div_(255.0)
        self.labels = torch.arange(bank) % 10

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not -self.n <= index < self.n:
            raise IndexError(f"index {index} out of range for {self.n} items")
        k = index % len(self.bank)
        return self.bank[k], int(self.labels[k])


class SpinDataset(Dataset):
    """``base`` plus ``extra_ms`` of busy CPU per item: it competes for cores like augmentation (a sleep would not)."""

    def __init__(self, base: Dataset, extra_ms: float) -> None:
        self.base = base
        self.extra_ms = check_float("extra_ms", extra_ms, 0.0, 1000.0)

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        end = time.thread_time() + self.extra_ms / 1e3
        while time.thread_time() < end:
            pass
        return self.base[index]


class BatchedCheapDataset(CheapDataset):
    """:class:`CheapDataset` with ``__getitems__``: one gather per batch, a finished batch."""

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long) % len(self.bank)
        if get_worker_info() is None:
            return self.bank.index_select(0, idx), self.labels.index_select(0, idx)
        out = self.bank.new_empty((len(indices), *self.bank.shape[1:])).share_memory_()  # as default_collate does
        torch.index_select(self.bank, 0, idx, out=out)
        return out, self.labels.index_select(0, idx)


class PerItem(Dataset):
    """A view of a data set that hides its ``__getitems__``."""

    def __init__(self, base: Dataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.base[index]


class UnevenDataset(Dataset):
    """Most items take ``fast_ms``, every ``slow_every``-th ``slow_ms``: a sleep (a slow network read), so
    ``in_order``'s effect shows even on two cores."""

    def __init__(self, n: int, fast_ms: float = 1.0, slow_ms: float = 60.0, slow_every: int = 23) -> None:
        self.n = check_int("n", n, 1, 10_000_000)
        self.fast_ms = check_float("fast_ms", fast_ms, 0.0, 10_000.0)
        self.slow_ms = check_float("slow_ms", slow_ms, 0.0, 10_000.0)
        self.slow_every = check_int("slow_every", slow_every, 1, 10_000_000)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        time.sleep((self.slow_ms if index % self.slow_every == 0 else self.fast_ms) / 1e3)
        return torch.full((16,), index % 256, dtype=torch.uint8), index


class FailingDataset(Dataset):
    """Raises ``ValueError`` for one item, to show how a worker's exception reaches the main process."""

    def __init__(self, n: int = 32, bad_index: int = 13) -> None:
        self.n = check_int("n", n, 1, 10_000_000)
        self.bad_index = check_int("bad_index", bad_index, 0, self.n - 1)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if index == self.bad_index:
            raise ValueError(f"item {index} is damaged (a deliberate failure in FailingDataset.__getitem__)")
        return torch.zeros(4), index


class BadRNGDataset(Dataset):
    """THE BUG: a random generator created in ``__init__``. Every worker gets a copy, state included, so all
    workers draw the same "random" augmentation. Items are ``(index, worker_id, draw)``."""

    def __init__(self, n: int = 64, seed: int = 0) -> None:
        self.n = check_int("n", n, 1, 10_000_000)
        self.rng = np.random.default_rng(seed)  # <- copied into every worker

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[int, int, float]:
        info = get_worker_info()
        return index, (info.id if info else -1), float(self.rng.random())


class FixedRNGDataset(Dataset):
    """THE FIX: the generator is made lazily in each process from ``get_worker_info().seed`` (per worker and
    epoch; ``seed`` in the main process)."""

    def __init__(self, n: int = 64, seed: int = 0) -> None:
        self.n = check_int("n", n, 1, 10_000_000)
        self.seed = check_int("seed", seed, 0, 2**63 - 1)
        self._rng: np.random.Generator | None = None
        self._rng_key: int | None = None

    def __len__(self) -> int:
        return self.n

    def _generator(self) -> np.random.Generator:
        info = get_worker_info()
        key = info.seed if info else self.seed  # per worker and epoch
        if self._rng is None or self._rng_key != key:
            self._rng, self._rng_key = np.random.default_rng(key), key
        return self._rng

    def __getitem__(self, index: int) -> tuple[int, int, float]:
        info = get_worker_info()
        return index, (info.id if info else -1), float(self._generator().random())
