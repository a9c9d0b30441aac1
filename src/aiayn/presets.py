"""Named model presets: plain data, each a dict of ``TransformerConfig`` fields
(``TransformerConfig.preset(name, **overrides)`` builds one)."""

from __future__ import annotations

from typing import Any

# Presets are plain data. `base` and `big` are the paper's Table 3 rows; the rest are ours.
PRESETS: dict[str, dict[str, Any]] = {
    "base": dict(d_model=512, d_ff=2048, n_heads=8, n_encoder_layers=6, n_decoder_layers=6,
                 dropout=0.1),
    "big": dict(d_model=1024, d_ff=4096, n_heads=16, n_encoder_layers=6, n_decoder_layers=6,
                dropout=0.3),
    "tiny": dict(vocab_size=100, d_model=32, d_ff=64, n_heads=4, n_encoder_layers=2,
                 n_decoder_layers=2, max_length=64, dropout=0.0),
    # The default model of `aiayn train translation`, sized for a ~10 minute run on 2 CPU cores
    # (docs/translation.md); vocab_size is set from the learned tokenizer.
    "mt-cpu": dict(d_model=128, d_ff=512, n_heads=4, n_encoder_layers=3, n_decoder_layers=3,
                   max_length=256, dropout=0.1),
    # nanoGPT's CPU "baby GPT" (README: train_shakespeare_char.py --device=cpu --block_size=64
    # --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --dropout=0.0; train.py bias=False):
    # a GPT-2 block (pre-norm, GELU, 4x FFN, learned positions, tied output, N(0, 0.02) init with
    # the residual projections scaled) without biases. vocab_size is set by the text's characters.
    "baby-gpt": dict(vocab_size=65, d_model=128, n_heads=4, d_ff=512, n_encoder_layers=0,
                     n_decoder_layers=4, max_length=64, dropout=0.0, activation="gelu",
                     norm_first=True, bias=False, layer_norm_bias=False, positions="learned",
                     scale_embeddings=False, tie_output=True, init_std=0.02,
                     scaled_residual_init=True),
    # Ours for character-level text, the default of `aiayn train lm`: the baby GPT's network (so the
    # same time per step); its recipe differs only in the peak learning rate, 3e-3 instead of 1e-3
    # (PEAK_LR in commands/train_lm.py), which ends clearly lower in the same 2000 steps
    # (docs/language-modelling.md). A separate name keeps `baby-gpt` nanoGPT's exact recipe.
    "char-gpt": dict(vocab_size=65, d_model=128, n_heads=4, d_ff=512, n_encoder_layers=0,
                     n_decoder_layers=4, max_length=64, dropout=0.0, activation="gelu",
                     norm_first=True, bias=False, layer_norm_bias=False, positions="learned",
                     scale_embeddings=False, tie_output=True, init_std=0.02,
                     scaled_residual_init=True),
    # GPT-2 small (124M parameters) as nanoGPT trains it (config/train_gpt2.py, model.py with
    # bias=False): the baby GPT's block at 12 layers, 12 heads, width 768, context 1024, and
    # GPT-2's vocabulary padded to 50,304. `aiayn train lm --preset gpt2` takes its recipe
    # (PRESET_RECIPES in commands/train_lm.py); vocab_size then follows the tokenizer.
    "gpt2": dict(vocab_size=50304, d_model=768, n_heads=12, d_ff=3072, n_encoder_layers=0,
                 n_decoder_layers=12, max_length=1024, dropout=0.0, activation="gelu",
                 norm_first=True, bias=False, layer_norm_bias=False, positions="learned",
                 scale_embeddings=False, tie_output=True, init_std=0.02, scaled_residual_init=True),
    # The Vision Transformer (Dosovitskiy et al. 2021): ViT-Base/16 is Table 1's first row (86M
    # parameters); vit-digits is ours, the default of `aiayn train image-classification`: 8x8 grey
    # digits in 2x2 patches (16 + 1 tokens), sized for a CPU minute or two (docs/vision.md).
    "vit-base": dict(d_model=768, n_heads=12, d_ff=3072, n_encoder_layers=12, n_decoder_layers=0,
                     image_size=224, patch_size=16, num_channels=3, num_labels=1000,
                     activation="gelu", norm_first=True, positions="learned", dropout=0.1,
                     layer_norm_eps=1e-6),
    "vit-digits": dict(d_model=64, n_heads=4, d_ff=128, n_encoder_layers=4, n_decoder_layers=0,
                       image_size=8, patch_size=2, num_channels=1, num_labels=10,
                       activation="gelu", norm_first=True, positions="learned", dropout=0.1),
    # char-gpt's sizes with Llama's four changes (docs/modern-decoder.md): rotary positions, RMSNorm,
    # SwiGLU with F = 344 ~ 8D/3 (the same FFN parameters as 4D with two matrices) and grouped-query
    # attention with 2 key/value heads for 4 query heads; no biases, tied output as in char-gpt.
    "llama-char": dict(vocab_size=65, d_model=128, n_heads=4, n_kv_heads=2, d_ff=344,
                       n_encoder_layers=0, n_decoder_layers=4, max_length=64, dropout=0.0,
                       activation="silu", gated_ffn=True, norm="rms", norm_first=True, bias=False,
                       layer_norm_bias=False, positions="rotary", scale_embeddings=False,
                       tie_output=True, init_std=0.02, scaled_residual_init=True),
    # mt-cpu's sizes with T5 1.0's blocks (docs/t5.md): the default of `aiayn train text2text`.
    "t5-cpu": dict(d_model=128, d_ff=512, n_heads=4, n_encoder_layers=3, n_decoder_layers=3,
                   max_length=256, dropout=0.1, norm="rms", norm_first=True, bias=False,
                   positions="none", scale_embeddings=False, relative_attention_buckets=32,
                   relative_attention_max_distance=128, scale_attention=False, scale_output=True,
                   layer_norm_eps=1e-6),
    # A small pre-norm BERT-style encoder for classification / masked LM from scratch within a few
    # CPU minutes (aiayn train classification's default; GELU as in BERT).
    "encoder-small": dict(vocab_size=8000, d_model=128, d_ff=512, n_heads=4, n_encoder_layers=2,
                          n_decoder_layers=0, max_length=512, dropout=0.1, activation="gelu",
                          norm_first=True),
}
