import pytest
import torch

from aiayn.masks import (attention_mask, band_mask, cache_window_mask, causal_mask,
                         check_attention_mask, check_padding_mask, padding_mask_from_ids,
                         padding_mask_from_lengths)


def test_padding_from_lengths_and_ids():
    mask = padding_mask_from_lengths(torch.tensor([3, 1, 0]), 4)
    assert mask.tolist() == [[True, True, True, False], [True, False, False, False],
                             [False] * 4]
    assert padding_mask_from_lengths(torch.tensor([2, 3])).shape == (2, 3)
    ids = torch.tensor([[5, 6, 0], [7, 0, 0]])
    assert padding_mask_from_ids(ids, pad_id=0).tolist() == [[True, True, False],
                                                             [True, False, False]]


def test_causal_mask_is_right_aligned():
    square = causal_mask(3)
    assert square.tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    # 2 new queries after 3 cached keys: they sit at positions 3 and 4.
    assert causal_mask(2, 5).tolist() == [[True, True, True, True, False], [True] * 5]
    with pytest.raises(ValueError, match="query_length <= key_length"):
        causal_mask(4, 3)


def test_a_ring_caches_window_mask_follows_its_key_slots_by_hand():
    """W = 4, a query at slot 9 over a ring holding slots 8, 9, 6, 7 (in that order), then a fresh
    ring at slot 1 (slots 0, 1, -2, -1: two not yet written); row 1 pads slot 7."""
    keys = torch.tensor([8, 9, 6, 7])
    assert cache_window_mask(torch.tensor([9]), keys, 4).tolist() == [[True] * 4]
    assert cache_window_mask(torch.tensor([9]), keys, 3).tolist() == [[True, True, False, True]]
    padding = torch.ones(2, 1, 1, 10, dtype=torch.bool)
    padding[1, 0, 0, 7] = False
    got = cache_window_mask(torch.tensor([9]), keys, 4, padding)  # (B, 1, T, S)
    assert got.shape == (2, 1, 1, 4)
    assert got[:, 0, 0].tolist() == [[True] * 4, [True, True, True, False]]
    fresh = cache_window_mask(torch.tensor([1]), torch.tensor([0, 1, -2, -1]), 4)
    assert fresh.tolist() == [[True, True, False, False]]


def test_band_mask_sees_the_window_minus_one_keys_on_either_side():
    """The encoder's window of W = 2: each query sees its neighbours and itself, by hand."""
    assert band_mask(5, 2).tolist() == [[True, True, False, False, False],
                                        [True, True, True, False, False],
                                        [False, True, True, True, False],
                                        [False, False, True, True, True],
                                        [False, False, False, True, True]]
    assert band_mask(3, 1).tolist() == torch.eye(3, dtype=torch.bool).tolist()  # itself only
    assert band_mask(4, 4).all() and not band_mask(5, 4)[0, 4]  # 4 away: out of a window of 4


def test_attention_mask_combines_padding_and_causal():
    padding = torch.tensor([[True, True, False]])
    combined = attention_mask(padding, causal=True)
    assert combined.shape == (1, 1, 3, 3)
    assert combined[0, 0].tolist() == [[True, False, False], [True, True, False],
                                       [True, True, False]]
    assert attention_mask(None) is None
    assert attention_mask(padding).shape == (1, 1, 1, 3)
    assert attention_mask(None, causal=True, query_length=2).shape == (2, 2)


def test_mask_checks_name_the_problem():
    with pytest.raises(ValueError, match="boolean"):
        check_attention_mask(torch.ones(2, 1, 1, 3), 2, 1, 3)
    with pytest.raises(ValueError, match="dim S"):
        check_attention_mask(torch.ones(2, 1, 1, 4, dtype=torch.bool), 2, 1, 3)
    with pytest.raises(ValueError, match=r"shape \(B=2, S=3\)"):
        check_padding_mask(torch.ones(2, 4, dtype=torch.bool), 2, 3)
    with pytest.raises(ValueError, match="boolean"):
        check_padding_mask(torch.ones(2, 3, dtype=torch.long), 2, 3)
