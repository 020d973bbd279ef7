"""A Hugging Face `transformers` causal LM trained across peers: a tiny GPT-2 architecture built from a local
config (random init, nothing downloaded), character-level, on the Python help text that ships with CPython.

Needs the `hf` extra (`pip install 'peerloom[hf]'`). Run: `python examples/hf_causal_lm.py [DIR]`: a fleet of
1 validator, 1 reducer and 2 trainers on 127.0.0.1 certifies three windows; the nodes import `factory` from
this file, and each head carries the validators' test loss in nats per character.
"""
import sys
import tempfile

import torch
from torch import nn
from torch.utils.data import TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

from peerloom import Experiment, run_up, shards_for, torch_workload
from peerloom.backends.torch.charlm import VOCAB_SIZE, corpus_text, encode_text, sequence_cross_entropy, windows

CONTEXT = 32


class TinyGPT2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        config = GPT2Config(vocab_size=VOCAB_SIZE, n_positions=CONTEXT, n_embd=32, n_layer=2, n_head=2,
                            bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
        self.lm = GPT2LMHeadModel(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids).logits  # [batch, CONTEXT, VOCAB_SIZE]


def factory(seed, num_shards):  # every node calls this (node config: workload = "hf_causal_lm:factory")
    x, y = (torch.from_numpy(a) for a in windows(encode_text(corpus_text()[:40_000]), CONTEXT))
    train, test = TensorDataset(x[:1000], y[:1000]), TensorDataset(x[1000:1200], y[1000:1200])
    workload = torch_workload(model=TinyGPT2, loss=sequence_cross_entropy, train_data=train, eval_data=test,
                              optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3), batch_size=32,
                              metrics={"loss": lambda logits, targets: float(sequence_cross_entropy(logits, targets))})
    return workload, shards_for(len(train), num_shards, seed)


if __name__ == "__main__":
    root = Experiment(workload="hf_causal_lm:factory", trainers=2, window_s=10.0, aggregation="mean",
                      base_port=0).write(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="hf-"))
    sys.exit(run_up(root, windows=3))
