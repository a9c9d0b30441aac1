"""Bad input to the core raises a clear error that names the problem."""

import pytest
import torch

from aiayn import CausalLM, SequenceClassifier, Transformer, TransformerConfig, TransformerEncoder
from aiayn.nn.attention import FusedAttention, MultiHeadAttention, SelfAttention

CONFIG = TransformerConfig.preset("tiny")


def ids(*shape):
    return torch.randint(3, 100, shape)


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
])
def test_bad_model_input_raises_clear_error(call, error, words):
    with pytest.raises(error, match=words):
        call()
