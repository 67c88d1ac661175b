"""The main job: train a small GPT (examples/models.py) on bytes of text with fsdp_ext.

    torchrun --standalone --nproc-per-node 2 examples/train.py            # CPU: gloo, a few minutes
    torchrun --standalone --nproc-per-node 8 examples/train.py --mixed-precision bf16   # GPUs: NCCL
    torchrun --standalone --nproc-per-node 2 examples/train.py --model moe   # the MoE decoder
    torchrun --standalone --nproc-per-node 4 examples/train.py --model moe --experts 4 --ep 2

With GPUs present each rank uses its local GPU and NCCL; otherwise the CPU and gloo. The script is
the same on one node or many (see docs/training.md and docs/api.md, "Several GPUs, several nodes"). Only rank 0 prints.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run as a file: the checkout's root, for examples.* and fsdp_ext
from examples import corpus, report  # noqa: E402
from examples.models import GPT, Block, GPTConfig  # noqa: E402
from examples.moe import MoEConfig, MoEDecoder  # noqa: E402
from examples.moe_ep import apply_expert_parallel  # noqa: E402

import fsdp_ext  # noqa: E402
from fsdp_ext.runtime.core.trace import recording  # noqa: E402


class _DefaultsHelp(argparse.HelpFormatter):
    """Every option's default at the end of its help: the value, "off" for a flag; an option whose
    absence means something other than a value says so itself, as "(default: ...)"."""

    def _get_help_string(self, action):
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS or "(default" in text:
            return text
        return f"{text} (default: {'off' if action.nargs == 0 else '%(default)s'})"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_DefaultsHelp)
    p.add_argument("--model", choices=["gpt", "moe"], default="gpt",
                   help="moe: examples/moe.py's decoder (the first block dense, the others "
                        "mixtures of --experts experts, top-2), sharded as torchtitan's "
                        "apply_fsdp_to_decoder shards it")
    p.add_argument("--experts", type=int, default=8,
                   help="--model moe: routed experts per MoE block; fewer than the ranks that "
                        "shard them: the expert weights are sharded along dim 1 (Shard(1))")
    p.add_argument("--ep", type=int, default=1,
                   help="--model moe: expert-parallel degree: each MoE block's experts spread over "
                        "groups of this many ranks, tokens sent to their experts by all-to-all "
                        "(examples/moe_ep.py); the experts then sharded over the world / ep "
                        "ranks holding the same ones, every other parameter over the world")
    p.add_argument("--n-layer", type=int, default=4, help="transformer blocks, one unit each")
    p.add_argument("--d-model", type=int, default=128, help="model width")
    p.add_argument("--n-head", type=int, default=4, help="attention heads")
    p.add_argument("--block-size", type=int, default=128, help="context length in bytes")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--lr", type=float, default=3e-3,
                   help="peak learning rate (AdamW; 5%% warm-up, then cosine to lr/10)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm (0: off)")
    p.add_argument("--mixed-precision", choices=["none", "bf16"], default="none",
                   help="bf16: parameters gathered in bf16, gradients reduced in fp32")
    p.add_argument("--sharding-strategy", default="FULL_SHARD",
                   choices=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"],
                   help="torch's ShardingStrategy names, for either --api")
    p.add_argument("--api", choices=["fully_shard", "fsdp1"], default="fully_shard",
                   help="fsdp1: FullyShardedDataParallel with ModuleWrapPolicy({Block})")
    p.add_argument("--prefetch-depth", type=int, default=1, help="units all-gathered ahead")
    p.add_argument("--comm-policy", default="none",
                   help="fewer bytes on the wire: PARAMS[,GRADS], e.g. int8, int8,int8, fp8,bf16 "
                        "(fsdp_ext.CommPolicy: parameter all-gathers int8|fp8, gradient "
                        "reductions int8|bf16; none: exact)")
    p.add_argument("--losses-json", help="write the logged (step, loss) pairs to this file, rank 0 "
                                         "(default: not written)")
    p.add_argument("--data", help="a text file to train on (default: this repository's sources)")
    p.add_argument("--checkpoint-dir", help="save the model here, at the end and every "
                                            "--save-every steps (default: no checkpoints)")
    p.add_argument("--save-every", type=int, default=0,
                   help="steps between checkpoints (0: only at the end)")
    p.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint-dir's latest checkpoint if it has one (a job "
                        "restarted by torchrun --max-restarts comes back from its last one)")
    p.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background while training goes on")
    p.add_argument("--stop-after", type=int, default=0,
                   help="end this run after so many steps, to fit a time slot and resume later "
                        "(0: run to --steps)")
    p.add_argument("--profile", action="store_true",
                   help="profile the last two steps: Chrome traces and a timeline PNG in --out-dir")
    p.add_argument("--out-dir", default="out", help="where --profile writes")
    p.add_argument("--describe", action="store_true",
                   help="run one forward/backward, print the unit plan and exit")
    p.add_argument("--log-every", type=int, default=10,
                   help="steps between loss readings (the progress bar, --losses-json)")
    p.add_argument("--seed", type=int, default=0, help="initial weights and batch order")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def checked_args(argv=None) -> argparse.Namespace:
    """The flags, parsed and checked (argument_problems) for the launch torchrun describes, before
    any process-group work. A mistake is printed once, by rank 0, with the usage, and rank 0
    exits with argparse's status 2, without a traceback; torchrun then reports it failed, as it
    does for any worker that exits nonzero. The other ranks (every rank runs this) exit quietly
    with status 0: one that failed first would make torchrun end rank 0 before it printed."""
    parser = build_parser()
    quiet = os.environ.get("RANK", "0") != "0"
    with contextlib.ExitStack() as stack:
        if quiet:  # --help and mistakes: rank 0 speaks for every rank
            devnull = stack.enter_context(open(os.devnull, "w"))
            stack.enter_context(contextlib.redirect_stdout(devnull))
            stack.enter_context(contextlib.redirect_stderr(devnull))
        try:
            args = parser.parse_args(argv)
            world = int(os.environ.get("WORLD_SIZE", "1"))
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            if problems := argument_problems(args, world, local_world):
                parser.error("; ".join(problems))
        except SystemExit as exc:
            raise SystemExit(0 if quiet else exc.code) from None
    return args


def argument_problems(args, world: int, local_world: int) -> list[str]:
    """What is wrong with `args` for `world` ranks, `local_world` of them per node ([]: nothing):
    each mistake that would otherwise fail after the process group is up, or deep in a step."""
    problems = [f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})"
                for name in ("n_layer", "d_model", "n_head", "block_size", "batch_size",
                             "grad_accum", "steps", "log_every", "experts")
                if getattr(args, name) < 1]
    if args.n_head >= 1 and args.d_model % args.n_head:
        problems.append(f"--d-model {args.d_model} must be a multiple of --n-head {args.n_head}")
    if args.model == "moe" and args.api != "fully_shard":
        problems.append("--model moe runs with --api fully_shard (torchtitan's FSDP2 calls)")
    problems += expert_parallel_problems(args, world)
    if args.sharding_strategy == "HYBRID_SHARD" and world % local_world:
        problems.append(f"--sharding-strategy HYBRID_SHARD needs the same ranks on every node "
                        f"(got {world} ranks, {local_world} on this one)")
    try:
        comm_policy(args.comm_policy)
    except (TypeError, ValueError) as exc:
        problems.append(f"--comm-policy {args.comm_policy}: {exc}")
    for flag, given in (("--resume", args.resume), ("--save-every", args.save_every),
                        ("--async-save", args.async_save)):
        if given and not args.checkpoint_dir:
            problems.append(f"{flag} needs --checkpoint-dir")
    if args.data is not None and not os.path.isfile(args.data):
        problems.append(f"--data {args.data}: no such file")
    return problems


def init_distributed() -> torch.device:
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; a plain `python train.py` runs as one rank."""
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT="29511").items():
        os.environ.setdefault(key, value)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def comm_policy(text: str):
    """--comm-policy PARAMS[,GRADS] as an fsdp_ext.CommPolicy (None for "none")."""
    if text == "none":
        return None
    params, _, grads = text.partition(",")
    return fsdp_ext.CommPolicy(param_gather=None if params in ("", "none") else params,
                               grad_reduce=grads or None)


def shard(model: GPT | MoEDecoder, args, device: torch.device):
    """Each transformer block is a unit, the root holds the embeddings (tied to the output layer);
    the MoE decoder's units are those of torchtitan's apply_fsdp_to_decoder (shard_moe)."""
    bf16 = args.mixed_precision == "bf16"
    policy = comm_policy(args.comm_policy)
    strategy = args.sharding_strategy
    if args.api == "fsdp1":
        mp = (fsdp_ext.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if bf16 else None)
        model = fsdp_ext.FullyShardedDataParallel(
            model, auto_wrap_policy=fsdp_ext.ModuleWrapPolicy({Block}), mixed_precision=mp,
            sharding_strategy=getattr(fsdp_ext.ShardingStrategy, strategy),
            device_id=device if device.type == "cuda" else None, comm_policy=policy)
        model.module.set_prefetch_depth(args.prefetch_depth, args.prefetch_depth)
        return model
    kwargs = dict(forward_prefetch=args.prefetch_depth, backward_prefetch=args.prefetch_depth,
                  comm_policy=policy)
    if bf16:
        kwargs["mp_policy"] = fsdp_ext.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                            reduce_dtype=torch.float32)
    if strategy == "NO_SHARD":
        kwargs["process_group"] = (None, dist.group.WORLD)  # (shard, replicate): replicate only
    elif strategy == "HYBRID_SHARD":  # shard within a node, replicate across nodes
        from torch.distributed.device_mesh import init_device_mesh
        local = int(os.environ["LOCAL_WORLD_SIZE"])
        kwargs["mesh"] = init_device_mesh(device.type, (dist.get_world_size() // local, local),
                                          mesh_dim_names=("replicate", "shard"))
    model.to(device)
    if args.model == "moe":
        return shard_moe(model, args, kwargs, device)
    for block in model.blocks:
        fsdp_ext.fully_shard(block, reshard_after_forward=strategy != "SHARD_GRAD_OP", **kwargs)
    return fsdp_ext.fully_shard(model, **kwargs)


def expert_parallel_problems(args, world: int) -> list[str]:
    """What an --ep that cannot work lacks ([]: nothing): it needs the MoE model, fully_shard's
    FULL_SHARD (the experts' own FSDP mesh is 1-D), and a degree dividing both the world and the
    expert count."""
    if args.ep == 1:
        return []
    problems = []
    if args.ep < 1:
        problems.append("a degree of at least 1")
    if args.model != "moe":
        problems.append("--model moe")
    if args.api != "fully_shard" or args.sharding_strategy != "FULL_SHARD":
        problems.append("--api fully_shard with --sharding-strategy FULL_SHARD (got "
                        f"{args.api}/{args.sharding_strategy})")
    if args.ep > 1 and world % args.ep:
        problems.append(f"a world size it divides (got {world} ranks)")
    if args.ep > 1 and args.experts % args.ep:
        problems.append(f"an expert count it divides (got --experts {args.experts})")
    return [f"--ep {args.ep} needs " + "; ".join(problems)] if problems else []


def shard_moe(model: MoEDecoder, args, kwargs: dict, device: torch.device) -> MoEDecoder:
    """fully_shard as torchtitan 0.3.0's apply_fsdp_to_decoder applies it: the embedding,
    [norm, lm_head] as one unit kept gathered after forward, each block, the root. An MoE block
    whose experts are fewer than the ranks sharding them gets its routed experts' weights
    ([num_experts, in, out]) sharded along dim 1 (Shard(1)), so that no rank holds padding alone;
    otherwise every parameter along dim 0. (torchtitan then sets each unit's gradient divide
    factor to 1.0 and divides the loss by the global token count itself; this script keeps the
    mean over ranks, the same gradients.)

    With --ep N > 1, first expert parallelism over the fast axis of an (efsdp, ep) = (world / N,
    N) mesh, as torchtitan lays it out; the experts (each rank's num_experts / N of them) are then
    sharded over `efsdp`, the ranks holding the same experts, every other parameter over the
    world. "Experts fewer than the ranks sharding them" counts efsdp * ep ranks, as torchtitan
    does. Each unit divides its gradient sums by the world size: an expert's gradient sums the
    tokens of its ep group (all-to-all) and then of the efsdp ranks, i.e. of the whole world, so
    efsdp's own size (the default divisor for a mesh) would leave it N times too large."""
    strategy = args.sharding_strategy
    reshard = strategy != "SHARD_GRAD_OP"
    if strategy == "NO_SHARD":
        shard_ranks = 1
    elif strategy == "HYBRID_SHARD":
        shard_ranks = int(os.environ["LOCAL_WORLD_SIZE"])
    else:
        shard_ranks = dist.get_world_size()
    efsdp = None
    if args.ep > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (shard_ranks // args.ep, args.ep),
                                mesh_dim_names=("efsdp", "ep"))
        apply_expert_parallel(model, mesh["ep"])
        efsdp = mesh["efsdp"]
    fsdp_ext.fully_shard(model.tok_embeddings, reshard_after_forward=reshard, **kwargs)
    fsdp_ext.fully_shard([model.norm, model.lm_head], reshard_after_forward=False, **kwargs)
    for block in model.layers.values():
        experts = block.moe.routed_experts.inner_experts if block.moe_enabled else None
        if experts is None or (efsdp is None and shard_ranks <= experts.num_experts):
            fsdp_ext.fully_shard(block, reshard_after_forward=reshard, **kwargs)
            continue
        expert_params = set(experts.parameters())
        dim = 1 if shard_ranks > experts.num_experts else 0

        def placement(p, expert_params=expert_params, dim=dim):
            if p not in expert_params:
                return None
            return Shard(dim) if efsdp is None else fsdp_ext.MeshPlacement(Shard(dim), efsdp)
        fsdp_ext.fully_shard(block, reshard_after_forward=reshard, **kwargs,
                             shard_placement_fn=placement)
    model = fsdp_ext.fully_shard(model, **kwargs)
    if efsdp is not None:
        for module in model.modules():
            if isinstance(module, fsdp_ext.FSDPModule):
                module.set_gradient_divide_factor(shard_ranks)
    return model


# ---- checkpoints ------------------------------------------------------------------------------------
def save_checkpoint(model, optimizer, step: int, directory: str, losses: list, pending=None,
                    async_save: bool = False):
    """Sharded model + optimizer state with torch.distributed.checkpoint, published atomically:
    a crash mid-save leaves the previous checkpoint in place, and any world size can resume it.
    The logged losses go with it (a resumed run's curve is whole). With `async_save` the files
    are written while training goes on; the previous save (`pending`) is published first."""
    if pending is not None:
        pending.result()
    saved = fsdp_ext.save_checkpoint(directory, model, optimizer, step,
                                     extra={"losses": list(losses)}, async_save=async_save)
    return saved if async_save else None


def load_checkpoint(model, optimizer, directory: str) -> tuple[int, list]:
    """Load the latest checkpoint into the sharded model and optimizer: its step and the losses
    logged up to it; (0, []) if there is none yet."""
    if not os.path.exists(os.path.join(directory, "latest")):
        return 0, []
    step, extra = fsdp_ext.load_checkpoint(directory, model, optimizer)
    return step, list((extra or {}).get("losses", []))


# ---- training ---------------------------------------------------------------------------------------
def lr_at(step: int, args) -> float:
    """Linear warm-up over 5% of the steps, then cosine decay to a tenth."""
    warmup = max(1, args.steps // 20)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train_step(model, optimizer, data, args, step: int, device) -> torch.Tensor:
    """One optimizer step over `grad_accum` micro-batches; returns the mean loss (detached)."""
    rank, total = dist.get_rank(), torch.zeros((), device=device)
    for micro in range(args.grad_accum):
        last = micro == args.grad_accum - 1
        # Gradients of all but the last micro-batch stay local (no reduce-scatter).
        ctx = contextlib.nullcontext()
        if args.api == "fsdp1" and not last:
            ctx = model.no_sync()
        elif args.api == "fully_shard":
            model.set_requires_gradient_sync(last)
        x, y = corpus.batch(data, args.batch_size, args.block_size, args.seed, step, rank, micro)
        with ctx:
            loss = model(x.to(device), y.to(device)) / args.grad_accum
            loss.backward()
        total += loss.detach()
    if args.grad_clip > 0:  # the norm over every rank's shards, as without sharding
        model.clip_grad_norm_(args.grad_clip)
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, args)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


@torch.no_grad()
def evaluate(model, data, args, device, batches: int = 4) -> float:
    losses = [model(*(t.to(device) for t in corpus.batch(data, args.batch_size, args.block_size,
                                                        args.seed + 1, i, dist.get_rank())))
              for i in range(batches)]
    loss = torch.stack(losses).mean()
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()


def build_model(args) -> GPT | MoEDecoder:
    """--model gpt: models.py's GPT; moe: moe.py's decoder, its first block dense, the others MoE
    blocks of --experts experts with expert hidden width 3/2 d_model (the same weights per seed)."""
    if args.model == "moe":
        cfg = MoEConfig(block_size=args.block_size, dim=args.d_model, n_heads=args.n_head,
                        layer_experts=(0,) + (args.experts,) * (args.n_layer - 1),
                        hidden_dim=3 * args.d_model // 2, dense_hidden_dim=4 * args.d_model)
        return MoEDecoder(cfg, seed=args.seed)
    return GPT(GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                         d_model=args.d_model))


def model_label(args) -> str:
    if args.model == "moe":
        ep = f", EP {args.ep}" if args.ep > 1 else ""
        return f"MoE ({args.experts} experts, top-2{ep})"
    return "GPT"


def main(argv=None) -> None:
    args = checked_args(argv)  # before any process-group work
    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model, start = build_model(args), 0
    n_params = model.num_params()
    model = shard(model, args, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    losses: list[tuple[int, float]] = []  # (step, mean loss) at each log
    if args.resume:
        start, losses = load_checkpoint(model, optimizer, args.checkpoint_dir)
        if rank == 0:
            print(f"resumed from {args.checkpoint_dir} at step {start}" if start else
                  f"no checkpoint in {args.checkpoint_dir} yet: starting at step 0")
    train, val = corpus.split(corpus.load_corpus(args.data))
    tokens_per_step = args.batch_size * args.block_size * args.grad_accum * world
    if args.describe:
        x, y = corpus.batch(train, args.batch_size, args.block_size, args.seed, 0, rank)
        model(x.to(device), y.to(device)).backward()  # the first step records the unit order
        text = fsdp_ext.describe(model, file=None)
        if rank == 0:
            print(text)
        return dist.destroy_process_group()
    if rank == 0:
        print(f"{model_label(args)} {n_params / 1e6:.2f}M parameters, {args.n_layer} layers, "
              f"d_model {args.d_model}; {world} ranks on {device.type} ({dist.get_backend()}), "
              f"{args.api}/{args.sharding_strategy}, precision {args.mixed_precision}; "
              f"corpus {len(train):,} bytes")
    bar = report.progress_bar(args.steps, start, enabled=rank == 0)
    end = min(args.steps, start + args.stop_after) if args.stop_after else args.steps
    # Profile the last two steps (never the first: it runs without prefetch).
    profile_at = max(start + 1, end - 2) if args.profile else -1
    profiler, step_times, tokens_per_s, recorded_from = None, [], 0.0, start
    pending = None  # an async save still being written
    with recording() as events:
        for step in range(start, end):
            if step == start + 1:
                events.clear()  # the first step learns the order and runs without prefetch
                recorded_from = step
            if step == profile_at:
                profiler = _start_profiler(device)
            t0 = time.perf_counter()
            loss = train_step(model, optimizer, train, args, step, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            if step > start and profiler is None:
                step_times.append(dt)
            tokens_per_s = tokens_per_step / dt
            if profiler is not None and step + 1 == min(profile_at + 2, end):
                _finish_profiler(profiler, events, args.out_dir, args, step + 1)
                profiler = None
            if (step + 1) % args.log_every == 0 or step + 1 == end:
                dist.all_reduce(loss)
                losses.append((step + 1, loss.item() / world))
                rows = report.gather_floats([*report.memory_mb(device)], device)
                bar.set_postfix(report.progress_fields(loss.item() / world, tokens_per_s, rows,
                                                       device.type == "cuda"), refresh=False)
            if args.checkpoint_dir and args.save_every and (step + 1) % args.save_every == 0:
                pending = save_checkpoint(model, optimizer, step + 1, args.checkpoint_dir,
                                          losses, pending, args.async_save)
            bar.update(1)
        bar.close()
        steps_recorded, recorded = end - recorded_from, list(events)
    if args.checkpoint_dir and (not args.save_every or end % args.save_every):
        pending = save_checkpoint(model, optimizer, end, args.checkpoint_dir, losses, pending,
                                  args.async_save)
    if pending is not None:
        pending.result()
    val_loss = evaluate(model, val, args, device)
    table = report.summary(step_times, tokens_per_step, recorded, steps_recorded, device,
                           {"validation loss": f"{val_loss:.4f} (bytes held out of training)"})
    if rank == 0:
        print(table)
        if args.losses_json:
            with open(args.losses_json, "w") as f:
                json.dump({"comm_policy": args.comm_policy, "losses": losses,
                           "validation_loss": val_loss}, f)
    dist.destroy_process_group()


def _start_profiler(device):
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    else:  # a CUDA build of torch on a machine without a GPU logs a harmless device-count error
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    profiler = torch.profiler.profile(activities=activities)
    profiler.__enter__()
    return profiler


def _finish_profiler(profiler, events, out_dir: str, args, step: int) -> None:
    """Chrome trace per rank; one PNG of the last profiled step (`step`, counted from 1) with every
    rank's lanes. Its figures are that one step's, so the title says which step it is: the summary
    at the end gives means over all steps, which differ from any one of them."""
    from fsdp_ext.diagnostics import timeline
    profiler.__exit__(None, None, None)
    os.makedirs(out_dir, exist_ok=True)
    rank = dist.get_rank()
    profiler.export_chrome_trace(os.path.join(out_dir, f"trace_rank{rank}.json"))
    per_rank = timeline.gather_to_rank0(timeline.last_step(events))
    if rank == 0:
        title = (f"fsdp_ext timeline of one step (step {step} of {args.steps}, profiled): "
                 f"{model_label(args)} {args.n_layer} layers d_model {args.d_model}, "
                 f"{dist.get_world_size()} ranks, {args.api}/{args.sharding_strategy}, "
                 f"prefetch depth {args.prefetch_depth}, "
                 f"{'bf16' if args.mixed_precision == 'bf16' else 'fp32'}")
        path = os.path.join(out_dir, "timeline.png")
        timeline.draw(per_rank, path, title)
        report.write(f"wrote {out_dir}/trace_rank*.json and {path} (step {step} alone; the "
                     "summary below gives means over the steps)")


if __name__ == "__main__":
    fsdp_ext.run_then_exit(main)  # without interpreter finalization: see fsdp_ext/shutdown.py
