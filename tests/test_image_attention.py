"""Seeing inside a ViT: [CLS]'s attention laid out as the patch grid, attention rollout against its
closed form, and the pictures written from the model's own attention maps."""

import json

import pytest
import torch

from aiayn import ImageClassifier, TransformerConfig, VisionTransformer
from aiayn.visualise.image_attention import (attention_rollout, cls_attention, image_attention,
                                             write_image_attention_report)

CONFIG = TransformerConfig.preset("vit-digits", d_model=24, n_heads=3, d_ff=32, n_encoder_layers=2,
                                  image_size=12, patch_size=4, num_channels=3, num_labels=4,
                                  dropout=0.0)


def test_cls_attention_is_row_0_without_cls_in_row_major_patches():
    tokens = 10  # [CLS] + 3 x 3 patches
    weights = torch.rand(2, 3, tokens, tokens)  # (L, H, T, T)
    grid = cls_attention(weights)
    assert grid.shape == (2, 3, 3, 3)
    assert grid[1, 2, 0, 2] == weights[1, 2, 0, 3]  # patch (row 0, column 2) is token 3
    assert grid[0, 1, 2, 0] == weights[0, 1, 0, 7]  # patch (row 2, column 0) is token 7
    with pytest.raises(ValueError, match="do not form a square grid"):
        cls_attention(torch.rand(1, 1, 9, 9))


def test_rollout_against_its_closed_form():
    """One layer: 0.5 A + 0.5 I, so [CLS]'s row over the patches is half the head-mean of A's.
    Uniform attention U (U U = U) over two layers: (0.5 U + 0.5 I)^2 = 0.75 U + 0.25 I."""
    tokens = 5
    weights = torch.softmax(torch.randn(1, 4, tokens, tokens), -1)
    expected = 0.5 * weights[0].mean(0)[0, 1:].reshape(2, 2)
    torch.testing.assert_close(attention_rollout(weights)[0], expected)
    uniform = torch.full((2, 3, tokens, tokens), 1 / tokens)
    rollout = attention_rollout(uniform)
    torch.testing.assert_close(rollout[0], torch.full((2, 2), 0.5 / tokens))
    torch.testing.assert_close(rollout[1], torch.full((2, 2), 0.75 / tokens))


def test_the_maps_come_from_the_models_attention():
    model = ImageClassifier(CONFIG).eval()
    image = torch.rand(3, 12, 12)
    attention = image_attention(model, image)
    with torch.no_grad():
        logits, maps = model(image.unsqueeze(0), return_attention=True)
    weights = torch.stack([w[0] for w in maps.encoder])  # (L, H, T, T)
    torch.testing.assert_close(attention.cls, cls_attention(weights))
    torch.testing.assert_close(attention.probabilities, logits[0].softmax(-1))
    bare = image_attention(VisionTransformer(CONFIG).eval(), image)
    assert bare.probabilities is None and bare.rollout.shape == (2, 3, 3)


def test_the_report_files(tmp_path):
    pytest.importorskip("matplotlib")
    model = ImageClassifier(CONFIG).eval()
    image = torch.rand(3, 12, 12)
    attention = image_attention(model, image)
    written = write_image_attention_report(attention, image, tmp_path, labels=("a", "b", "c", "d"),
                                           layer=0, head=1, dpi=40)
    assert set(written) == {"cls_attention", "cls_L0_H1", "rollout", "attention.json"}
    for path in written.values():
        assert path.is_file() and path.stat().st_size > 0
    report = json.loads(written["attention.json"].read_text())
    assert list(report["probabilities"]) == ["a", "b", "c", "d"]
    torch.testing.assert_close(torch.tensor(report["rollout"]), attention.rollout)
    with pytest.raises(ValueError, match=r"--layer 2: the model has layers 0\.\.1"):
        write_image_attention_report(attention, image, tmp_path, layer=2)


@pytest.mark.parametrize("cells, printed", [(3, True), (14, True), (20, True), (24, False),
                                            (28, False)])
def test_the_patch_map_writes_weights_while_legible(cells, printed):
    """ViT-B/16 at 224 pixels has 14 x 14 patches, DINO ViT-S/8 28 x 28."""
    pytest.importorskip("matplotlib")
    from aiayn.visualise.heatmaps import pyplot
    from aiayn.visualise.image_attention import patch_map_figure

    torch.manual_seed(cells)
    grid = torch.randn(cells * cells).mul(3).softmax(-1).reshape(cells, cells)  # (G, G)
    grid[0, 0] = 0.004  # prints as 0.00: left blank
    image = torch.rand(3, 224, 224)
    figure = patch_map_figure(image, grid, title="t")
    axis = figure.axes[0]
    texts = sorted(text.get_text() for text in axis.texts)
    if printed:
        assert texts == sorted(f"{w:.2f}" for w in grid.flatten().tolist() if w >= 0.005)
        assert texts and min(text.get_fontsize() for text in axis.texts) >= 5.0
        patch = 224 / cells
        first = next(text for text in axis.texts if text.get_text() == f"{grid.max():.2f}")
        row, column = divmod(int(grid.argmax()), cells)
        assert first.get_position() == pytest.approx(((column + 0.5) * patch - 0.5,
                                                      (row + 0.5) * patch - 0.5))
    else:
        assert len(axis.texts) == 0
        assert f"weights not printed ({cells} x {cells} patches)" in axis.get_title()
    pyplot().close(figure)
