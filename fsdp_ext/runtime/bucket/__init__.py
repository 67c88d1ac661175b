"""A unit's buckets: its parameters grouped by (placement's mesh, dtype, requires_grad, wire).

Owns: which parameters a unit owns and its buckets (param_buckets.py), the one owner of a
bucket's tensors (bucket.py), where every element lives (layout.py), what its gradient path keeps
across micro-batches (grad_state.py), the all-gather of a bucket (gather.py), the gradient path
(grads.py; finite.py, the non-finite check), meta-device init (deferred_init.py), and parameters
that `to_empty`, `.to` or `load_state_dict(assign=True)` replaced (adopt.py).

May import: runtime/wire, runtime/placement, runtime/comm, runtime/core, ops.
"""
