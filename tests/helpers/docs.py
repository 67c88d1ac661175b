"""Runs one docs page's python blocks on one rank of a torchrun launch (tests/project/test_docs.py).

    torchrun --standalone --nproc-per-node 2 tests/helpers/docs.py BLOCKS.json

BLOCKS.json holds [[label, code], ...]; the blocks run in order in one namespace, as one script
would, with nothing set up beforehand (no process group: a block that needs one makes it, as a
user's script does). Each rank that finishes writes `docs-ok-rank<RANK>` into the working
directory; a failing block prints its label and traceback and ends the rank with status 1.
"""
import json
import linecache
import os
import sys
import traceback

import torch.distributed as dist

import fsdp_ext


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as f:
        blocks = json.load(f)
    rank = os.environ.get("RANK", "0")
    cwd = os.getcwd()
    namespace = {"__name__": "__main__"}
    for label, code in blocks:
        linecache.cache[label] = (len(code), None, code.splitlines(True), label)
        try:
            exec(compile(code, label, "exec"), namespace)
        except BaseException:
            print(f"DOCS-FAILED rank {rank}: {label}", file=sys.stderr, flush=True)
            traceback.print_exc()
            fsdp_ext.exit_without_finalization(1)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    with open(os.path.join(cwd, f"docs-ok-rank{rank}"), "w") as f:
        f.write(str(len(blocks)))
    fsdp_ext.exit_without_finalization(0)


if __name__ == "__main__":
    main()
