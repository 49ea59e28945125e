"""Built-in task `images`: a ResNet on a per-node image folder, streamed from disk.

The node's data directory has the layout of fedgpu/core/imagefolders.py (train/ and test/, one
folder per class, PNG or JPEG); `fedgpu data synth-images` and `fedgpu data split-folder` make
one. This is a Dataset task (node/tasks/base.py): files are decoded by Pillow in the
DataLoader's worker processes, augmented there in uint8 with torch ops (random crop with
zero padding, horizontal flip), and the runner drives the loop; the model normalises on the
device.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from fedgpu.core.fedstats.columns import ColumnSpec
from fedgpu.core.imagefolders import (
    TEST_DIR,
    TRAIN_DIR,
    ImageFolderError,
    list_images,
    node_classes,
)
from fedgpu.node.data import DataDirError
from fedgpu.node.tasks.base import Datasets, HyperparameterError, resolve_hparams
from fedgpu.node.tasks.resnet import ResNet, default_width, supported_depth

DEFAULTS: dict[str, int | float | bool | str] = {
    "lr": 0.05,
    "momentum": 0.9,
    "weight_decay": 5e-4,
    "depth": 18,  # 18 or 34 (ResNet-18/34), or 6n+2 (ResNet-20 is 20)
    "width": 0,  # 0: the architecture's own (64 for ResNet-18/34, 16 for 6n+2)
    "num_classes": 10,
    "image_size": 32,  # images of another size are resized (bilinear) when decoded
    "augment": True,
    "crop_padding": 4,
}
MAX_IMAGE_SIZE = 1024
# mode = "statistics" decodes every image it describes: a bound on a site's time.
MAX_STATS_IMAGES = 100_000
MAX_CLASSES = 100_000
# A source image larger than this (e.g. a 10k x 10k scan) is refused before it is decoded:
# one would hold gigabytes in a DataLoader worker to be shrunk to image_size.
MAX_SOURCE_PIXELS = 40_000_000


def decode(path: Path, size: int) -> torch.Tensor:
    """One image file as uint8 [3, size, size]."""
    from PIL import Image, UnidentifiedImageError

    try:
        # Pillow refuses decompression bombs (far more pixels than the file suggests).
        with Image.open(path) as img:
            if img.width * img.height > MAX_SOURCE_PIXELS:
                raise DataDirError(f"image {path} is {img.width}x{img.height} pixels, more than "
                                   f"{MAX_SOURCE_PIXELS:,}: resize the data set first")
            rgb = img.convert("RGB")
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as exc:
        raise DataDirError(f"cannot decode image {path}: {exc}") from None
    if rgb.size != (size, size):
        rgb = rgb.resize((size, size), Image.Resampling.BILINEAR)
    # One copy out of Pillow into writable memory torch can own; HWC -> CHW is a view.
    return torch.from_numpy(np.array(rgb, dtype=np.uint8)).permute(2, 0, 1)


def augment(img: torch.Tensor, padding: int) -> torch.Tensor:
    """Random crop of the zero-padded image back to its size, then a coin-flip mirror.

    Uses torch's global generator: the DataLoader seeds it per worker from the round's seed.
    """
    _, h, w = img.shape
    if padding > 0:
        padded = F.pad(img, (padding, padding, padding, padding))
        dy, dx = torch.randint(0, 2 * padding + 1, (2,)).tolist()
        img = padded[:, dy : dy + h, dx : dx + w]
    if bool(torch.rand(()) < 0.5):
        img = img.flip(-1)
    return img.contiguous()


class ImageFolderDataset(Dataset[tuple[torch.Tensor, int]]):
    def __init__(self, items: list[tuple[Path, int]], size: int, augment: bool,
                 padding: int) -> None:
        self.items = items
        self.size = size
        self.augment = augment
        self.padding = padding

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path, label = self.items[i]
        img = decode(path, self.size)
        return (augment(img, self.padding) if self.augment else img.contiguous()), label


class ImagesTask:
    name = "images"

    def hparams(self, given: Mapping[str, Any]) -> dict[str, Any]:
        hp = resolve_hparams(self.name, given, DEFAULTS)
        for key in ("lr", "num_classes", "image_size"):
            if hp[key] <= 0:
                _refuse(key, hp[key], "> 0")
        for key in ("momentum", "weight_decay", "width", "crop_padding"):
            if hp[key] < 0:
                _refuse(key, hp[key], ">= 0")
        if not supported_depth(hp["depth"]):
            _refuse("depth", hp["depth"], "18, 34 or 6n+2 (8, 14, 20, 32, 44, 56, 110)")
        if hp["image_size"] > MAX_IMAGE_SIZE:
            _refuse("image_size", hp["image_size"], f"<= {MAX_IMAGE_SIZE}")
        if hp["num_classes"] > MAX_CLASSES:
            _refuse("num_classes", hp["num_classes"], f"<= {MAX_CLASSES}")
        if hp["crop_padding"] >= hp["image_size"]:
            _refuse("crop_padding", hp["crop_padding"], "smaller than image_size")
        return hp

    def build_model(self, hparams: Mapping[str, Any]) -> nn.Module:
        hp = self.hparams(hparams)
        width = hp["width"] or default_width(hp["depth"])
        return ResNet(hp["depth"], width, hp["num_classes"])

    def load_datasets(self, data_dir: Path, hparams: Mapping[str, Any]) -> Datasets:
        hp = self.hparams(hparams)
        try:
            classes = node_classes(data_dir)
            train = list_images(Path(data_dir) / TRAIN_DIR, classes)
            test = list_images(Path(data_dir) / TEST_DIR, classes)
        except ImageFolderError as exc:
            raise DataDirError(str(exc)) from None
        if len(classes) > hp["num_classes"]:
            raise HyperparameterError(
                f"task 'images': {data_dir} has {len(classes)} classes but num_classes is "
                f"{hp['num_classes']}; set num_classes = {len(classes)} in the job's "
                f"hyperparameters (the same on every node)"
            )
        for split, items in ((TRAIN_DIR, train), (TEST_DIR, test)):
            if not items:
                raise DataDirError(
                    f"{Path(data_dir) / split} holds no images (.png, .jpg, .jpeg) in its class "
                    f"folders; every node needs training and held-out images"
                )
        size = hp["image_size"]
        return Datasets(
            train=ImageFolderDataset(train, size, hp["augment"], hp["crop_padding"]),
            test=ImageFolderDataset(test, size, augment=False, padding=0),
        )

    def statistics(self, data_dir: Path, hparams: Mapping[str, Any]
                   ) -> list[tuple[ColumnSpec, np.ndarray]]:
        """mode = "statistics": per training image, its mean red, green and blue (0-255, at
        image_size), and its label (0 to num_classes - 1); at most MAX_STATS_IMAGES images,
        the first in file order."""
        hp = self.hparams(hparams)
        items = self.load_datasets(data_dir, hparams).train.items[:MAX_STATS_IMAGES]  # type: ignore[attr-defined]
        means = np.zeros((len(items), 3))
        for i, (path, _) in enumerate(items):
            means[i] = decode(path, hp["image_size"]).double().mean(dim=(1, 2)).numpy()
        labels = np.array([label for _, label in items], dtype=np.float64)
        colours = [(ColumnSpec(name, 0.0, 255.0, 32), means[:, c])
                   for c, name in enumerate(("red", "green", "blue"))]
        n = hp["num_classes"]
        return [*colours, (ColumnSpec("label", -0.5, n - 0.5, min(n, 1000)), labels)]

    def optimizer(self, model: nn.Module, hparams: Mapping[str, Any]) -> torch.optim.Optimizer:
        hp = self.hparams(hparams)
        return torch.optim.SGD(model.parameters(), lr=hp["lr"], momentum=hp["momentum"],
                               weight_decay=hp["weight_decay"])

    def batch_loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits, y), (logits.argmax(1) == y).sum()


def _refuse(key: str, value: object, expected: str) -> None:
    raise HyperparameterError(
        f"task 'images': hyperparameter {key} must be {expected}, got {value}"
    )
