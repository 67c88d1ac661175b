"""Switches that make other libraries' FSDP paths shard with fsdp_ext.

Owns: one module per library (accelerate.py: Hugging Face accelerate and transformers' Trainer;
lightning.py: a Lightning strategy); each imports its library, so none is imported by the package.
May import: the public API's layers (api, state, runtime) and the libraries they integrate with.
"""
