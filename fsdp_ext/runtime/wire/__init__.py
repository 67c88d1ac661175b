"""What each bucket puts on the wire and how it comes back: one wire format per bucket.

Owns: the exact format (exact.py), a CommPolicy's quantized one (quantized.py; its settings:
comm_policy.py), and tensor subclasses' all-gather hooks (subclass.py).

May import: runtime/placement, runtime/comm, runtime/core, ops.
"""
