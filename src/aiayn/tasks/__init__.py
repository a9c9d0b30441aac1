"""Tasks the training engine runs (see ``aiayn.training.Task``): classification, masked LM."""
