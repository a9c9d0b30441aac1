"""Opt-in speed for a plain aiayn model, kept beside it: nothing here changes what a model computes.

``prepare_for_inference(model, InferenceOptions(...))`` returns an ``InferenceEngine`` that owns the
compiled decoding steps it made; drop the engine and they go with it.
"""

from aiayn.fast.inference import InferenceEngine, InferenceOptions, prepare_for_inference

__all__ = ["InferenceEngine", "InferenceOptions", "prepare_for_inference"]
