"""Decoding: sampling from decoder-only models (``aiayn.decoding.sampling``)."""
