"""Training-step time and memory: fsdp_ext against DDP, torch FSDP1 and FSDP2 on the same model
(bench_step), inside transformers' Trainer (trainer_step) and torchtitan's (titan_step, with
each run's gradient reductions), the gradient reduction's collective on gloo (grad_collective),
and where a step's time goes (page_faults, optimizer_dtensor, profile_step)."""
