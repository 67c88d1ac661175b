"""What the tests import or launch, never a test itself: a module per topic (dist.py: gloo ranks;
launch.py: processes under a launcher; fsdp2.py, moe.py, placements.py, ...: the scripts each rank
runs), and `*_job.py`, a process a test starts as a file."""
