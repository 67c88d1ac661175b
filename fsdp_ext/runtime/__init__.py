"""The runtime: what happens to a unit in every training step (the FSDP timeline).

Owns: units and their hooks (unit.py; between steps and outside them: unit_lifecycle.py; a list
of modules as one unit: list_unit.py; their named states and the one function that moves them:
unit_state.py; what torch's setters change: unit_settings.py; what a unit checks for its user:
unit_checks.py), a unit's parameters as a whole and what the modules hold (unit_params.py;
the forward uses whose backward is still to come: backward_uses.py),
parameters that `to_empty`, `.to` or `load_state_dict(assign=True)` replaced (adopt.py), methods
registered to run forward (forward_methods.py), what a unit is built with (unit_config.py, the
environment read once: fsdp_ext/env.py; the options a root's schedule reads: schedule_options.py), which
parameters a unit owns and its buckets (param_buckets.py; bucket.py, the one owner of a bucket's
tensors; grad_state.py, what its gradient path keeps across micro-batches), where and over which
mesh each parameter is sharded (placement/, its own file map; groups.py), what each bucket puts on the wire and
how it comes back (wire.py: exact; wire_quantized.py: a CommPolicy's, comm_policy.py its
settings; wire_subclass.py: tensor subclasses' hooks), where every element lives (layout.py), the
DTensor parameters of fully_shard (dtensor_params.py), the all-gather of a bucket (gather.py), the
execution order and prefetch (schedule.py), collectives and process groups (comm.py,
process_groups.py), streams and buffer
lifetime (streams.py), the host's waits for what side streams read and copy (host_reads.py), the
gradient path (grads.py, finite.py), the host block cache (storage_cache.py), CPU offload
(offload.py), mixed precision (mixed_precision.py), meta-device init (deferred_init.py), the
tags issued beside every collective and checked before its data is used (collective_tags.py),
the heartbeats that name a peer which stopped issuing them (peer_watch.py), the event recorder
and profiler ranges the hooks write (trace.py), and the errors raised while training (errors.py).

May import: ops (and the compiled `fsdp_ext._C`). Every other layer imports it.

Start from `Unit` in unit.py (unshard -> use -> reshard -> post_backward) and `Schedule` in
schedule.py (who is gathered when); registry.py says how a module finds its unit.
"""
