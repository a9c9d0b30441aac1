"""Decoding: greedy and beam search for encoder-decoder models (``greedy``, ``beam``), sampling from
decoder-only models (``sampling``)."""
