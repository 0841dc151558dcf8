"""Trains the example's small byte-level BPE tokenizer on train.txt and saves it as an HF
tokenizer directory (tokenizer/), then writes the tiny Llama config (tiny-llama/config.json)
with the tokenizer's vocabulary size and special-token ids. Deterministic:

    .venv/bin/python examples/data/make_tokenizer.py
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

HERE = Path(__file__).parent
VOCAB_SIZE = 512
EOS = "<|endoftext|>"


def train_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train([str(HERE / "train.txt")], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=EOS, eos_token=EOS,
                                   unk_token=EOS, pad_token=EOS, model_max_length=256)


def tiny_llama_config(tokenizer: PreTrainedTokenizerFast) -> dict:
    eos = tokenizer.convert_tokens_to_ids(EOS)
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "hidden_act": "silu",
            "initializer_range": 0.02, "tie_word_embeddings": False,
            "bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos}


if __name__ == "__main__":
    tokenizer = train_tokenizer()
    tokenizer.save_pretrained(HERE / "tokenizer")
    (HERE / "tiny-llama").mkdir(exist_ok=True)
    config = tiny_llama_config(tokenizer)
    (HERE / "tiny-llama" / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"tokenizer: {len(tokenizer)} tokens -> {HERE / 'tokenizer'}; "
          f"config -> {HERE / 'tiny-llama' / 'config.json'}")
