"""Image data: scikit-learn's digits and their fixed stratified split, a folder of class
sub-folders read with Pillow, the per-channel standardisation, and errors as ``path: message``."""

import pytest
import torch

from aiayn.data.images import (DIGITS, DIGITS_SPLIT, channel_statistics, load_digits, load_images,
                               normalise, read_image, read_image_folder, split_images)

Image = pytest.importorskip("PIL.Image")


def test_digits_are_sklearns_1797_grey_8x8_images():
    from sklearn.datasets import load_digits as sklearn_digits

    data = load_digits()
    raw = sklearn_digits()
    assert data.images.shape == (1797, 1, 8, 8) and data.images.dtype == torch.float32
    torch.testing.assert_close(data.images[:, 0] * 16, torch.tensor(raw.images).float())
    assert data.labels == tuple(str(t) for t in raw.target)
    assert sorted(set(data.labels)) == [str(d) for d in range(10)]
    assert data.sources[5] == "sklearn:digits[5]" and data.source == DIGITS


def test_the_digits_split_is_fixed_stratified_and_disjoint():
    data = load_digits()
    parts = split_images(data, **DIGITS_SPLIT)
    again = split_images(load_digits(), **DIGITS_SPLIT)
    assert {name: len(part) for name, part in parts.items()} == {
        "train": 1259, "valid": 179, "test": 359}
    sources = {name: set(part.sources) for name, part in parts.items()}
    assert sources == {name: set(part.sources) for name, part in again.items()}
    assert not (sources["train"] & sources["valid"]) and not (sources["train"] & sources["test"])
    assert not (sources["valid"] & sources["test"])
    assert len(sources["train"] | sources["valid"] | sources["test"]) == 1797
    for digit in map(str, range(10)):  # every class keeps its share in every part
        total = data.labels.count(digit)
        assert parts["test"].labels.count(digit) == int(total * 0.2 + 0.5)
        assert parts["valid"].labels.count(digit) == int(total * 0.1 + 0.5)
    index = data.sources.index(parts["test"].sources[0])
    assert torch.equal(parts["test"].images[0], data.images[index])


def _save(path, size, colour, mode="RGB"):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, colour).save(path)
    return path


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "shapes"
    _save(root / "dog" / "b.png", (8, 8), (255, 0, 0))
    _save(root / "dog" / "a.jpg", (16, 12), (0, 0, 255))  # resized to 8 x 8
    _save(root / "cat" / "c.bmp", (8, 8), 128, mode="L")
    (root / "cat" / "notes.txt").write_text("not an image")  # skipped: not an image by name
    (root / "cat" / ".hidden.png").write_bytes(b"")  # skipped: hidden
    (root / "README.md").write_text("files beside the class folders are skipped")
    return root


def test_images_in_a_class_folders_sub_folders_are_read(folder):
    """As torchvision's ImageFolder: a class folder's images in sub-folders too (sorted by their
    path below the class folder); hidden folders stay out."""
    _save(folder / "cat" / "2024" / "d.png", (8, 8), 0, mode="L")
    _save(folder / "cat" / ".cache" / "e.png", (8, 8), 0, mode="L")
    data = read_image_folder(folder, image_size=8, channels=3)
    assert data.labels == ("cat", "cat", "dog", "dog")
    assert [s.split("shapes/", 1)[1] for s in data.sources] == [
        "cat/2024/d.png", "cat/c.bmp", "dog/a.jpg", "dog/b.png"]


def test_a_folder_of_class_folders(folder):
    data = read_image_folder(folder, image_size=8, channels=3)
    assert data.labels == ("cat", "dog", "dog")  # classes, then files, in sorted order
    assert [s.rsplit("/", 1)[-1] for s in data.sources] == ["c.bmp", "a.jpg", "b.png"]
    assert data.images.shape == (3, 3, 8, 8)
    torch.testing.assert_close(data.images[0], torch.full((3, 8, 8), 128 / 255))
    torch.testing.assert_close(data.images[2, 0], torch.ones(8, 8))  # red: channel 0 only
    assert data.images[2, 1:].abs().max() == 0
    blue = data.images[1]
    assert blue[2].min() > 0.9 and blue[:2].max() < 0.1  # JPEG: close to blue, not exact
    grey = read_image_folder(folder, image_size=4, channels=1)
    assert grey.images.shape == (3, 1, 4, 4)
    torch.testing.assert_close(grey.images[2], torch.full((1, 4, 4), 76 / 255))  # ITU-R 601 red


@pytest.mark.parametrize("make, error, message", [
    (lambda root: root / "nowhere", FileNotFoundError, r"nowhere: no such image folder"),
    (lambda root: _save(root / "one.png", (8, 8), 0), NotADirectoryError,
     r"one\.png: not a folder \(expected one sub-folder of images per class\)"),
    (lambda root: (root / "flat").mkdir() or root / "flat", ValueError,
     r"flat: no class folders"),
    (lambda root: (root / "data" / "cat").mkdir(parents=True) or root / "data", ValueError,
     r"data/cat: no images \(looked for \.png"),
])
def test_folder_errors_name_the_path(tmp_path, make, error, message):
    with pytest.raises(error, match=message):
        read_image_folder(make(tmp_path), image_size=8, channels=3)


def test_an_unreadable_image_is_named(folder):
    (folder / "dog" / "broken.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(ValueError, match=r"dog/broken\.png: not an image Pillow can read"):
        read_image_folder(folder, image_size=8, channels=3)
    with pytest.raises(FileNotFoundError, match=r"missing\.png: no such image file"):
        read_image(folder / "missing.png", image_size=8, channels=1)
    with pytest.raises(ValueError, match=r"images with 5 channels are not supported"):
        read_image(folder / "dog" / "b.png", image_size=8, channels=5)


def test_the_digits_only_come_at_their_own_size():
    with pytest.raises(ValueError, match=r"sklearn:digits are 8x8 grey images; the model takes "
                                         r"16x16 with 1 channel"):
        load_images(DIGITS, image_size=16, channels=1)
    assert len(load_images(DIGITS, image_size=8, channels=1)) == 1797


def test_standardisation_per_channel():
    images = torch.rand(20, 3, 4, 4) * torch.tensor([1.0, 5.0, 0.0]).view(3, 1, 1) + 2
    mean, std = channel_statistics(images)
    assert std[2] == 1.0  # a constant channel is only shifted
    out = normalise(images, mean, std)
    torch.testing.assert_close(out.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-5, rtol=0)
    torch.testing.assert_close(out[:, :2].std(dim=(0, 2, 3)), torch.ones(2), atol=1e-5, rtol=0)
    torch.testing.assert_close(normalise(images[0], mean, std), out[0])  # (C, H, W) as well
