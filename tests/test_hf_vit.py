"""Hugging Face ViT parity: ``ViTModel`` / ``ViTForImageClassification`` with random weights ->
save_pretrained -> aiayn.from_pretrained gives the same hidden states / logits (<= 1e-4, float32);
aiayn.save_pretrained -> transformers.from_pretrained gives aiayn's outputs back; bad checkpoints
are refused naming the file and key."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import aiayn
from aiayn import ImageClassifier, TransformerConfig, VisionTransformer
from hf_helpers import randomise

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")
TOLERANCE = 1e-4

VIT_CONFIGS = {  # odd widths, head counts, layer counts, patch sizes; grey and colour images
    "d36-h3-l3-p3-rgb": dict(hidden_size=36, num_attention_heads=3, num_hidden_layers=3,
                             intermediate_size=50, image_size=12, patch_size=3, num_channels=3),
    "d45-h5-l1-p4-grey-gelu_new": dict(hidden_size=45, num_attention_heads=5, num_hidden_layers=1,
                                       intermediate_size=31, image_size=16, patch_size=4,
                                       num_channels=1, hidden_act="gelu_new", layer_norm_eps=1e-6),
    "d32-h4-l2-p2-relu-pairs": dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                                    intermediate_size=64, image_size=[8, 8], patch_size=[2, 2],
                                    num_channels=2, hidden_act="relu"),
}


def _images(config: dict, batch: int = 3, seed: int = 0) -> torch.Tensor:
    size = config["image_size"]
    size = size[0] if isinstance(size, list) else size
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, config["num_channels"], size, size, generator=generator)


def _hf_model(architecture: str, name: str):
    config = transformers.ViTConfig(num_labels=7, **VIT_CONFIGS[name])
    model = getattr(transformers, architecture)(config).eval()  # ViTModel: with its pooler
    randomise(model)
    return model


def _output(hf_model, images):
    with torch.no_grad():
        out = hf_model(images)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("architecture, aiayn_class", [
    ("ViTModel", VisionTransformer), ("ViTForImageClassification", ImageClassifier)])
@pytest.mark.parametrize("name, fused, attention", [
    *((name, True, "fused") for name in VIT_CONFIGS), ("d36-h3-l3-p3-rgb", False, "reference")],
    ids=lambda v: {True: "fused-qkv", False: "separate-qkv"}.get(v, v))
def test_vit_parity(tmp_path, architecture, aiayn_class, name, fused, attention):
    hf = _hf_model(architecture, name)
    hf.save_pretrained(tmp_path)
    ours = aiayn.from_pretrained(tmp_path, fused_projections=fused, attention=attention)
    assert type(ours) is aiayn_class and not ours.training
    assert ours.config.norm_first and ours.config.final_norm
    images = _images(VIT_CONFIGS[name])
    expected = _output(hf, images)
    with torch.no_grad():
        got = ours(images)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= TOLERANCE


def test_attention_weights_match_hf(tmp_path):
    hf = _hf_model("ViTForImageClassification", "d36-h3-l3-p3-rgb")
    hf.config._attn_implementation = "eager"  # HF returns weights from its eager path only
    hf.save_pretrained(tmp_path)
    ours = aiayn.from_pretrained(tmp_path)
    images = _images(VIT_CONFIGS["d36-h3-l3-p3-rgb"])
    with torch.no_grad():
        expected = hf(images, output_attentions=True).attentions
        logits, maps = ours(images, return_attention=True)
        assert torch.equal(logits, ours(images))  # collecting weights changes nothing
    assert len(maps.encoder) == len(expected) == 3
    for got, want in zip(maps.encoder, expected):
        assert got.shape == want.shape == (3, 3, 17, 17)
        assert (got - want).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("aiayn_class, architecture", [
    (VisionTransformer, "ViTModel"), (ImageClassifier, "ViTForImageClassification")])
def test_round_trip_through_transformers(tmp_path, aiayn_class, architecture):
    config = TransformerConfig.preset("vit-digits", d_model=40, n_heads=5, d_ff=72,
                                      n_encoder_layers=2, num_channels=3, num_labels=6,
                                      layer_norm_eps=1e-6)
    ours = aiayn_class(config).eval()
    with torch.no_grad():  # no parameter left at its initial 0 or 1
        for parameter in ours.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    aiayn.save_pretrained(ours, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == [architecture] and written["model_type"] == "vit"
    kwargs = {"add_pooling_layer": False} if architecture == "ViTModel" else {}
    hf = getattr(transformers, architecture).from_pretrained(tmp_path, **kwargs).eval()
    images = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        expected = ours(images)
    assert (_output(hf, images) - expected).abs().max().item() <= TOLERANCE
    back = aiayn.from_pretrained(tmp_path)
    assert type(back) is aiayn_class
    for (name, a), (_, b) in zip(ours.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name


def test_checkpoint_loads_as_the_other_task(tmp_path):
    """A classifier's file loads as the bare ViT (head dropped); a ViTModel's (with its pooler) as
    a classifier with a fresh head, for fine-tuning."""
    hf = _hf_model("ViTForImageClassification", "d36-h3-l3-p3-rgb")
    hf.save_pretrained(tmp_path / "cls")
    bare = aiayn.from_pretrained(tmp_path / "cls", task="encoder")
    images = _images(VIT_CONFIGS["d36-h3-l3-p3-rgb"])
    with torch.no_grad():
        expected = hf.vit(images).last_hidden_state
        assert (bare(images) - expected).abs().max().item() <= TOLERANCE
    base = _hf_model("ViTModel", "d36-h3-l3-p3-rgb")
    assert base.pooler is not None
    base.save_pretrained(tmp_path / "base")
    classifier = aiayn.from_pretrained(tmp_path / "base", task="classification", num_labels=4)
    assert type(classifier) is ImageClassifier and classifier.head.classifier.out_features == 4
    with pytest.raises(ValueError, match="loads as one of"):
        aiayn.from_pretrained(tmp_path / "base", task="masked_lm")


def test_from_transformers_in_memory():
    hf = _hf_model("ViTForImageClassification", "d45-h5-l1-p4-grey-gelu_new")
    ours = aiayn.from_transformers(hf)
    images = _images(VIT_CONFIGS["d45-h5-l1-p4-grey-gelu_new"])
    with torch.no_grad():
        assert (ours(images) - _output(hf, images)).abs().max().item() <= TOLERANCE


# --- bad checkpoints -----------------------------------------------------------------------------
@pytest.fixture
def vit_dir(tmp_path):
    directory = tmp_path / "vit"
    aiayn.save_pretrained(ImageClassifier(TransformerConfig.preset("vit-digits")), directory)
    return directory


def _edit(directory, edit):
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_unknown_missing_and_misshapen_keys_are_refused(vit_dir):
    _edit(vit_dir, lambda t: t.update({"vit.embeddings.mask_token": torch.zeros(1, 1, 64)}))
    with pytest.raises(ValueError, match=r"model\.safetensors: unexpected key\(s\) "
                                         r"'vit\.embeddings\.mask_token'"):
        aiayn.from_pretrained(vit_dir)
    _edit(vit_dir, lambda t: (t.pop("vit.embeddings.mask_token"),
                              t.pop("vit.encoder.layer.1.layernorm_after.bias")))
    with pytest.raises(ValueError, match=r"missing key 'vit\.encoder\.layer\.1\.layernorm_after"):
        aiayn.from_pretrained(vit_dir)
    _edit(vit_dir, lambda t: t.update({
        "vit.encoder.layer.1.layernorm_after.bias": torch.zeros(64),
        "vit.embeddings.position_embeddings": torch.zeros(1, 26, 64)}))
    with pytest.raises(ValueError, match=r"shape mismatch for "
                                         r"'vit\.embeddings\.position_embeddings' \(1, 26, 64\)"):
        aiayn.from_pretrained(vit_dir)


@pytest.mark.parametrize("change, message", [
    ({"image_size": [8, 12]}, r"image_size=\[8, 12\] is not supported .*square"),
    ({"patch_size": 3}, r"patch_size \(3\) must divide image_size \(8\)"),
    ({"qkv_bias": False}, r"qkv_bias=False is not supported"),
    ({"head_dim": 8}, r"head_dim=8 is not supported"),
    ({"hidden_act": "quick_gelu"}, r"hidden_act='quick_gelu' is not supported")])
def test_unsupported_configs_are_refused(vit_dir, change, message):
    path = vit_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(ValueError, match=rf"config\.json: .*{message}"):
        aiayn.from_pretrained(vit_dir)


def test_save_refuses_a_vit_hf_cannot_express(tmp_path):
    for change in (dict(norm_first=False), dict(pooling="mean"), dict(bias=False)):
        model = ImageClassifier(TransformerConfig.preset("vit-digits", **change))
        field = next(iter(change))
        with pytest.raises(ValueError, match=f"cannot export as ViT: ViT needs {field}="):
            aiayn.save_pretrained(model, tmp_path / field)
