"""The runtime's ground floor: what every other part of it uses and that needs none of them.

Owns: streams and buffer lifetime (streams.py, the seam a stream backend plugs into), the host's
waits for what side streams read and copy (host_reads.py), the host block cache (storage_cache.py),
CPU offload (offload.py), mixed precision (mixed_precision.py), how a module finds its unit
(registry.py), the event recorder and profiler ranges the hooks write (trace.py), and the errors
raised while training (errors.py).

May import: ops, `fsdp_ext._C`, fsdp_ext/env.py; no other part of the runtime.
"""
