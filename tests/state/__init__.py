"""Model and optimizer state (fsdp_ext/state): state dicts, DCP checkpoints at other world sizes and
with torch's FSDP, pretrained loads."""
