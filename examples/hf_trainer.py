"""transformers' Trainer configured for FSDP2, with the FSDP implementation as a switch.

The script is an ordinary Trainer run (a small Llama, FSDP2 through `fsdp_config`, gradient
accumulation, gradient clipping, sharded checkpoints every `save_steps`, resumable); the only
fsdp_ext line is `fsdp_ext.integrations.accelerate.enable(...)` before the Trainer is built.
`--fsdp torch` runs the same Trainer on torch's FSDP2 (on CPU launches the switch also lets
accelerate take its FSDP path, which it otherwise leaves to GPUs).

    torchrun --nproc-per-node 2 examples/hf_trainer.py --fsdp fsdp_ext --steps 4 --out /tmp/hf
    torchrun --nproc-per-node 2 examples/hf_trainer.py --fsdp fsdp_ext --steps 4 --out /tmp/hf \\
        --resume-from /tmp/hf/checkpoint-2
"""
from __future__ import annotations

import argparse

import torch

import fsdp_ext.integrations.accelerate

VOCAB, SEQ = 96, 16


def dataset(n: int = 64) -> list[dict]:
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(7))
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def build_model(tied: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tied))


def train(fsdp: str, steps: int, out: str, resume_from: str | None = None, tied: bool = False,
          bf16: bool = False, ram_efficient: bool = False, checkpointing: bool = False,
          state_dict_type: str = "SHARDED_STATE_DICT",
          ) -> tuple[list[float], dict[str, torch.Tensor], torch.nn.Module]:
    """A Trainer run; returns this rank's micro-batch losses, the full trained parameters and the
    sharded model."""
    fsdp_ext.integrations.accelerate.enable(fsdp)  # the switch: "fsdp_ext" or "torch"
    from transformers import Trainer, TrainingArguments

    losses: list[float] = []

    class RecordingTrainer(Trainer):  # the exact loss of each micro-batch, not the rounded log
        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            result = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
            losses.append(float((result[0] if return_outputs else result).detach()))
            return result

    args = TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, learning_rate=1e-2, max_grad_norm=1.0, seed=0,
        save_strategy="steps", save_steps=2, logging_steps=1, report_to=[], disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(), bf16=bf16, fsdp=True,
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                     "state_dict_type": state_dict_type,  # or FULL_STATE_DICT: one file
                     # shard on the meta device, then rank 0's weights to every rank's shards
                     "cpu_ram_efficient_loading": ram_efficient,
                     # accelerate wraps each block in torch's checkpoint_wrapper before sharding
                     "activation_checkpointing": checkpointing})
    trainer = RecordingTrainer(model=build_model(tied), args=args, train_dataset=dataset())
    trainer.train(resume_from_checkpoint=resume_from)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    params = get_model_state_dict(trainer.model_wrapped,
                                  options=StateDictOptions(full_state_dict=True))
    return losses, params, trainer.model_wrapped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fsdp", choices=["torch", "fsdp_ext"], default="fsdp_ext")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default="out/hf_trainer")
    parser.add_argument("--resume-from", default=None)
    parser.add_argument("--tied", action="store_true", help="tie the input and output embeddings")
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision")
    parser.add_argument("--ram-efficient", action="store_true",
                        help="fsdp_config's cpu_ram_efficient_loading")
    parser.add_argument("--checkpointing", action="store_true",
                        help="fsdp_config's activation_checkpointing")
    parser.add_argument("--state-dict-type", default="SHARDED_STATE_DICT",
                        choices=["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
    cli = parser.parse_args()
    losses, _, model = train(cli.fsdp, cli.steps, cli.out, cli.resume_from, cli.tied, cli.bf16,
                             cli.ram_efficient, cli.checkpointing, cli.state_dict_type)
    print(f"{type(model).__module__.split('.')[0]} sharded {type(model).__name__}; micro-batch "
          f"losses {[round(x, 5) for x in losses]}")


if __name__ == "__main__":
    fsdp_ext.run_then_exit(main)
