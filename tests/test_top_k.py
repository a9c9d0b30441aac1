"""``aiayn.decoding.top_k``: the block-maxima selection equals ``torch.topk``.

- values and indices equal ``torch.topk``'s on rows without ties (whole blocks, a tail, leading dims);
- with ties, -inf and NaN the values are equal and the indices distinct and pointing at them;
- short rows and large k take ``torch.topk`` itself; a bad k is a clear error;
- beam search and top-k sampling give the same results through the block path as through
  ``torch.topk`` (small blocks force the block path on a tiny model).
"""

import pytest
import torch

from aiayn import CausalLM, Transformer, TransformerConfig
from aiayn.decoding import top_k as top_k_module
from aiayn.decoding.beam import beam_search
from aiayn.decoding.sampling import filter_logits, generate
from aiayn.decoding.top_k import BLOCK, top_k, uses_blocks


@pytest.mark.parametrize("shape, k", [((4, 32768), 4), ((4, 32768), 8), ((3, 32003), 8),
                                      ((2, 3, 20000), 5), ((40000,), 1), ((5, 16384), 16)])
def test_equals_torch_topk_on_rows_without_ties(shape, k):
    torch.manual_seed(0)
    x = torch.randn(shape)
    assert uses_blocks(shape[-1], k, x.device)
    values, indices = top_k(x, k)
    expected = torch.topk(x, k, dim=-1)
    assert torch.equal(values, expected.values) and torch.equal(indices, expected.indices)


def test_the_largest_entries_in_one_block_and_in_the_tail_are_found():
    x = torch.randn(2, 20000) - 10
    x[0, 5 * BLOCK: 5 * BLOCK + 6] = torch.arange(6.0)  # all six in one block
    x[1, -3:] = torch.tensor([1.0, 3.0, 2.0])  # the tail past the last whole block
    values, indices = top_k(x, 6)
    assert indices[0].tolist() == [5 * BLOCK + i for i in (5, 4, 3, 2, 1, 0)]
    assert indices[1, :3].tolist() == [19998, 19999, 19997]
    assert torch.equal(values, torch.topk(x, 6).values)


def _check_ties(x: torch.Tensor, k: int):
    values, indices = top_k(x, k)
    torch.testing.assert_close(values, torch.topk(x, k).values, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(x.gather(-1, indices), values, equal_nan=True, rtol=0, atol=0)
    assert all(len(set(row)) == k for row in indices.tolist())  # each entry once


def test_ties_negative_infinity_and_nan_keep_torch_topk_values():
    torch.manual_seed(1)
    ties = torch.randint(0, 3, (3, 20000)).float()  # thousands of equal maxima
    _check_ties(ties, 8)
    mostly_inf = torch.full((2, 32768), -torch.inf)
    mostly_inf[0, [7, 20000, 32767]] = torch.tensor([1.0, 2.0, 0.5])  # fewer finite than k
    _check_ties(mostly_inf, 8)
    with_nan = torch.randn(2, 20000)
    with_nan[0, 12345] = torch.nan  # ranked above everything, as by torch.topk
    _check_ties(with_nan, 4)
    assert top_k(with_nan, 4)[1][0, 0] == 12345


def test_short_rows_and_large_k_use_torch_topk():
    assert not uses_blocks(8192, 4, torch.device("cpu"))
    assert not uses_blocks(20000, 50, torch.device("cpu"))  # 156 blocks < 8 per k
    assert not uses_blocks(10 ** 6, 4, torch.device("meta"))  # not CPU
    x = torch.randn(3, 100)
    assert torch.equal(top_k(x, 100)[1], torch.topk(x, 100).indices)


@pytest.mark.parametrize("k", [0, -1, 101])
def test_k_outside_the_row_is_a_clear_error(k):
    with pytest.raises(ValueError, match="k must be between 1 and the row length 100"):
        top_k(torch.randn(2, 100), k)


@pytest.fixture
def small_blocks(monkeypatch):
    """The block path for any row: blocks of 4 entries, no minimum length."""
    monkeypatch.setattr(top_k_module, "BLOCK", 4)
    monkeypatch.setattr(top_k_module, "MIN_LENGTH", 0)
    monkeypatch.setattr(top_k_module, "MIN_BLOCKS_PER_K", 1)


def _through_torch_topk(monkeypatch):
    monkeypatch.setattr(top_k_module, "MIN_LENGTH", 10 ** 9)


def test_beam_search_through_blocks_equals_torch_topk(small_blocks, monkeypatch):
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.preset("tiny", vocab_size=41)).eval()
    src = torch.randint(3, 41, (3, 6))
    src_mask = torch.ones(3, 6, dtype=torch.bool)
    src_mask[2, 4:] = False
    assert uses_blocks(3 * 41, 6, torch.device("cpu"))  # the (n, K * V) candidates, 2K kept
    blocked = beam_search(model, src, src_mask, beam_size=3, max_extra=5)
    _through_torch_topk(monkeypatch)
    assert not uses_blocks(3 * 41, 6, torch.device("cpu"))
    plain = beam_search(model, src, src_mask, beam_size=3, max_extra=5)
    assert [h.tokens for h in blocked] == [h.tokens for h in plain]
    assert [h.score for h in blocked] == [h.score for h in plain]


def test_top_k_sampling_through_blocks_equals_torch_topk(small_blocks, monkeypatch):
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    filtered = filter_logits(logits, top_k=5)
    model = CausalLM(TransformerConfig.preset("tiny", vocab_size=50, max_length=32)).eval()
    prompt = torch.randint(0, 50, (2, 4))
    sampled = generate(model, prompt, max_new_tokens=6, top_k=5,
                       generator=torch.Generator().manual_seed(3)).tokens
    _through_torch_topk(monkeypatch)
    assert torch.equal(filtered, filter_logits(logits, top_k=5))
    assert sampled == generate(model, prompt, max_new_tokens=6, top_k=5,
                               generator=torch.Generator().manual_seed(3)).tokens
