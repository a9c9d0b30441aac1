"""Helpers shared by tests that compare training steps."""

from __future__ import annotations


def step_gradients(model, loss_of):
    """One backward pass of ``loss_of(model)``: the loss and every parameter's gradient (cloned)."""
    model.zero_grad(set_to_none=True)
    loss = loss_of(model)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()
                           if p.grad is not None}
