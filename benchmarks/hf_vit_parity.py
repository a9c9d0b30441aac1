"""aiayn's ViT against Hugging Face's, in numbers: the largest elementwise difference of the outputs.

For each config (random HF weights, LayerNorms included, so no parameter hides as 1 or 0): HF
``save_pretrained`` -> ``aiayn.from_pretrained`` with the default fused kernel and q/k/v matmul,
and with the reference kernel and separate q/k/v; then ``aiayn.save_pretrained`` ->
``transformers.from_pretrained`` (the round trip). Float32, a batch of 4 random images.
tests/test_hf_vit.py asserts the same comparisons at 1e-4; this prints the measured figures.

    python3 benchmarks/hf_vit_parity.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

import aiayn  # noqa: E402

CONFIGS = {  # the configs of tests/test_hf_vit.py, and ViT-Base/16's shape at 2 layers
    "d36-h3-l3-p3-rgb": dict(hidden_size=36, num_attention_heads=3, num_hidden_layers=3,
                             intermediate_size=50, image_size=12, patch_size=3, num_channels=3),
    "d45-h5-l1-p4-grey-gelu_new": dict(hidden_size=45, num_attention_heads=5, num_hidden_layers=1,
                                       intermediate_size=31, image_size=16, patch_size=4,
                                       num_channels=1, hidden_act="gelu_new", layer_norm_eps=1e-6),
    "d32-h4-l2-p2-relu": dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                              intermediate_size=64, image_size=8, patch_size=2, num_channels=2,
                              hidden_act="relu"),
    "vit-base-shape-l2": dict(hidden_size=768, num_attention_heads=12, num_hidden_layers=2,
                              intermediate_size=3072, image_size=224, patch_size=16,
                              num_channels=3),
}


def randomise(model) -> None:
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            noise = torch.randn(tensor.shape, generator=generator)
            if "layernorm" in name:
                tensor.copy_(noise * 0.3 + (1.0 if name.endswith("weight") else 0.0))
            else:
                tensor.copy_(noise * 0.2 / max(1.0, tensor.shape[-1] / 64) ** 0.5)


def output(model, images: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(images)
    return out.logits if hasattr(out, "logits") else getattr(out, "last_hidden_state", out)


def main() -> int:
    import transformers

    torch.set_num_threads(2)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; max |aiayn - HF|")
    print(f"{'config':<28} {'model':<27} {'fused':>9} {'reference':>10} {'round trip':>11}")
    for name, fields in CONFIGS.items():
        for architecture in ("ViTForImageClassification", "ViTModel"):
            config = transformers.ViTConfig(num_labels=7, **fields)
            hf = getattr(transformers, architecture)(config).eval()
            randomise(hf)
            images = torch.randn(4, fields["num_channels"], fields["image_size"],
                                 fields["image_size"], generator=torch.Generator().manual_seed(0))
            expected = output(hf, images)
            with tempfile.TemporaryDirectory() as directory, \
                    tempfile.TemporaryDirectory() as back:
                hf.save_pretrained(directory)
                fused = aiayn.from_pretrained(directory)
                reference = aiayn.from_pretrained(directory, attention="reference",
                                                  fused_projections=False)
                aiayn.save_pretrained(fused, back)
                kwargs = {"add_pooling_layer": False} if architecture == "ViTModel" else {}
                again = getattr(transformers, architecture).from_pretrained(back, **kwargs).eval()
                diffs = [(output(model, images) - expected).abs().max().item()
                         for model in (fused, reference)]
                diffs.append((output(again, images) - output(fused, images)).abs().max().item())
            print(f"{name:<28} {architecture:<27} {diffs[0]:>9.2e} {diffs[1]:>10.2e} "
                  f"{diffs[2]:>11.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
