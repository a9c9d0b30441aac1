"""The Vision Transformer: eq. 1 against a hand-written patch embedding, the shapes, the attention
maps, the paper's ViT-B/16 size, bad images and configs refused with clear errors, one compiled
graph."""

import pytest
import torch

from aiayn import ImageClassifier, TransformerConfig, VisionTransformer, count_parameters

pytestmark = pytest.mark.usefixtures("one_thread")
CONFIG = TransformerConfig.preset("vit-digits", d_model=24, n_heads=3, d_ff=40, n_encoder_layers=2,
                                  image_size=12, patch_size=3, num_channels=2, num_labels=5,
                                  dropout=0.0)


def test_patch_embedding_is_eq_1():
    """z_0 = [x_class; x_p^1 E; ...; x_p^N E] + E_pos, the patches flattened as (C, P, P) in
    row-major patch order, computed by hand with reshapes and one matrix product."""
    model = VisionTransformer(CONFIG).eval()
    embedding = model.embeddings
    with torch.no_grad():
        embedding.cls_token.normal_()
        embedding.projection.bias.normal_()
    images = torch.randn(4, 2, 12, 12)
    batch, channels, size, patch = 4, 2, 12, 3
    grid = size // patch
    patches = images.view(batch, channels, grid, patch, grid, patch)  # (B, C, G, P, G, P)
    patches = patches.permute(0, 2, 4, 1, 3, 5)  # (B, G, G, C, P, P)
    patches = patches.reshape(batch, grid * grid, channels * patch * patch)  # (B, N, C P^2)
    matrix = embedding.projection.weight.reshape(24, -1)  # E^T: (D, C P^2)
    projected = patches @ matrix.T + embedding.projection.bias  # (B, N, D)
    expected = torch.cat([embedding.cls_token.expand(batch, 1, 24), projected], 1)  # (B, 1+N, D)
    expected = expected + embedding.positions
    with torch.no_grad():
        got = embedding(images)
    assert got.shape == (4, 17, 24)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_shapes_and_the_head_reads_the_final_cls_state():
    model = ImageClassifier(CONFIG).eval()
    images = torch.randn(3, 2, 12, 12)
    with torch.no_grad():
        hidden = model.encoder(images)
        logits = model(images)
        assert hidden.shape == (3, 17, 24) and logits.shape == (3, 5)
        torch.testing.assert_close(logits, model.head.classifier(hidden[:, 0]))
        # Each image is classified alone: no token of one image sees another's.
        torch.testing.assert_close(model(images[1:2]), logits[1:2], rtol=1e-5, atol=1e-6)


def test_attention_maps_are_data_and_change_nothing():
    model = ImageClassifier(CONFIG).eval()
    images = torch.randn(2, 2, 12, 12)
    with torch.no_grad():
        logits, maps = model(images, return_attention=True)
        assert torch.equal(logits, model(images))
    assert not maps.decoder and not maps.cross and len(maps.encoder) == 2
    for weights in maps.encoder:
        assert weights.shape == (2, 3, 17, 17)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3, 17))


def test_vit_base_has_the_papers_86m_parameters():
    """Table 1: ViT-Base, 12 layers, D 768, MLP 3072, 12 heads, 86M parameters (with a 1000-class
    head at 224 x 224 in 16 x 16 patches: 86,567,656, as HF's ViTForImageClassification counts)."""
    with torch.device("meta"):
        model = ImageClassifier(TransformerConfig.preset("vit-base"))
    assert count_parameters(model) == 86_567_656
    assert model.encoder.embeddings.positions.shape == (1, 197, 768)  # 14 x 14 patches + [CLS]


@pytest.mark.parametrize("images, error, message", [
    (torch.randn(2, 2, 12, 13), ValueError,
     r"images are 12x13 pixels, the model takes 12x12 \(image_size\); resize them"),
    (torch.randn(2, 3, 12, 12), ValueError, r"images have 3 channels, the model takes 2"),
    (torch.randn(2, 12, 12), ValueError,
     r"images must have shape \(B, C, H, W\), got \(2, 12, 12\)"),
    (torch.zeros(2, 2, 12, 12, dtype=torch.uint8), TypeError,
     r"images must be a floating-point tensor .* got torch\.uint8"),
    ([[0.0]], TypeError, r"images must be a tensor \(B, C, H, W\), got list")])
def test_bad_images_are_refused(images, error, message):
    model = ImageClassifier(CONFIG)
    with pytest.raises(error, match=message):
        model(images)


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match=r"patch_size \(5\) must divide image_size \(12\)"):
        CONFIG.replace(patch_size=5)
    with pytest.raises(ValueError, match=r"image_size must be a positive integer, got 0"):
        CONFIG.replace(image_size=0)
    with pytest.raises(ValueError, match=r"num_channels must be a positive integer"):
        CONFIG.replace(num_channels=True)
    with pytest.raises(ValueError, match=r"learned positions \(positions='learned'\), got "
                                         r"positions='sinusoidal'"):
        VisionTransformer(CONFIG.replace(positions="sinusoidal"))
    with pytest.raises(ValueError, match=r"needs n_encoder_layers >= 1, got 0"):
        ImageClassifier(CONFIG.replace(n_encoder_layers=0))
    for field, value in (("embedding_norm", True), ("type_vocab_size", 2)):  # ignored before
        with pytest.raises(ValueError, match=f"patch embedding has no {field} .* got "
                                             f"{field}={value}"):
            VisionTransformer(CONFIG.replace(**{field: value}))
    with pytest.raises(TypeError, match="no token embeddings; call forward_embedded"):
        VisionTransformer(CONFIG).encoder(torch.zeros(1, 3, dtype=torch.long))


def test_config_round_trips_with_the_image_fields(tmp_path):
    CONFIG.save(tmp_path / "config.json")
    loaded = TransformerConfig.load(tmp_path / "config.json")
    assert (loaded.image_size, loaded.patch_size, loaded.num_channels) == (12, 3, 2)
    assert loaded == CONFIG


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_training_step_compiles_in_one_graph():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ImageClassifier(CONFIG).train()
    images = torch.randn(3, 2, 12, 12)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    compiled(images).square().mean().backward()
    got = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model(images).square().mean().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    torch._dynamo.reset()


def test_the_vision_docs_snippets_run_and_links_resolve():
    """docs/vision.md and the README's ViT example stay true."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    page = (root / "docs" / "vision.md").read_text(encoding="utf-8")
    readme = (root / "README.md").read_text(encoding="utf-8")
    snippets = [s for s in re.findall(r"```python\n(.*?)```", page + readme, flags=re.S)
                if "ImageClassifier" in s]
    assert len(snippets) == 2
    for snippet in snippets:
        exec(compile(snippet, "vision snippet", "exec"), {"__name__": "__snippet__"})
    targets = re.findall(r"\]\(([^)#]+)\)", page)
    assert targets and all((root / "docs" / target).exists() for target in targets), targets
