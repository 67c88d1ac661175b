"""Start-up from a pretrained checkpoint: fsdp_ext.load_pretrained against torch FSDP2's flow
(pretrained_load)."""
