"""Who talks to whom: the collectives and the process groups they run on.

Owns: the collectives a bucket issues (collectives.py), a unit's process groups (groups.py) and
how they are made from meshes (process_groups.py), the tags issued beside every collective and
checked before its data is used (collective_tags.py), and the heartbeats that name a peer which
stopped issuing them (peer_watch.py).

May import: runtime/core, ops, `fsdp_ext._C`.
"""
