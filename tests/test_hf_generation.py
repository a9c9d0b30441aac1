"""Greedy decoding with aiayn's static KV cache equals Hugging Face ``generate`` token for token
(GPT-2 and Marian, 50 new tokens, weights copied through save_pretrained/from_pretrained), also
with a repetition penalty on left-padded prompts; the repetition penalty and min-p filter equal
transformers' logits processors."""

import pytest
import torch

import aiayn
from hf_helpers import MARIAN_SEPARATE_VOCAB_4, greedy_causal_lm, greedy_seq2seq, randomise

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("one_thread")
NEW_TOKENS = 50


@pytest.mark.parametrize("fields", [dict(n_embd=30, n_head=5, n_layer=3),
                                    dict(n_embd=48, n_head=4, n_layer=2, n_inner=100)],
                         ids=["d30-h5-l3", "d48-h4-l2"])
def test_gpt2_greedy_matches_generate(tmp_path, fields):
    vocab = 97
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=80, bos_token_id=vocab - 1,
                                     eos_token_id=vocab - 1, **fields)
    hf = transformers.GPT2LMHeadModel(config).eval()
    randomise(hf, std=0.3)
    hf.save_pretrained(tmp_path)
    ours = aiayn.from_pretrained(tmp_path)
    for seed in range(3):
        prompt = torch.randint(0, vocab - 1, (1, 4 + seed), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                   num_beams=1, max_new_tokens=NEW_TOKENS, min_new_tokens=0,
                                   eos_token_id=vocab - 1, pad_token_id=vocab - 1)
        got = greedy_causal_lm(ours, prompt, NEW_TOKENS, eos=vocab - 1)
        assert got.tolist() == expected.tolist()
    assert got.shape[1] == prompt.shape[1] + NEW_TOKENS  # the last run went the full 50 tokens


@pytest.mark.parametrize("fields", [
    dict(d_model=42, encoder_attention_heads=3, decoder_attention_heads=3, encoder_layers=2,
         decoder_layers=3, encoder_ffn_dim=50, decoder_ffn_dim=50, scale_embedding=True,
         activation_function="swish"),
    pytest.param(dict(d_model=32, encoder_attention_heads=4, decoder_attention_heads=4,
                      encoder_layers=1, decoder_layers=2, encoder_ffn_dim=40, decoder_ffn_dim=40,
                      decoder_vocab_size=71, share_encoder_decoder_embeddings=False),
                 marks=MARIAN_SEPARATE_VOCAB_4)], ids=["shared-d42", "separate-vocab-d32"])
def test_marian_greedy_matches_generate(tmp_path, fields):
    target_vocab = fields.get("decoder_vocab_size", 90)
    pad = target_vocab - 1
    config = transformers.MarianConfig(vocab_size=90, pad_token_id=pad, decoder_start_token_id=pad,
                                       eos_token_id=0, max_position_embeddings=80, **fields)
    hf = transformers.MarianMTModel(config).eval()
    randomise(hf, std=0.3)
    hf.save_pretrained(tmp_path)
    hf.generation_config.forced_eos_token_id = None  # HF would force eos at max length
    ours = aiayn.from_pretrained(tmp_path)
    lengths = []
    for seed in range(3):
        source = torch.randint(1, pad, (1, 6 + seed), generator=torch.Generator().manual_seed(seed))
        mask = torch.ones_like(source, dtype=torch.bool)
        with torch.no_grad():
            expected = hf.generate(source, attention_mask=mask.long(), do_sample=False, num_beams=1,
                                   max_new_tokens=NEW_TOKENS, min_new_tokens=0)
        got = greedy_seq2seq(ours, source, mask, NEW_TOKENS, eos=0)
        assert got.tolist() == expected.tolist()
        lengths.append(got.shape[1] - 1)
    assert NEW_TOKENS in lengths  # at least one source decoded the full 50 tokens


def test_greedy_with_a_repetition_penalty_matches_generate_on_left_padded_prompts(tmp_path):
    from aiayn.decoding.generation import generate

    vocab = 97
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=80, n_embd=32, n_head=4,
                                     n_layer=2, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    randomise(hf, std=0.3)
    hf.save_pretrained(tmp_path)
    ours = aiayn.from_pretrained(tmp_path, pad_id=0)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, vocab, (n,), generator=generator).tolist() for n in (7, 3, 5)]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.arange(width) >= width - torch.tensor([7, 3, 5])[:, None]  # True = real
    results = {}
    for penalty in (1.0, 1.5):
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask.long(), do_sample=False, num_beams=1,
                              max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              repetition_penalty=penalty, pad_token_id=0)
        want = out[:, width:].tolist()
        got = generate(ours, prompts, max_new_tokens=NEW_TOKENS, greedy=True,
                       repetition_penalty=penalty).tokens
        assert got == want, penalty
        results[penalty] = want
    assert results[1.0] != results[1.5]  # the penalty changes what is generated


@pytest.mark.parametrize("min_p", [0.05, 0.3])
def test_the_penalty_and_min_p_equal_transformers_processors(min_p):
    logits_process = pytest.importorskip("transformers.generation.logits_process")
    if not hasattr(logits_process, "MinPLogitsWarper"):
        pytest.skip(f"transformers {transformers.__version__} has no min-p")
    from aiayn.decoding.sampling import filter_logits, penalise_repeats

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=generator) * 3
    seen = torch.randint(0, 50, (4, 12), generator=generator)
    want = logits_process.RepetitionPenaltyLogitsProcessor(1.3)(seen, logits.clone())
    torch.testing.assert_close(penalise_repeats(logits, seen, 1.3), want, rtol=0, atol=0)
    warped = logits_process.MinPLogitsWarper(min_p)(seen, logits.clone())
    assert torch.equal(filter_logits(logits, min_p=min_p).isinf(), warped.isinf())
