"""The built-in images task: its ResNets, decoding, augmentation and the node folder it reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from fedgpu.core.synth_images import synth_images
from fedgpu.node.data import DataDirError
from fedgpu.node.tasks import DatasetTask, HyperparameterError, load_task
from fedgpu.node.tasks.images import ImagesTask, augment, decode

SMALL = {"depth": 8, "width": 4, "image_size": 16}


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_images_is_installed_as_a_dataset_task() -> None:
    task = load_task("images")
    assert isinstance(task, ImagesTask) and isinstance(task, DatasetTask)


@pytest.mark.parametrize(("hp", "params"), [
    ({}, 11_173_962),  # ResNet-18 for CIFAR-10, as published
    ({"depth": 20}, 272_474),  # ResNet-20 with projection shortcuts
    ({"depth": 8, "width": 8, "num_classes": 4}, 19_756),
])
def test_the_resnets_have_their_published_sizes(hp: dict[str, int], params: int) -> None:
    with torch.device("meta"):
        model = ImagesTask().build_model(hp)
    assert _params(model) == params
    # Normalisation constants stay out of the weights on the wire.
    state = model.state_dict()
    assert {"mean", "std"}.isdisjoint(state) and "bn1.running_mean" in state


def test_uint8_and_float_inputs_give_the_same_logits_in_either_layout() -> None:
    torch.manual_seed(0)
    model = ImagesTask().build_model(SMALL).eval()
    x8 = torch.randint(0, 256, (3, 3, 16, 16), dtype=torch.uint8)
    with torch.no_grad():
        a = model(x8)
        b = model(x8.float() / 255)
        c = model.to(memory_format=torch.channels_last)(
            x8.contiguous(memory_format=torch.channels_last))
    assert a.shape == (3, 10)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("given", "needle"), [
    ({"depth": 19}, "depth must be 18, 34 or 6n+2"),
    ({"width": -1}, "width must be >= 0"),
    ({"lr": 0}, "lr must be > 0"),
    ({"image_size": 4096}, "image_size must be <= 1024"),
    ({"crop_padding": 32}, "crop_padding must be smaller than image_size"),
    ({"augment": 1}, "augment must be true or false"),
    ({"batch_size": 8}, "no hyperparameter(s) batch_size"),  # the runner's, not the task's
])
def test_bad_hyperparameters_are_refused(given: dict[str, object], needle: str) -> None:
    with pytest.raises(HyperparameterError) as info:
        ImagesTask().build_model(given)
    assert needle in str(info.value)


def test_decode_resizes_and_converts_to_rgb(tmp_path: Path) -> None:
    Image.new("L", (40, 20), 200).save(tmp_path / "grey.jpg")
    img = decode(tmp_path / "grey.jpg", 16)
    assert img.shape == (3, 16, 16) and img.dtype == torch.uint8
    assert abs(int(img.float().mean()) - 200) <= 2
    # A huge source is refused from its header, before gigabytes are decoded.
    Image.new("L", (7000, 6000)).save(tmp_path / "huge.png")
    with pytest.raises(DataDirError, match="huge.png is 7000x6000 pixels, more than 40,000,000"):
        decode(tmp_path / "huge.png", 16)
    (tmp_path / "bad.png").write_bytes(b"garbage")
    with pytest.raises(DataDirError, match="cannot decode image .*bad.png"):
        decode(tmp_path / "bad.png", 16)


def test_augmentation_crops_a_shifted_window_and_may_mirror() -> None:
    img = (torch.arange(3 * 8 * 8) % 250 + 1).view(3, 8, 8).to(torch.uint8)  # no zero pixel
    padded = torch.nn.functional.pad(img, (2, 2, 2, 2))
    windows = {(dy, dx, flip): padded[:, dy:dy + 8, dx:dx + 8].flip(-1) if flip
               else padded[:, dy:dy + 8, dx:dx + 8]
               for dy in range(5) for dx in range(5) for flip in (False, True)}
    torch.manual_seed(0)
    drawn = []
    for _ in range(60):
        out = augment(img, 2)
        assert out.shape == img.shape and out.dtype == torch.uint8 and out.is_contiguous()
        match = [key for key, w in windows.items() if torch.equal(out, w)]
        assert len(match) == 1
        drawn.append(match[0])
    assert len({(dy, dx) for dy, dx, _ in drawn}) > 5  # the window moves
    assert {flip for _, _, flip in drawn} == {False, True}  # and is mirrored about half the time
    # Without padding only the flip is left.
    assert all(torch.equal(o, img) or torch.equal(o, img.flip(-1))
               for o in (augment(img, 0) for _ in range(10)))


def test_load_datasets_reads_the_node_folder(tmp_path: Path) -> None:
    node = synth_images(tmp_path / "d", 1, classes=3, per_class=5, size=16)[0]
    sets = ImagesTask().load_datasets(node, SMALL)
    assert len(sets.train) == 12 and len(sets.test) == 3
    x, y = sets.test[0]
    assert x.shape == (3, 16, 16) and x.dtype == torch.uint8 and y == 0
    # The held-out set is never augmented: reading it twice gives the same pixels.
    assert torch.equal(sets.test[2][0], sets.test[2][0])


def test_load_datasets_errors_name_the_fix(tmp_path: Path) -> None:
    node = synth_images(tmp_path / "d", 1, classes=3, per_class=5, size=16)[0]
    with pytest.raises(HyperparameterError, match="has 3 classes but num_classes is 2"):
        ImagesTask().load_datasets(node, {**SMALL, "num_classes": 2})
    for png in (node / "test").rglob("*.png"):
        png.unlink()
    with pytest.raises(DataDirError, match="test holds no images"):
        ImagesTask().load_datasets(node, SMALL)
    with pytest.raises(DataDirError, match="has no class folders under train/ or test/"):
        ImagesTask().load_datasets(tmp_path, SMALL)
