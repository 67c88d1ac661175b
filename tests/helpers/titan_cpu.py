"""torchtitan's own trainer on CPU (gloo), with torch's FSDP2 or fsdp_ext.

`python -m tests.helpers.titan_cpu --fsdp torch|fsdp_ext [torchtitan's arguments]`, one process per rank
(torchrun, or any launcher that sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT),
applies the shims below and calls `torchtitan.train.main()`; `python -m tests.helpers.titan_cpu
--make-assets DIR` writes the tokenizer and corpus the runs read (torchtitan's wheel ships
neither). torchtitan 0.3.0 needs on a machine without an accelerator:

- its device type: `torchtitan.tools.utils` takes `_get_available_device_type() or "cuda"`, and
  several modules import `device_type` / `device_module` / `get_local_device` by value;
- a device-memory monitor: it reads `torch.cuda`'s allocator statistics; the stand-in reports the
  process's peak resident set (VmHWM, reset through /proc/self/clear_refs);
- an attention with a CPU backward: the model's FlexAttention is compiled with inductor, which has
  no CPU backward, and torch's eager `flex_attention` refuses inputs that require grad on CPU
  (only a device check: its dense reference has a backward). The shim runs the eager reference
  with that check lifted, so the model keeps its block-causal, per-document masks;
- its `DistMuon` (a parameter group's optimizer in its Kimi configs): streams and a CUDA check
  answered for CPU ranks (tests/helpers/dist_muon_cpu.py), its math untouched.

With `--fsdp fsdp_ext`, one assignment swaps the implementation: `fully_shard` in
`torchtitan.distributed.fsdp` (the only place the llama3 path calls it from). Its `FSDPModule`
checks keep working, as fsdp_ext's modules subclass torch's `FSDPModule`.

The rank that logs (rank 0) also writes every metrics record torchtitan's `MetricsProcessor`
produces (exact floats) as JSON lines to `$TITAN_CPU_METRICS` when that is set.
"""
from __future__ import annotations

import json
import os
import random
import sys
from types import SimpleNamespace

import torch

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
VOCAB_SIZE = 2048     # llama3_debugmodel's vocab_size: every token id must be below it


# ---------------------------------------------------------------- tokenizer and corpus

def _corpus(n_docs: int = 600, seed: int = 0) -> list[str]:
    """Documents of pseudo-words with a little structure (a fixed lexicon, word bigrams that
    recur), so that a few training steps visibly lower the loss."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    lexicon = sorted({"".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(900)})
    follow = {w: rng.sample(lexicon, 4) for w in lexicon}
    docs = []
    for _ in range(n_docs):
        word, words = rng.choice(lexicon), []
        for i in range(rng.randint(20, 160)):
            words.append(word + ("." if i % 12 == 11 else ""))
            word = rng.choice(follow[word]) if rng.random() < 0.8 else rng.choice(lexicon)
        docs.append(" ".join(words).capitalize())
    return docs


def make_assets(root: str) -> tuple[str, str]:
    """Write a byte-level BPE tokenizer (VOCAB_SIZE ids, Llama 3's BOS/EOS names) and a
    `c4_test`-style corpus (JSON lines with a "text" field) under `root`.

    Returns (hf_assets_path, dataset_path) for `--hf_assets_path` / `--dataloader.dataset_path`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok_dir, data_dir = os.path.join(root, "tokenizer"), os.path.join(root, "c4_test")
    os.makedirs(tok_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    docs = _corpus()
    with open(os.path.join(data_dir, "data.json"), "w") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(docs, trainer)
    assert tokenizer.get_vocab_size() <= VOCAB_SIZE
    tokenizer.save(os.path.join(tok_dir, "tokenizer.json"))
    # torchtitan's HuggingFaceTokenizer reads BOS/EOS from here and then adds them itself
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "add_bos_token": True,
                   "add_eos_token": True}, f)
    return tok_dir, data_dir


# ---------------------------------------------------------------- CPU shims

def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return -1


class _CpuDeviceModule:
    """What torchtitan calls on its `device_module` (torch.cuda on a GPU), answered for the CPU.
    Memory statistics are the process's peak RSS: there is no caching allocator to ask."""

    @staticmethod
    def set_device(device): pass

    @staticmethod
    def current_device() -> int: return 0      # an index, as barrier(device_ids=[...]) wants

    @staticmethod
    def device_count() -> int: return 1

    @staticmethod
    def synchronize(device=None): pass

    @staticmethod
    def empty_cache(): pass

    @staticmethod
    def is_available() -> bool: return True

    @staticmethod
    def get_device_name(device=None) -> str: return "cpu"

    @staticmethod
    def get_device_properties(device=None):
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return SimpleNamespace(name="cpu", total_memory=ram)

    @staticmethod
    def reset_peak_memory_stats(device=None):
        try:   # "5" resets the peak resident set size (VmHWM) to the current one
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    @staticmethod
    def memory_stats(device=None) -> dict:
        peak = _peak_rss_bytes()
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak,
                "num_alloc_retries": 0, "num_ooms": 0}


def _rebind(replacements: dict[str, tuple[object, object]]) -> None:
    """Set every torchtitan module global bound to an original object (imported by value) to its
    replacement: {name: (original, replacement)}."""
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("torchtitan") or mod is None:
            continue
        for name, (original, replacement) in replacements.items():
            if getattr(mod, name, None) is original and original is not replacement:
                setattr(mod, name, replacement)


def _cpu_flex_attention():
    """torch's eager flex_attention (dense reference, with a backward) with the CPU requires-grad
    refusal lifted; every other device check still runs."""
    import torch.nn.attention.flex_attention as fa

    check = fa._validate_device

    def validate_device(query, key, value):
        check(query.detach(), key.detach(), value.detach())

    fa._validate_device = validate_device
    return fa.flex_attention


def apply_cpu_shims() -> None:
    import torchtitan.tools.utils as tt_utils

    cpu = torch.device("cpu")
    originals = {"device_type": tt_utils.device_type, "device_module": tt_utils.device_module,
                 "get_local_device": tt_utils.get_local_device}
    # torchtitan's own modules are imported after this line, so most pick up the CPU values;
    # _rebind below catches any that bound the originals earlier
    tt_utils.device_type, tt_utils.device_module = "cpu", _CpuDeviceModule()
    tt_utils.get_local_device = lambda: cpu

    import torchtitan.train  # noqa: F401  (the trainer and everything it imports)
    import torchtitan.models.llama3.config_registry  # noqa: F401
    from torchtitan.models.common.attention import FlexAttention

    _rebind({name: (value, getattr(tt_utils, name)) for name, value in originals.items()})
    # read through the class (FlexAttention._compiled_flex_attn), so a plain function will do
    FlexAttention._compiled_flex_attn = _cpu_flex_attention()
    _force_sum_reduction_on_gloo()
    _uneven_all_to_all_on_gloo()
    from . import dist_muon_cpu
    dist_muon_cpu.apply()
    _flex_attention_compiled_as_the_rest()


def _flex_attention_compiled_as_the_rest() -> None:
    """Under `--compile.backend aot_eager` torchtitan lowers the FlexAttention region of each
    compiled block with inductor (regional_inductor), whose flex lowering fails on CPU ("tuple
    index out of range", torch's FSDP2 and fsdp_ext alike). The region is left to the chosen
    backend instead: aot_eager traces the CPU attention above like the rest of the block."""
    import torchtitan.distributed.compile as tt_compile
    tt_compile._maybe_regional_inductor_backend = lambda model, backend: backend


def count_gradient_collectives(path: str, impl: str) -> None:
    """Rank 0 writes to `path`, at exit, how many gradient reductions the run issued and the
    elements they sent: torch's FSDP2 reduce-scatters (reduce_scatter_single, one per parameter
    group and backward), fsdp_ext's reductions of a bucket (on gloo an in-place all-reduce of the
    packed groups, runtime/comm/collectives.py)."""
    import atexit

    import torch.distributed as dist
    counts = {"calls": 0, "elements": 0}

    def counted(original, elements):
        def call(*args, **kwargs):
            counts["calls"] += 1
            counts["elements"] += elements(*args, **kwargs)
            return original(*args, **kwargs)
        return call

    if impl == "torch":
        dist.reduce_scatter_single = counted(
            dist.reduce_scatter_single, lambda output, input, *a, **k: input.numel())
    else:
        from fsdp_ext.runtime.comm import collectives as comm
        comm.reduce_scatter_groups = counted(
            comm.reduce_scatter_groups,
            lambda flat, layout, group, async_op, sent=None: layout.world_size * sum(
                g.shard_numel for i, g in enumerate(layout.groups) if sent is None or i in sent))

    def write():
        if os.environ.get("RANK") == "0":  # (the trainer destroyed its process group by now)
            with open(path, "w") as f:
                json.dump(counts, f)
    atexit.register(write)


def _force_sum_reduction_on_gloo() -> None:
    """torchtitan sets every FSDPModule's gradient divide factor to 1.0 (it scales the loss by
    the global token count itself); torch's FSDP2 then reduce-scatters with PREMUL_SUM, which
    gloo rejects ("Cannot use ReduceOp.PREMUL_SUM with Gloo").
    `set_force_sum_reduction_for_comms(True)` makes it a plain SUM with the same (unit) factor.
    Applied to both implementations alike, right after torchtitan's call, which also logs which
    implementation sharded the model (the test checks that the swap took)."""
    import torchtitan.distributed.fsdp as tt_fsdp
    from torchtitan.tools.logging import logger

    disable_division = tt_fsdp.disable_fsdp_gradient_division

    def disable_division_and_force_sum(model):
        disable_division(model)
        units = [m for m in model.modules() if isinstance(m, tt_fsdp.FSDPModule)]
        for module in units:
            module.set_force_sum_reduction_for_comms(True)
        impl = {"fsdp_ext" if any(c.__module__.startswith("fsdp_ext.") for c in type(m).__mro__)
                else "torch" for m in units}
        logger.info(f"FSDP implementation: {'+'.join(sorted(impl))} ({len(units)} FSDPModules)")
        # an MoE model's routed experts: Shard(0), or Shard(1) where the FSDP degree exceeds the
        # expert count (torchtitan's apply_fsdp_to_decoder picks it); the MoE test checks it
        experts = {str(p.placements) for n, p in model.named_parameters()
                   if ".inner_experts." in n and hasattr(p, "placements")}
        if experts:
            logger.info(f"FSDP expert placements: {' '.join(sorted(experts))}")

    tt_fsdp.disable_fsdp_gradient_division = disable_division_and_force_sum


def _uneven_all_to_all_on_gloo() -> None:
    """Expert parallelism's token dispatch (spmd_types' uneven all_to_all) exchanges one tensor
    per peer, each of its own row count; gloo's list all_to_all wants equal shapes ("invalid
    tensor size"). Its all_to_all_single takes split sizes, so a list exchange with uneven shapes
    goes through it: the same bytes to the same peers, for both implementations alike."""
    import torch.distributed as dist

    list_all_to_all = dist.all_to_all

    def all_to_all(output_list, input_list, group=None, async_op=False):
        shapes = {tuple(t.shape) for t in (*output_list, *input_list)}
        if len(shapes) == 1 or dist.get_backend(group) != "gloo" or async_op:
            return list_all_to_all(output_list, input_list, group=group, async_op=async_op)
        sent = torch.cat([t.reshape(-1) for t in input_list])
        received = torch.empty(sum(t.numel() for t in output_list), dtype=sent.dtype)
        dist.all_to_all_single(received, sent, [t.numel() for t in output_list],
                               [t.numel() for t in input_list], group=group)
        for out, piece in zip(output_list, received.split([t.numel() for t in output_list])):
            out.copy_(piece.view(out.shape))
        return None

    dist.all_to_all = all_to_all


def use_fsdp_ext() -> None:
    """The swap: torchtitan's FSDP helpers call fsdp_ext's fully_shard. The llama3 path calls it
    only from torchtitan.distributed.fsdp; _rebind covers any other loaded module that imported
    torch's by name (flux's parallelize does, when loaded)."""
    import fsdp_ext
    import torchtitan.distributed.fsdp as tt_fsdp

    torch_fully_shard = tt_fsdp.fully_shard
    tt_fsdp.fully_shard = fsdp_ext.fully_shard
    _rebind({"fully_shard": (torch_fully_shard, fsdp_ext.fully_shard)})


def record_metrics(path: str) -> None:
    """Append each metrics record of rank 0's MetricsProcessor to `path` (JSON lines, exact
    floats, with the step), next to torchtitan's own console line."""
    from torchtitan.components.metrics import BaseLogger, MetricsProcessor

    class JsonLinesLogger(BaseLogger):
        def __init__(self, inner):
            self.inner = inner

        def log(self, metrics, step):
            with open(path, "a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")
            self.inner.log(metrics, step)

        def close(self):
            self.inner.close()

    build = MetricsProcessor._build_metric_logger

    def build_and_record(self, **kwargs):
        inner = build(self, **kwargs)
        return JsonLinesLogger(inner) if torch.distributed.get_rank() == 0 else inner

    MetricsProcessor._build_metric_logger = build_and_record


# ---------------------------------------------------------------- launching from a test

# torchtitan's default llama3_debugmodel config, cut to CPU size by a short sequence (a multiple
# of the chunked loss's 8 chunks); the caller picks the steps. CUDA graphs are off (no CUDA); the
# seed is explicit so every run starts from the same weights, not from rank 0's generator state.
SMALL = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.seq_len", "128",
         "--training.disable_cuda_graphs", "--debug.seed", "42"]



def qwen3_moe(num_experts: int, top_k: int) -> list[str]:
    """torchtitan's `qwen3_moe_debug` (Qwen3 MoE, EP=1) cut to CPU size: 2 of its 8 blocks,
    `num_experts` routed experts (64 in the config) with `top_k` (8), experts' hidden size 256
    (768), sequence 128 (4096), local batch 2 (4); the sizes through torchtitan's own
    `--override.imports` (tests/helpers/titan_overrides.py), as its model config has no CLI flags.
    torch's `_grouped_mm` has a CPU kernel (bfloat16, forward and backward; strides must be
    multiples of 16 bytes, which every size here keeps), so the experts run torchtitan's own
    grouped GEMM, unshimmed."""
    sizes = {"n_layers": 2, "num_experts": num_experts, "top_k": top_k, "hidden_dim": 256}
    return ["--module", "qwen3", "--config", "qwen3_moe_debug", "--training.seq_len", "128",
            "--training.local_batch_size", "2", "--training.disable_cuda_graphs",
            "--debug.seed", "42",
            "--override.imports", f"tests.helpers.titan_overrides.moe_size={json.dumps(sizes)}"]


def launch(impl: str, out: str, assets: tuple[str, str], args: list[str], world_size: int = 2,
           deadline_s: float = 420.0, base: list[str] = SMALL) -> tuple[list[dict], str]:
    """Run torchtitan's trainer with `impl` at `world_size` (one process per rank, gloo) on the
    `base` config arguments (SMALL: llama3) and return (rank 0's metrics records, rank 0's
    output). Fails with every rank's output tail if a rank fails or outlives the deadline."""
    from .launch import Ranks

    metrics = os.path.join(out, "metrics.jsonl")
    os.makedirs(out, exist_ok=True)
    cmd = ["-m", "tests.helpers.titan_cpu", "--fsdp", impl, *base, "--hf_assets_path", assets[0],
           "--dataloader.dataset_path", assets[1], "--dump_folder", out, *args]
    # the datasets cache stays inside the run's folder; nothing is fetched from the network
    env = {"TITAN_CPU_METRICS": metrics, "HF_HOME": os.path.join(out, "hf"),
           "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TITAN_CPU_GRAD_COLLECTIVES": os.path.join(out, "grad_collectives.json")}
    with Ranks(cmd, world_size, env=env) as ranks:
        results = ranks.wait(range(world_size), deadline_s)
    if any(r.returncode != 0 for r in results.values()):
        raise AssertionError(f"torchtitan ({impl}) {' '.join(args)}:\n" + "\n".join(
            f"--- rank {r.rank} exit {r.returncode} after {r.seconds:.0f} s\n{r.output[-6000:]}"
            for r in results.values()))
    with open(metrics) as f:
        return [json.loads(line) for line in f], results[0].output


def main(argv: list[str]) -> None:
    if argv[:1] == ["--make-assets"]:
        print(*make_assets(argv[1]))
        return
    impl = "torch"
    if argv[:1] == ["--fsdp"]:
        impl, argv = argv[1], argv[2:]
    assert impl in ("torch", "fsdp_ext"), impl
    apply_cpu_shims()
    if impl == "fsdp_ext":
        use_fsdp_ext()
    if os.environ.get("TITAN_CPU_METRICS"):
        record_metrics(os.environ["TITAN_CPU_METRICS"])
    if os.environ.get("TITAN_CPU_GRAD_COLLECTIVES"):
        count_gradient_collectives(os.environ["TITAN_CPU_GRAD_COLLECTIVES"], impl)

    import torchtitan.train

    sys.argv = ["torchtitan.train", *argv]
    torchtitan.train.main()


if __name__ == "__main__":
    main(sys.argv[1:])
