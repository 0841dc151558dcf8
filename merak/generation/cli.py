"""`merak generate CHECKPOINT --prompt ...`: generation from a saved model, under torchrun.

CHECKPOINT is a Merak checkpoint (``checkpoint-<step>``, any (dp, tp, pp) layout it was saved
from; a LoRA one brings its adapter) or an HF ``save_pretrained`` directory. Each rank builds the
model on the meta device, loads only its own stage, and `merak.generate` runs on every rank;
rank 0 prints each prompt's continuation.

    torchrun --nproc_per_node 4 -m merak generate out/checkpoint-100 --pp 2 --tp 2 \\
        --prompt "def fibonacci(n):" --max-new-tokens 40
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from merak.inputs import non_negative_float, non_negative_int, positive_float, positive_int


def add_generate(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate text from a Merak checkpoint or an HF directory (torchrun)")
    parser.add_argument("checkpoint", help="a checkpoint-<step> directory or an HF model directory")
    parser.add_argument("--prompt", action="append", default=[],
                        help="a text prompt (repeatable; needs a tokenizer)")
    parser.add_argument("--prompt-ids", action="append", default=[],
                        help="a prompt as comma-separated token ids (repeatable)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer directory (default: the checkpoint's, if it has one)")
    parser.add_argument("--dp", type=positive_int, default=1)
    parser.add_argument("--tp", type=positive_int, default=1)
    parser.add_argument("--pp", type=positive_int, default=None,
                        help="pipeline stages (default: world size / (dp x tp))")
    parser.add_argument("--max-new-tokens", type=positive_int, default=32)
    parser.add_argument("--do-sample", action="store_true", help="sample (default: greedy)")
    parser.add_argument("--temperature", type=non_negative_float, default=1.0)
    parser.add_argument("--top-k", type=non_negative_int, default=None)
    parser.add_argument("--top-p", type=positive_float, default=None)
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.set_defaults(run=_generate)


def _tokenizer(args: argparse.Namespace):
    source = args.tokenizer or args.checkpoint
    has_one = any((Path(source) / f).exists() for f in ("tokenizer.json",
                                                        "tokenizer_config.json"))
    if args.tokenizer is None and not has_one:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)


def load_for_generation(checkpoint: str | Path, ctx):
    """(the model given to `parallelize`, this rank's stage) from a Merak checkpoint or an HF
    directory, each rank holding only its own stage."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from merak import lora
    from merak.checkpoint.io import MARKER, load_checkpoint, read_layout
    from merak.engine.parallelize import parallelize
    from merak.materialize.meta import init_empty_weights

    checkpoint = Path(checkpoint)
    if not (checkpoint / "config.json").exists():
        raise FileNotFoundError(f"{checkpoint} has no config.json: give a Merak checkpoint "
                                f"(checkpoint-<step>) or an HF save_pretrained directory")
    merak_checkpoint = (checkpoint / MARKER).exists()
    if merak_checkpoint and read_layout(checkpoint).name_prefix:  # (validated merak.json)
        raise ValueError(f"{checkpoint} was trained with a custom loss_fn (its names carry a "
                         f"prefix); export it first (`merak export`) and generate from that")
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint))
    if merak_checkpoint and (checkpoint / lora.ADAPTER_CONFIG).exists():
        model = lora.wrap(model, checkpoint)
    ids = torch.zeros((2, 16), dtype=torch.long)
    example = {"input_ids": ids, "labels": ids.clone()}
    if merak_checkpoint:
        stage = parallelize(model, example, ctx)
        load_checkpoint(checkpoint, ctx, stage)
    else:
        stage = parallelize(model, example, ctx, checkpoint=checkpoint)
    return (model.get_base_model() if lora.is_peft_model(model) else model), stage


def _generate(args: argparse.Namespace) -> int:
    from merak.distributed.parallel_context import init
    from merak.generation.generate import generate

    world = int(os.environ.get("WORLD_SIZE", "1"))
    pp = args.pp or max(1, world // (args.dp * args.tp))
    ctx = init(dp=args.dp, tp=args.tp, pp=pp)
    tokenizer = _tokenizer(args)
    prompts = [[int(t) for t in text.split(",")] for text in args.prompt_ids]
    if args.prompt and tokenizer is None:
        raise ValueError(f"--prompt needs a tokenizer and {args.checkpoint} has none: pass "
                         f"--tokenizer DIR, or give --prompt-ids")
    prompts += [tokenizer.encode(text) for text in args.prompt]
    if not prompts:
        raise ValueError("give at least one --prompt or --prompt-ids")
    model, stage = load_for_generation(args.checkpoint, ctx)
    out = generate(model, stage, prompts, ctx=ctx, max_new_tokens=args.max_new_tokens,
                         do_sample=args.do_sample, temperature=args.temperature,
                         top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    if ctx.rank == 0:
        for prompt, new in zip(prompts, out):
            if tokenizer is not None:
                print(f"{tokenizer.decode(prompt)!r} -> {tokenizer.decode(new)!r}")
            print(f"prompt_ids={prompt} generated_ids={new}")
    return 0
