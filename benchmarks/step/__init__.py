"""Training-step time and memory: fsdp_ext against DDP, torch FSDP1 and FSDP2 on the same model
(bench_step), inside transformers' Trainer (trainer_step), and where a step's time goes
(page_faults, optimizer_dtensor, profile_step)."""
