"""The optimizers (fsdp_ext/optim): Muon against torch.optim.Muon on the unwrapped model, and on
fsdp_ext's shards against torch's fully_shard on the same script."""
