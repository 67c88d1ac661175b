"""What the runtime costs the host thread: per unit against FSDP2 (host_overhead), where the hooks'
time goes within a unit (hook_overhead), what the per-call guards cost (check_hooks)."""
