"""Summaries of bench_step.py's raw measurements: markdown table, JSON and a PNG bar chart."""
from __future__ import annotations

import os
import statistics

from ..common import machine, machine_line, markdown_table, mib, write_results
from ..planner import validate_plan

# The targets: fsdp_ext's step time divided by each peer's (world size 2, default case) and
# fsdp_ext's peak memory against DDP's and FSDP2's (>= 200M parameters, world size 4).
TIME_TARGETS = {"ddp": 1.2, "fsdp1": 0.9, "fsdp2": 0.6}
MEMORY_TARGETS = {"ddp": 0.35, "fsdp2": 1.0}


def summarize(raw: dict) -> dict:
    summary = {}
    for name, r in raw["results"].items():
        ranks = r["ranks"]
        summary[name] = dict(
            median_s=statistics.median(r["times"]), min_s=min(r["times"]), max_s=max(r["times"]),
            median_cpu_s=statistics.median(r["cpu"]), samples=len(r["times"]),
            alone_median_s=statistics.median(r["alone_times"]),
            train_peak_per_rank=[x["train_peak"] for x in ranks],
            tensor_peak_per_rank=[x["tensor_peak"] for x in ranks],
            tensor_init_peak_per_rank=[x["tensor_init_peak"] for x in ranks],
            init_peak_per_rank=[x["init_peak"] for x in ranks],
            base_rss_per_rank=[x["base_rss"] for x in ranks],
            tensors_rank0=ranks[0]["tensors"], memory_report_rank0=ranks[0].get("memory_report"),
            loss=statistics.mean(x["loss"] for x in ranks),
            rss_reset=all(x["rss_reset"] for x in ranks))
    ref = summary.get("fsdp_ext")
    for name, s in summary.items():
        if ref is not None:
            s["fsdp_ext_over_this_time"] = ref["median_s"] / s["median_s"]
            s["fsdp_ext_over_this_cpu"] = ref["median_cpu_s"] / s["median_cpu_s"]
            s["fsdp_ext_over_this_peak"] = max(ref["tensor_peak_per_rank"]) / max(
                1, max(s["tensor_peak_per_rank"]))
            s["fsdp_ext_over_this_rss"] = max(ref["train_peak_per_rank"]) / max(
                1, max(s["train_peak_per_rank"]))
    return summary


def targets(summary: dict, case: str, world_size: int) -> list[dict]:
    out = []
    if "fsdp_ext" not in summary:
        return out
    if case == "default" and world_size == 2:
        for peer, limit in TIME_TARGETS.items():
            if peer in summary:
                v = summary[peer]["fsdp_ext_over_this_time"]
                out.append(dict(what=f"step time fsdp_ext / {peer}", value=v, limit=limit,
                                met=v <= limit))
    if case == "large" and world_size == 4:
        for peer, limit in MEMORY_TARGETS.items():
            if peer in summary:
                v = summary[peer]["fsdp_ext_over_this_peak"]
                out.append(dict(what=f"peak tensor memory fsdp_ext / {peer}", value=v,
                                limit=limit, met=v <= limit))
                v = summary[peer]["fsdp_ext_over_this_rss"]
                out.append(dict(what=f"peak RSS above baseline fsdp_ext / {peer}", value=v,
                                limit=limit, met=v <= limit))
    return out


def table(summary: dict) -> str:
    header = ["framework", "median step (s)", "fsdp_ext ÷ this (time)", "samples",
              "CPU s/step/rank", "fsdp_ext ÷ this (CPU)", "peak tensors, max rank (MiB)",
              "fsdp_ext ÷ this (tensors)", "peak RSS above baseline, max rank (MiB)",
              "fsdp_ext ÷ this (RSS)",
              "params / grads / optim rank 0 (MiB)", "loss after phase 1"]
    rows = []
    for name, s in summary.items():
        t = s["tensors_rank0"]
        rows.append([name, f"{s['median_s']:.3f}", f"{s.get('fsdp_ext_over_this_time', 0):.2f}",
                     s["samples"], f"{s['median_cpu_s']:.3f}",
                     f"{s.get('fsdp_ext_over_this_cpu', 0):.2f}",
                     mib(max(s["tensor_peak_per_rank"])),
                     f"{s.get('fsdp_ext_over_this_peak', 0):.2f}",
                     mib(max(s["train_peak_per_rank"])),
                     f"{s.get('fsdp_ext_over_this_rss', 0):.2f}",
                     f"{mib(t['params'])} / {mib(t['grads'])} / {mib(t['optimizer'])}",
                     f"{s['loss']:.5f}"])
    return markdown_table(header, rows)


def chart(summary: dict, title: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(summary)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    times = [summary[n]["median_s"] for n in names]
    colors = ["tab:green" if n == "fsdp_ext" else "tab:gray" for n in names]
    bars = a.bar(names, times, color=colors)
    for bar, n in zip(bars, names):
        ratio = summary[n].get("fsdp_ext_over_this_time")
        if ratio is not None and n != "fsdp_ext":
            a.annotate(f"fsdp_ext ÷ this\n{ratio:.2f}", (bar.get_x() + bar.get_width() / 2,
                       bar.get_height()), ha="center", va="bottom", fontsize=8)
    a.set_ylabel("median step time (s)")
    a.set_title("step time (slowest rank)")
    width = 0.4
    xs = range(len(names))
    tensor_mib = [max(summary[n]["tensor_peak_per_rank"]) / 2**20 for n in names]
    rss_mib = [max(summary[n]["train_peak_per_rank"]) / 2**20 for n in names]
    b.bar([x - width / 2 for x in xs], tensor_mib,
          width, label="live tensors (allocator)", color="tab:blue")
    b.bar([x + width / 2 for x in xs], rss_mib,
          width, label="RSS above baseline", color="tab:orange")
    b.set_xticks(list(xs), names)
    b.set_ylabel("MiB")
    b.set_title("peak memory per rank during training (max rank)")
    b.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(raw: dict, args, case: str, stem: str, cmd: str) -> dict:
    """The report of one run of `cmd` (its command line): STEM.md, .json and .png in args.out."""
    summary = summarize(raw)
    m = machine()
    cfg = raw["config"]
    checks = targets(summary, case, args.world_size)
    timing = ("one step each in turn, all alive" if args.timing == "interleaved"
              else "each framework alone, one after the other")
    title = (f"{case} case ({cfg['n_layer']} x TransformerEncoderLayer d={cfg['d_model']}, batch "
             f"{cfg['batch']}x{cfg['seq']}/rank, AdamW), world size {args.world_size}, "
             f"{'NCCL' if raw['cuda'] else 'gloo CPU'}, {args.threads} thread(s)/rank; "
             f"timing: {timing}")
    md = [f"### {title}", "", f"`{cmd}`", "", f"Machine: {machine_line(m)}", "",
          table(summary), ""]
    for c in checks:
        md.append(f"- target {c['what']} <= {c['limit']}: {c['value']:.2f} "
                  f"({'met' if c['met'] else 'missed'})")
    plan = None
    if raw.get("plan") and "fsdp_ext" in summary:
        plan = validate_plan.compare(raw["plan"], summary["fsdp_ext"])
        md.extend(validate_plan.lines(plan))
    text = "\n".join(md) + "\n"
    print(text)
    data = dict(case=case, world_size=args.world_size, command=cmd, machine=m, config=cfg,
                args=vars(args), summary=summary, targets=checks, plan=raw.get("plan"),
                plan_check=plan, raw=raw["results"])
    write_results(args.out, stem, text, data)
    chart(summary, title + "\n" + machine_line(m), os.path.join(args.out, stem + ".png"))
    return data
