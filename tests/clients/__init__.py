"""Real clients run with fsdp_ext swapped in, against their own run with torch's FSDP: torchtitan's
trainer and flow, transformers' Trainer with accelerate, Lightning."""
