"""The runtime: what happens to a unit in every training step (the FSDP timeline).

Owns: units and their hooks (unit.py; between steps and outside them: unit_lifecycle.py), what a
unit is built with (unit_config.py, the environment read once: env.py), which parameters a unit
owns and its buckets (param_buckets.py; bucket.py, the one owner of a bucket's tensors;
grad_state.py, what its gradient path keeps across micro-batches), where and over which mesh
each parameter is sharded (placements.py, groups.py), what each bucket puts on the wire and how
it comes back (wire.py: exact; wire_quantized.py: a CommPolicy's; wire_subclass.py: tensor
subclasses' hooks), where every element lives (layout.py), the DTensor parameters of fully_shard
(dtensor_params.py), the all-gather of a bucket (gather.py), the execution order and prefetch
(schedule.py), collectives and process groups (comm.py, process_groups.py), streams and buffer
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
