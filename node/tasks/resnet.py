"""ResNets for small images (32x32 and up), defined here so the node needs no torchvision.

Two families, chosen by depth:
- 18 and 34: ResNet-18/34 (He et al. 2016) as usually adapted to CIFAR: a 3x3 stem without the
  max-pool, four stages of basic blocks at width w, 2w, 4w, 8w (w = 64: 11.2M parameters).
- 6n+2 (8, 14, 20, 32, 44, 56, 110): the CIFAR ResNets of the same paper, three stages at
  w, 2w, 4w (w = 16; ResNet-20 is the D-PSGD reference model, 0.27M parameters).
The input is uint8 or float images in [0, 255] / [0, 1]; the model normalises them itself, so
augmentation can stay in uint8 on the CPU and the host-to-device copy moves a quarter of the
bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Per-channel mean and std of CIFAR-10's training images: the usual normalisation for 32x32
# natural images; synthetic data only needs inputs of roughly unit scale.
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
_STAGES = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3)}


def supported_depth(depth: int) -> bool:
    return depth in _STAGES or (depth >= 8 and (depth - 2) % 6 == 0)


def default_width(depth: int) -> int:
    return 64 if depth in _STAGES else 16


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            # A 1x1 projection (the paper's option B) where the shape changes.
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                          nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, depth: int, width: int, num_classes: int, in_channels: int = 3) -> None:
        super().__init__()
        if not supported_depth(depth):
            raise ValueError(f"depth must be 18, 34 or 6n+2 (8, 14, 20, ...), got {depth}")
        blocks = _STAGES.get(depth) or (((depth - 2) // 6,) * 3)
        # Not persistent: constants of the task, never sent over the wire.
        self.register_buffer("mean", torch.tensor(MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(STD).view(1, 3, 1, 1), persistent=False)
        self.conv1 = nn.Conv2d(in_channels, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        stages: list[nn.Module] = []
        c_in = width
        for i, n in enumerate(blocks):
            c_out = width * 2**i
            layers = [BasicBlock(c_in if j == 0 else c_out, c_out, 2 if i > 0 and j == 0 else 1)
                      for j in range(n)]
            stages.append(nn.Sequential(*layers))
            c_in = c_out
        self.layers = nn.Sequential(*stages)
        self.fc = nn.Linear(c_in, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.uint8:
            x = x.float().div_(255)
        x = (x - self.mean) / self.std
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layers(out)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))
