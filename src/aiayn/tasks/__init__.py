"""Tasks for the training engine (``aiayn.tasks.lm``: decoder-only language modelling)."""
