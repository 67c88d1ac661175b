"""Training end to end against the unwrapped model and torch's FSDP: parity, random models, the
training loop, the main job's command line, MoE, restarts, faults, the soak."""
