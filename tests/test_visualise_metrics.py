"""Head-pattern metrics on hand-built attention matrices whose values are known exactly."""

import math

import pytest
import torch

from aiayn.visualise.metrics import (BROAD_ENTROPY, MASS_THRESHOLD, PatternAccumulator,
                                     head_pattern_metrics, label_head, write_metrics)

T = 5


def one_head(matrix):
    return torch.as_tensor(matrix, dtype=torch.float64)[None, None]  # (1, 1, T, S)


def identity():
    return torch.eye(T, dtype=torch.float64)


def previous():
    w = torch.zeros(T, T, dtype=torch.float64)
    w[0, 0] = 1.0  # the first token has no previous token: it attends to itself
    for i in range(1, T):
        w[i, i - 1] = 1.0
    return w


def first():
    w = torch.zeros(T, T, dtype=torch.float64)
    w[:, 0] = 1.0
    return w


def causal_uniform():
    w = torch.zeros(T, T, dtype=torch.float64)
    for i in range(T):
        w[i, : i + 1] = 1.0 / (i + 1)
    return w


def test_identity_is_a_self_head():
    (row,) = head_pattern_metrics(one_head(identity()))
    assert row["entropy"] == 0.0 and row["normalised_entropy"] == 0.0
    assert row["max_weight"] == 1.0 and row["self_mass"] == 1.0 and row["local_mass"] == 1.0
    assert row["previous_mass"] == 0.0
    assert row["first_mass"] == pytest.approx(1 / T, abs=1e-15)
    assert row["last_mass"] == pytest.approx(1 / T, abs=1e-15)
    assert row["label"] == "self"


def test_previous_token_head():
    (row,) = head_pattern_metrics(one_head(previous()))
    assert row["previous_mass"] == 1.0  # averaged over rows 1..T-1 only
    assert row["self_mass"] == pytest.approx(1 / T, abs=1e-15)  # row 0 only
    assert row["first_mass"] == pytest.approx(2 / T, abs=1e-15)  # rows 0 and 1
    assert row["last_mass"] == 0.0
    assert row["label"] == "previous-token"


def test_first_token_head_under_causal_attention():
    (row,) = head_pattern_metrics(one_head(first()), causal=True)
    assert row["first_mass"] == 1.0 and row["entropy"] == 0.0
    assert row["normalised_entropy"] == 0.0
    assert row["previous_mass"] == pytest.approx(1 / (T - 1), abs=1e-15)  # row 1 only
    assert row["label"] == "first-token"


def test_uniform_head_is_broad_with_exact_entropy_and_local_mass():
    w = torch.full((T, T), 1.0 / T, dtype=torch.float64)
    (row,) = head_pattern_metrics(one_head(w), window=1)
    assert row["entropy"] == pytest.approx(math.log(T), abs=1e-12)
    assert row["normalised_entropy"] == pytest.approx(1.0, abs=1e-12)
    assert row["max_weight"] == pytest.approx(1 / T, abs=1e-15)
    # window 1: rows 0 and T-1 see 2 keys, the others 3
    assert row["local_mass"] == pytest.approx((2 * 2 + 3 * (T - 2)) / T / T, abs=1e-12)
    assert row["label"] == "broad"


def test_causal_uniform_head():
    (row,) = head_pattern_metrics(one_head(causal_uniform()), causal=True)
    assert row["entropy"] == pytest.approx(sum(math.log(i + 1) for i in range(T)) / T, abs=1e-12)
    assert row["normalised_entropy"] == pytest.approx(1.0, abs=1e-12)  # rows 1.. (row 0: one key)
    expected_first = sum(1 / (i + 1) for i in range(T)) / T
    assert row["first_mass"] == pytest.approx(expected_first, abs=1e-12)
    assert row["self_mass"] == pytest.approx(expected_first, abs=1e-12)
    assert row["previous_mass"] == pytest.approx(sum(1 / (i + 1) for i in range(1, T)) / (T - 1),
                                                 abs=1e-12)
    assert row["label"] == "broad"  # no mass reaches MASS_THRESHOLD


def test_padding_rows_and_keys_are_ignored():
    """Sequence A (5 real tokens) is the identity; B has 3 real tokens attending to its last real
    token, and garbage in its padded rows that must not count."""
    a = identity()
    b = torch.full((T, T), 0.2, dtype=torch.float64)  # padded rows: uniform garbage
    b[:3] = 0.0
    b[:3, 2] = 1.0
    weights = torch.stack([a, b])[:, None]  # (2, 1, T, T)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    (row,) = head_pattern_metrics(weights, mask, mask)
    # 8 real rows: last mass A 1 (row 4) + B 3 -> 4 / 8; self A 5 + B 1 (row 2) -> 6 / 8
    assert row["last_mass"] == pytest.approx(4 / 8, abs=1e-15)
    assert row["self_mass"] == pytest.approx(6 / 8, abs=1e-15)
    assert row["first_mass"] == pytest.approx(1 / 8, abs=1e-15)
    assert row["max_weight"] == 1.0 and row["entropy"] == 0.0
    assert row["label"] == "self"


def test_accumulating_batches_equals_one_batch_row_weighted():
    torch.manual_seed(0)
    weights = torch.rand(3, 2, T, T, dtype=torch.float64).softmax(-1)
    mask = torch.tensor([[True] * 5, [True] * 4 + [False], [True] * 2 + [False] * 3])
    whole = PatternAccumulator(n_heads=2)
    whole.update(weights, mask, mask)
    parts = PatternAccumulator(n_heads=2)
    for index in range(3):
        parts.update(weights[index:index + 1], mask[index:index + 1], mask[index:index + 1])
    for name, values in whole.means().items():
        assert values == pytest.approx(parts.means()[name], abs=1e-12), name


def test_cross_attention_shapes_and_several_heads():
    weights = torch.zeros(1, 2, 3, 4, dtype=torch.float64)
    weights[0, 0, :, 3] = 1.0  # head 0: the last source token
    weights[0, 1, :, :] = 0.25  # head 1: uniform
    rows = head_pattern_metrics(weights)
    assert [row["head"] for row in rows] == [0, 1]
    assert rows[0]["last_mass"] == 1.0 and rows[0]["label"] == "last-token"
    assert rows[1]["label"] == "broad"


def test_labels_thresholds_and_ties():
    assert label_head({"previous_mass": MASS_THRESHOLD, "self_mass": 0.1}) == "previous-token"
    assert label_head({"first_mass": 0.6, "self_mass": 0.7}) == "self"
    assert label_head({"first_mass": 0.6, "previous_mass": 0.6}) == "previous-token"
    assert label_head({"first_mass": 0.4, "normalised_entropy": BROAD_ENTROPY}) == "broad"
    assert label_head({"first_mass": 0.4, "self_mass": 0.4, "normalised_entropy": 0.5}) == "other"


@pytest.mark.parametrize("weights, message", [
    (torch.ones(2, 3, 3), "shape"),
    (torch.full((1, 1, 2, 2), float("nan")), "NaN"),
])
def test_bad_weights(weights, message):
    with pytest.raises(ValueError, match=message):
        head_pattern_metrics(weights)


def test_left_padding_or_bad_mask_is_an_error():
    weights = torch.full((1, 1, 3, 3), 1 / 3)
    with pytest.raises(ValueError, match="right-padded"):
        head_pattern_metrics(weights, torch.tensor([[False, True, True]]))
    with pytest.raises(ValueError, match="query_mask"):
        head_pattern_metrics(weights, torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="heads"):
        PatternAccumulator(n_heads=2).update(weights)


def test_write_metrics_json_and_csv(tmp_path):
    import csv
    import json

    rows = head_pattern_metrics(one_head(identity()))
    rows[0]["previous_mass"] = math.nan  # a metric no row had: null in JSON, empty in CSV
    write_metrics(rows, tmp_path / "m.json", tmp_path / "m.csv")
    loaded = json.loads((tmp_path / "m.json").read_text())
    assert loaded[0]["self_mass"] == 1.0 and loaded[0]["previous_mass"] is None
    (record,) = list(csv.DictReader(open(tmp_path / "m.csv")))
    assert record["label"] == "self" and float(record["self_mass"]) == 1.0


@pytest.mark.parametrize("causal", [False, True])
def test_a_head_uniform_over_its_sliding_window_is_broad(causal):
    """A layer with a sliding window W lets query i see only the keys less than W positions away
    (and not later ones when causal): a head spread evenly over them has normalised entropy 1,
    which the count of all real keys made less than BROAD_ENTROPY."""
    band, w = 3, torch.zeros(8, 8, dtype=torch.float64)
    for i in range(8):
        keys = [j for j in range(8) if abs(i - j) < band and (j <= i or not causal)]
        w[i, keys] = 1.0 / len(keys)
    (row,) = head_pattern_metrics(one_head(w), causal=causal, band=band)
    assert row["normalised_entropy"] == pytest.approx(1.0, abs=1e-12)
    assert row["label"] == "broad"
    (unbanded,) = head_pattern_metrics(one_head(w), causal=causal)
    assert unbanded["normalised_entropy"] < BROAD_ENTROPY
    with pytest.raises(ValueError, match="band must be >= 1 or None, got 0"):
        PatternAccumulator(n_heads=1, band=0)


def test_measured_patterns_keep_each_sliding_layer_to_its_window():
    """measure_patterns on a model whose second layer slides: that layer's normalised entropy is
    the entropy over log(keys within the window), hand-computed from its own maps; the global
    layer's over log(all keys)."""
    from aiayn import CausalLM, TransformerConfig
    from aiayn.visualise.attention_report import Example, measure_patterns
    from aiayn.visualise.collect import collect_attention

    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=40, d_model=32, n_heads=2, d_ff=64, n_decoder_layers=2,
                               max_length=32, dropout=0.0, positions="rotary", sliding_window=3,
                               sliding_window_layers=[1])
    model = CausalLM(config).eval()
    ids = list(range(3, 13))
    rows = measure_patterns(model, [Example(ids, [str(i) for i in ids])])
    _, maps = collect_attention(model, torch.tensor([ids]))
    i, j = torch.arange(10)[:, None], torch.arange(10)[None, :]
    for layer, band in ((0, 10), (1, 3)):
        w = maps.decoder[layer][0].double()  # (H, T, T)
        allowed = ((j <= i) & (i - j < band)).sum(-1).double()  # (T,)
        entropy = -(w * w.clamp_min(1e-300).log()).sum(-1)  # (H, T)
        expected = (entropy[:, 1:] / allowed[1:].log()).mean(-1)  # row 0 sees one key
        got = [r["normalised_entropy"] for r in rows if r["layer"] == layer]
        assert got == pytest.approx(expected.tolist(), abs=1e-9)
