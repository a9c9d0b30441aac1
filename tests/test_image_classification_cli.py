"""End to end: ``aiayn train image-classification`` on the digits and on a folder of images,
``aiayn evaluate`` on the runs, ``aiayn attention --test-image / --image`` over them."""

import json

import pytest
import torch

from aiayn.cli import main

pytest.importorskip("sklearn")
Image = pytest.importorskip("PIL.Image")

FAST = ["--threads", "1", "--no-progress", "--eval-every", "30", "--save-every", "30",
        "--log-every", "10", "--warmup", "10"]


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "digits"
    assert main(["train", "image-classification", "--out", str(out), "--steps", "60",
                 *FAST]) == 0
    return out


def test_train_writes_an_image_classification_run(digits_run):
    info = json.loads((digits_run / "run.json").read_text())
    assert info["task"] == "image-classification"
    assert info["model_class"] == "aiayn.models.vision:ImageClassifier"
    config = info["model_config"]
    assert (config["image_size"], config["patch_size"], config["num_channels"]) == (8, 2, 1)
    assert config["num_labels"] == 10 and config["norm_first"] and config["activation"] == "gelu"
    assets = info["assets"]
    assert assets["data"] == "sklearn:digits" and assets["images"] == {
        "train": 1259, "valid": 179, "test": 359}
    assert assets["split"] == {"valid_fraction": 0.1, "test_fraction": 0.2, "seed": 0}
    assert len(assets["mean"]) == len(assets["std"]) == 1
    assert json.loads((digits_run / "labels.json").read_text()) == {
        "labels": [str(d) for d in range(10)]}
    log = (digits_run / "log.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in log if '"valid"' in line]
    assert steps == [30, 60]


def test_evaluate_scores_the_held_out_test_images(digits_run, tmp_path, capsys):
    assert main(["evaluate", str(digits_run), "--data", "sklearn:digits"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert result["images"] == 359 and result["split"] == "test"
    assert result["accuracy"] > 0.5  # 60 steps; chance is 0.1 (the slow test trains in full)
    assert "true\\pred" in captured.err
    saved = json.loads((digits_run / "evaluation" / "sklearn-digits.test.json").read_text())
    assert sum(map(sum, saved["confusion"])) == 359
    output = tmp_path / "predicted.tsv"
    assert main(["evaluate", str(digits_run), "--data", "sklearn:digits", "--split", "all",
                 "--limit", "7", "--output", str(output)]) == 0
    lines = [line.split("\t") for line in output.read_text().splitlines()]
    assert [line[0] for line in lines] == [f"sklearn:digits[{i}]" for i in range(7)]
    assert all(line[1] in "0123456789" and 0 < float(line[2]) <= 1 for line in lines)


def test_attention_on_a_test_image(digits_run, tmp_path, capsys):
    out = tmp_path / "attention"
    assert main(["attention", str(digits_run), "--test-image", "4", "--out", str(out),
                 "--layer", "1", "--head", "2"]) == 0
    assert {p.name for p in out.iterdir()} == {"cls_attention.png", "cls_L1_H2.png",
                                               "rollout.png", "attention.json"}
    report = json.loads((out / "attention.json").read_text())
    assert torch.tensor(report["cls_attention"]).shape == (4, 4, 4, 4)  # (L, H, G, G)
    assert torch.tensor(report["rollout"]).shape == (4, 4, 4)
    assert sum(report["probabilities"].values()) == pytest.approx(1.0, abs=1e-5)
    assert "predicted" in capsys.readouterr().out
    for args, message in ((["--test-image", "359"], r"test split has images 0\.\.358"),
                          (["--test-image", "0", "--target", "x"], r"--target is for texts"),
                          (["--test-image", "0", "--kind", "cross"], r"encoder attention only"),
                          (["--test-image", "0", "--head", "4"], r"heads 0\.\.3"),
                          (["--text", "1 2 3"], r"reads images, not token ids: use aiayn "
                                                r"attention RUN_DIR --image FILE")):
        assert main(["attention", str(digits_run), *args, "--out", str(out)]) == 1
        assert message.replace("\\", "") in capsys.readouterr().err


def _bars(root, n: int = 12):
    """Two classes of 10x10 RGB images: a horizontal or a vertical bar at a random place."""
    generator = torch.Generator().manual_seed(0)
    for label in ("horizontal", "vertical"):
        (root / label).mkdir(parents=True)
        for i in range(n):
            pixels = torch.zeros(10, 10, 3, dtype=torch.uint8)
            where = int(torch.randint(0, 10, (1,), generator=generator))
            if label == "horizontal":
                pixels[where, :, :] = 255
            else:
                pixels[:, where, :] = 255
            Image.fromarray(pixels.numpy()).save(root / label / f"{i}.png")
    return root


def test_a_folder_of_images_trains_evaluates_and_shows_attention(tmp_path, capsys):
    data = _bars(tmp_path / "bars")
    out = tmp_path / "run"
    assert main(["train", "image-classification", "--data", str(data), "--out", str(out),
                 "--steps", "30", "--set", "image_size=10", "--set", "patch_size=5",
                 "--set", "num_channels=3", "--valid-fraction", "0.2", *FAST]) == 0
    info = json.loads((out / "run.json").read_text())
    assert info["assets"]["images"] == {"train": 16, "valid": 4, "test": 4}  # 2 + 2 a class
    assert len(info["assets"]["mean"]) == 3
    capsys.readouterr()
    assert main(["evaluate", str(out), "--data", str(data), "--split", "all"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["images"] == 24
    pictures = tmp_path / "pictures"
    assert main(["attention", str(out), "--image", str(data / "vertical" / "3.png"),
                 "--out", str(pictures)]) == 0
    report = json.loads((pictures / "attention.json").read_text())
    assert set(report["probabilities"]) == {"horizontal", "vertical"}
    assert torch.tensor(report["rollout"]).shape == (4, 2, 2)


def test_bad_data_is_refused_with_the_path(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert main(["train", "image-classification", "--data", str(tmp_path / "none"), "--out", out,
                 *FAST]) == 1
    assert "none: no such image folder" in capsys.readouterr().err
    assert main(["train", "image-classification", "--out", out, "--set", "patch_size=3",
                 *FAST]) == 1
    assert "patch_size (3) must divide image_size (8)" in capsys.readouterr().err
    assert main(["train", "image-classification", "--out", out, "--set", "image_size=16",
                 *FAST]) == 1
    assert "sklearn:digits are 8x8 grey images" in capsys.readouterr().err


@pytest.mark.slow
def test_the_default_recipe_learns_the_digits(tmp_path, capsys):
    """The README's command as it is (1,500 steps; 47 s of CPU time on one thread, measured)."""
    out = tmp_path / "vit"
    assert main(["train", "image-classification", "--out", str(out), "--threads", "1",
                 "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["evaluate", str(out), "--data", "sklearn:digits"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["accuracy"] >= 0.95  # 0.9805 with seed 0 on one thread (docs/vision.md)
