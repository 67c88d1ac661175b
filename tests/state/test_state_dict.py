"""State dicts of a sharded model against an unwrapped single-process model (CPU, gloo).

One launch per world size runs every check (tests/helpers/state_dict.py): the sharded form
(ShardedTensor per parameter, flattened) right after wrapping, load_state_dict from full and
sharded forms with strict key and shape errors, FSDP1's state_dict_type with torch's own
config classes, optimizer state dicts (full = the reference optimizer's state by name; loading into
an optimizer that never stepped), the safetensors export read back with the `safetensors`
package, and DCP resharding: saved at world 4 (FULL_SHARD and HSDP), loaded at world 3.
"""
import pytest

from ..helpers.dist import run_distributed
from ..helpers.state_dict import state_dict_worker


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("state_dict"))


# Order matters: world 3 loads what world 4 saved. World 2 repeats the checks at another size
# (the safetensors export at world 2 also runs in test_checkpoint's world-2 launch).
@pytest.mark.parametrize("world_size", [4, 3, pytest.param(2, marks=pytest.mark.slow)])
def test_state_dicts(world_size, shared_dir):
    run_distributed(state_dict_worker, world_size, shared_dir)
