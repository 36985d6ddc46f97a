"""Makes a tiny random-weight Llama for tests: a LlamaConfig and a byte-level
BPE tokenizer trained offline on generated text, saved with save_pretrained.
Nothing is downloaded. vLLM serves it with `--load-format dummy`, so no
weights are written; with `--weights`, real random weights are saved too
(model.safetensors, ~14 MB: `transformers serve` loads what is on disk).

    python make_tiny_model.py OUT_DIR [--weights]
"""

import random
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def corpus(n_lines=4000, seed=7):
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(3000)]
    for _ in range(n_lines):
        yield " ".join(rng.choice(words) for _ in range(rng.randint(5, 30)))


def main(out, weights=False):
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 8192
    fast.save_pretrained(out)
    cfg = LlamaConfig(vocab_size=2000, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
                      pad_token_id=3,
                      # vLLM's dummy weights in bf16; real ones as torch makes them.
                      **({} if weights else {"torch_dtype": "bfloat16"}))
    if weights:
        import torch

        torch.manual_seed(7)  # the same weights on every machine
        LlamaForCausalLM(cfg).save_pretrained(out)
    else:
        cfg.save_pretrained(out)
    print("tiny llama in", out)


if __name__ == "__main__":
    main(sys.argv[1], weights="--weights" in sys.argv[2:])
