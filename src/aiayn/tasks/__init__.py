"""Tasks the training engine runs (each implements ``aiayn.training.Task``)."""
