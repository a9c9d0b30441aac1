"""Bad input to the core raises a clear error that names the problem."""

import pytest
import torch

from aiayn import CausalLM, SequenceClassifier, Transformer, TransformerConfig, TransformerEncoder
from aiayn.decoding.beam import beam_search
from aiayn.decoding.generation import GenerationConfig
from aiayn.decoding.greedy import greedy_search
from aiayn.fast import prepare_for_inference
from aiayn.nn.attention import FusedAttention, MultiHeadAttention, SelfAttention

CONFIG = TransformerConfig.preset("tiny")
NOT_ENCODER_DECODER = (r"decodes with an encoder-decoder model \(Transformer\), got {}; continue "
                       r"prompts of a decoder-only model \(CausalLM\) with "
                       r"aiayn\.decoding\.generation\.generate")


def ids(*shape):
    return torch.randint(3, 100, shape)


def search(function, model=None, **options):
    """``function`` (a search, or an engine's) on ``model`` (default: an encoder-decoder)."""
    model = (model or Transformer(CONFIG)).eval()
    source = ids(2, 5)
    return function(model, source, source != 0, **options)


def engine_search(name):
    """The ``aiayn.fast`` engine's search ``name`` as a ``search`` function."""
    return lambda model, source, mask, **options: getattr(
        prepare_for_inference(model), name)(source, mask, **options)


@pytest.mark.parametrize("call, error, words", [
    (lambda: CausalLM(CONFIG)(ids(2, 5).float()), TypeError, "integer token ids"),
    (lambda: CausalLM(CONFIG)(ids(5)), ValueError, r"shape \(B, T\)"),
    (lambda: CausalLM(CONFIG)(ids(2, 3, 4)), ValueError, r"shape \(B, T\)"),
    (lambda: CausalLM(CONFIG)(ids(2, 0)), ValueError, "empty"),
    (lambda: CausalLM(CONFIG)(torch.tensor([[1, 100]])), ValueError,
     r"token ids must lie in \[0, vocab_size=100\), got ids from 1 to 100"),
    (lambda: TransformerEncoder(CONFIG)(torch.tensor([[-1, 5]])), ValueError,
     r"vocab_size=100\), got ids from -1 to 5"),
    (lambda: Transformer(CONFIG)(ids(1, 3), torch.tensor([[1, 250]])), ValueError,
     "vocab_size=100"),
    (lambda: CausalLM(CONFIG)([[1, 2]]), TypeError, "must be a tensor"),
    (lambda: Transformer(CONFIG)(ids(2, 5), ids(3, 4)), ValueError, "batch sizes differ: 2 vs 3"),
    (lambda: Transformer(CONFIG)(ids(2, 5), ids(2, 4),
                                 src_padding_mask=torch.ones(2, 6, dtype=torch.bool)),
     ValueError, r"padding_mask must have shape \(B=2, S=5\)"),
    (lambda: Transformer(CONFIG)(ids(2, 5), ids(2, 4), src_padding_mask=torch.ones(2, 5)),
     ValueError, "must be boolean"),
    (lambda: Transformer(CONFIG)(ids(2, 5), ids(2, 4),
                                 tgt_padding_mask=torch.ones(2, 5, dtype=torch.bool)),
     ValueError, r"\(B=2, S=4\)"),
    (lambda: TransformerEncoder(CONFIG)(ids(1, 65)), ValueError,
     "65 positions exceeds the position table"),
    (lambda: CausalLM(CONFIG.replace(positions="learned"))(ids(1, 70)), ValueError,
     "max_length=64"),
    (lambda: CausalLM(CONFIG.replace(positions="none"))(ids(1, 70)), ValueError, "max_length=64"),
    (lambda: TransformerEncoder(CONFIG)(ids(2, 5), token_types=ids(2, 4)), ValueError,
     "token_types must have the shape"),
    (lambda: TransformerEncoder(CONFIG.replace(type_vocab_size=0))(
        ids(2, 5), token_types=torch.ones(2, 5, dtype=torch.long)), ValueError,
     r"token_types given, but the model has no segment embeddings \(type_vocab_size=0\)"),
    (lambda: SequenceClassifier(CONFIG.replace(type_vocab_size=2))(
        ids(1, 3), token_types=torch.tensor([[0, 1, 2]])), ValueError,
     r"token_types must lie in \[0, type_vocab_size=2\), got 0 to 2"),
    (lambda: Transformer(CONFIG).decode(ids(2, 3), None), ValueError, "needs the encoder output"),
    (lambda: Transformer(CONFIG).decode(ids(2, 3), torch.randn(3, 4, 32)), ValueError,
     r"memory must have shape \(B=2"),
    (lambda: Transformer(CONFIG).decode(ids(2, 3), torch.randn(2, 4, 31)), ValueError,
     r"memory must have shape \(B, S, D=32\)"),
    (lambda: MultiHeadAttention(30, 4, FusedAttention()), ValueError, "divisible by n_heads"),
    (lambda: SelfAttention(32, 4, FusedAttention())(torch.randn(2, 3, 16)), ValueError,
     r"\(B, T, D=32\)"),
    (lambda: CausalLM(CONFIG)(ids(2, 3), positions=ids(2, 4)), ValueError, "positions must have"),
    (lambda: CausalLM(CONFIG)(ids(1, 2), positions=torch.tensor([[-1, 0]])), ValueError,
     r"positions must lie in \[0, max_length=64\), got positions from -1 to 0"),
    (lambda: CausalLM(CONFIG.replace(positions="learned"))(ids(1, 2), positions=torch.tensor([[0, 64]])),
     ValueError, r"max_length=64\), got positions from 0 to 64"),
    (lambda: CausalLM(CONFIG.replace(positions="rotary", scale_embeddings=False))(
        ids(1, 2), positions=torch.tensor([[63, 64]])), ValueError, r"from 63 to 64"),
    (lambda: CausalLM(CONFIG)(ids(1, 2), positions=torch.tensor([[0.0, 1.0]])), TypeError,
     "positions must be an integer tensor, got torch.float32"),
    (lambda: SequenceClassifier(CONFIG)(ids(2, 3), padding_mask=torch.ones(3, 3, dtype=torch.bool)),
     ValueError, r"\(B=2, S=3\)"),
    (lambda: TransformerEncoder(CONFIG.replace(type_vocab_size=2))(
        ids(2, 7), token_types=torch.zeros(2, 7)), TypeError,
     r"token_types must hold integer segment ids \(torch.long\), got torch.float32"),
    (lambda: TransformerEncoder(CONFIG.replace(type_vocab_size=2))(
        ids(1, 2), token_types=[[0, 1]]), TypeError,
     "token_types must be a tensor of segment ids, got list"),
    (lambda: search(greedy_search, CausalLM(CONFIG)), TypeError,
     "greedy_search " + NOT_ENCODER_DECODER.format("CausalLM")),
    (lambda: search(beam_search, CausalLM(CONFIG)), TypeError,
     "beam_search " + NOT_ENCODER_DECODER.format("CausalLM")),
    (lambda: search(beam_search, TransformerEncoder(CONFIG)), TypeError,
     "beam_search " + NOT_ENCODER_DECODER.format("TransformerEncoder")),
    (lambda: search(engine_search("greedy_search"), CausalLM(CONFIG)), TypeError,
     "greedy_search " + NOT_ENCODER_DECODER.format("CausalLM")),
    (lambda: search(engine_search("beam_search"), SequenceClassifier(CONFIG)), TypeError,
     "beam_search " + NOT_ENCODER_DECODER.format("SequenceClassifier")),
    (lambda: search(beam_search, alpha="0.6"), ValueError,
     "alpha must be a non-negative number, got '0.6'"),
    (lambda: search(beam_search, alpha=True), ValueError,
     "alpha must be a non-negative number, got True"),
    (lambda: search(engine_search("beam_search"), alpha=None), ValueError,
     "alpha must be a non-negative number, got None"),
    (lambda: search(beam_search, beam_size=True), ValueError,
     "beam_size must be a positive integer, got True"),
    (lambda: search(beam_search, max_extra="5"), ValueError,
     "max_extra must be a non-negative integer, got '5'"),
    (lambda: search(greedy_search, max_extra=True), ValueError,
     "max_extra must be a non-negative integer, got True"),
    (lambda: GenerationConfig(temperature=True), ValueError,
     r"temperature must be >= 0 \(0 = greedy\), got True"),
    (lambda: GenerationConfig(top_p=True), ValueError,
     r"top_p must be in \(0, 1\] or None, got True"),
    (lambda: GenerationConfig(min_p=False), ValueError,
     r"min_p must be in \[0, 1\] or None, got False"),
])
def test_bad_model_input_raises_clear_error(call, error, words):
    with pytest.raises(error, match=words):
        call()
