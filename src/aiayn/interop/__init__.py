"""Loading weights from other implementations (torch.nn here; Hugging Face formats in their modules).

Optional dependencies (``transformers``) are imported only inside the modules that need them.
"""
