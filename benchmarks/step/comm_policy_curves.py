"""The main job's loss curve under each CommPolicy setting, against the exact run: one PNG, the
final logged loss and its deviation, the validation loss.

Runs examples/train.py (2 CPU ranks, gloo, the default 300 steps) once per setting with the same
seed and data; the curves are the logged mean losses (every --log-every steps).

    python -m benchmarks.step.comm_policy_curves [--steps 300] [--settings none int8 int8,int8 fp8,bf16]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from ..common import RESULTS, command, machine, machine_line, markdown_table, write_results

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SETTINGS = ["none", "int8", "int8,int8", "fp8,bf16"]


def run(setting: str, steps: int, directory: str) -> dict:
    path = os.path.join(directory, f"{setting.replace(',', '_')}.json")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = {**os.environ, "PYTHONPATH": ROOT,
           "OMP_NUM_THREADS": "1"}
    start = time.time()
    subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "examples/train.py",
                    "--steps", str(steps), "--comm-policy", setting, "--losses-json", path,
                    "--out-dir", os.path.join(directory, "out")],
                   cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(path) as f:
        result = json.load(f)
    result["seconds"] = time.time() - start
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--settings", nargs="+", default=SETTINGS)
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        results = {s: run(s, args.steps, directory) for s in args.settings}
    exact = results[args.settings[0]]["losses"][-1][1]
    rows = []
    for setting, r in results.items():
        final = r["losses"][-1][1]
        rows.append([setting, f"{final:.4f}", f"{100 * (final - exact) / exact:+.2f}%",
                     f"{r['validation_loss']:.4f}", f"{r['seconds']:.0f}"])
    text = (f"# The main job's loss under CommPolicy settings\n\n`{command(__spec__.name)}`\n\n"
            f"{machine_line(machine())}\n\n"
            + markdown_table(["--comm-policy", "final loss", "vs " + args.settings[0],
                              "validation loss", "run s (incl. start)"], rows) + "\n")
    write_results(args.out, "comm_policy_curves", text, {"steps": args.steps, "runs": results})
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for setting, r in results.items():
        steps, losses = zip(*r["losses"])
        ax.plot(steps, losses, label=f"--comm-policy {setting}")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_title("examples/train.py, 2 CPU ranks: exact vs quantized collectives")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "comm_policy_curves.png"), dpi=100)
    print(text)


if __name__ == "__main__":
    main()
