"""Your own CNN on a torch Dataset, trained with peers: 1 validator, 1 reducer and 3 trainers as separate
processes on 127.0.0.1 (TCP+Noise), through the public API; then the certified model is exported and loaded.

Run: `python examples/train_your_model.py [DIR]`. The nodes import `factory` from this file by name.
"""
import sys
import tempfile

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

from peerloom import Experiment, load_head, run_up, shards_for, torch_workload


def cnn():  # 8x8 images -> 10 classes
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(128, 10))


def factory(seed, num_shards):  # every node calls this (node config: workload = "train_your_model:factory")
    digits = load_digits()
    x, y = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1), torch.tensor(digits.target)
    train, test = TensorDataset(x[:1400], y[:1400]), TensorDataset(x[1400:], y[1400:])
    workload = torch_workload(model=cnn, loss=nn.functional.cross_entropy, train_data=train, eval_data=test,
                              optimizer=lambda params: torch.optim.Adam(params, lr=1e-2), batch_size=32)
    return workload, shards_for(len(train), num_shards, seed)


if __name__ == "__main__":
    root = Experiment(workload="train_your_model:factory", trainers=3, window_s=5.0, base_port=0).write(
        sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="my-experiment-"))
    assert run_up(root, windows=3) == 0
    model = load_head(root / "nodes" / "validator-1", cnn())  # verified from genesis, then loaded
    print(f"trained weights loaded into {type(model).__name__}; the chain is in {root}")
