"""What the trainer shows: per-rank memory, the progress bar's numbers and the closing summary.

Every function that gathers is called by all ranks; only rank 0 prints.
"""
from __future__ import annotations

import os
import resource
import statistics
import sys

import torch
import torch.distributed as dist

from fsdp_ext.runtime.comm.collectives import all_gather_into
from fsdp_ext.diagnostics.timeline import comm_stats


def memory_mb(device: torch.device) -> tuple[float, float]:
    """(peak resident set size of this process, peak CUDA memory allocated), in MiB."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    cuda = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0
    return rss, cuda


def gather_floats(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's `values`, on every rank (one small all-gather)."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    out = torch.empty(dist.get_world_size() * len(values), dtype=torch.float64, device=device)
    all_gather_into(out, mine, dist.group.WORLD, async_op=False)
    return out.view(-1, len(values)).cpu().tolist()


def progress_bar(total: int, initial: int, enabled: bool):
    """A tqdm bar on rank 0, as wide as the terminal (it follows a resize); without tqdm
    installed, a line per update instead."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _Lines(total, initial, enabled)
    # A terminal that reports a size of 0 (some containers' and CI consoles do): tqdm would trim
    # every line to nothing, so the bar takes a fixed 80 columns (and tqdm's default 20 rows).
    fixed = _reports_no_size(sys.stderr)
    # leave=True: the last state stays drawn even when another tqdm bar of the process is open
    # (tqdm then places this one below it and, by default, erases it on close).
    return tqdm(total=total, initial=initial, disable=not enabled, unit="step", leave=True,
                dynamic_ncols=not fixed, ncols=80 if fixed else None,
                nrows=20 if fixed else None, mininterval=1.0)


def _reports_no_size(stream) -> bool:
    """Whether `stream` is a terminal whose reported size has no room for a line."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):  # not a terminal: tqdm writes whole lines
        return False
    return size.columns < 2 or size.lines < 2


def write(message: str) -> None:
    """Print without breaking the progress bar."""
    try:
        from tqdm import tqdm
        tqdm.write(message)
    except ImportError:
        print(message, flush=True)


class _Lines:
    def __init__(self, total: int, initial: int, enabled: bool):
        self.n, self.total, self.enabled, self.fields = initial, total, enabled, {}

    def set_postfix(self, fields: dict, refresh: bool = True) -> None:
        self.fields = fields
        if self.enabled:
            print(f"step {self.n + 1}/{self.total} "
                  + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        pass


def progress_fields(loss: float, tokens_per_s: float, rows: list[list[float]], cuda: bool) -> dict:
    """tqdm postfix: global mean loss, tokens/s and each rank's peak memory."""
    col = 1 if cuda else 0
    mem = "/".join(f"{r[col]:.0f}" for r in rows)
    return {"loss": f"{loss:.3f}", "tok/s": f"{tokens_per_s:,.0f}",
            ("cuda MB" if cuda else "rss MB"): mem}


def summary(step_times: list[float], tokens_per_step: int, events, steps_recorded: int,
            device: torch.device, extra: dict[str, str]) -> str | None:
    """The closing table on rank 0 (None elsewhere).

    Communication comes from the runtime's recorded events: issue to end of wait is the time in
    flight; its launch (copy-in or gradient pack, queueing) and the wait for it are exposed (no
    model compute meanwhile); the rest is hidden behind compute (an upper bound: a collective may
    finish before it is waited for).
    """
    stats = comm_stats(events)
    per_step = max(steps_recorded, 1)
    mine = [*memory_mb(device)]
    for kind in ("all_gather", "reduce_scatter"):
        mine += [stats[kind]["in_flight"] / per_step, stats[kind]["exposed"] / per_step]
    median = statistics.median(step_times) if step_times else float("nan")
    mine.append(median)
    rows = gather_floats(mine, device)
    if dist.get_rank() != 0:
        return None
    lines = [f"{k:<28}{v}" for k, v in extra.items()]
    lines += [f"{'step time (median)':<28}{median * 1e3:,.1f} ms over {len(step_times)} steps "
              "(first step and profiled steps excluded)",
              f"{'throughput':<28}{tokens_per_step / median:,.0f} tokens/s "
              f"({tokens_per_step:,} tokens per step)", ""]
    head = (f"{'rank':>4} {'step ms':>8} {'peak RSS MB':>12} {'peak CUDA MB':>13} "
            f"{'AG in flight':>13} {'AG exposed':>11} {'AG hidden':>10} "
            f"{'RS in flight':>13} {'RS exposed':>11} {'RS hidden':>10}")
    lines += [head, "-" * len(head)]
    for rank, r in enumerate(rows):
        rss, cuda, ag_fly, ag_exp, rs_fly, rs_exp, step = r
        ms = lambda s: f"{s * 1e3:.1f} ms"  # noqa: E731
        lines.append(f"{rank:>4} {step * 1e3:>8.1f} {rss:>12,.0f} {cuda:>13,.0f} "
                     f"{ms(ag_fly):>13} {ms(ag_exp):>11} {ms(max(ag_fly - ag_exp, 0)):>10} "
                     f"{ms(rs_fly):>13} {ms(rs_exp):>11} {ms(max(rs_fly - rs_exp, 0)):>10}")
    lines += [f"step ms: the median step time; AG / RS: all-gather / reduce-scatter time per step, "
              f"the mean over the {steps_recorded} steps recorded (all but the first)",
              "in flight = issue to end of its wait; exposed = launching + waiting for it; "
              "hidden = in flight while the model computed (upper bound)"]
    return "\n".join(lines)
