"""Your own training loop as one trainer of a fleet (spec/protocol.md §5.1): `peerloom.join` hands each window
to the loop below (the head's weights in your model, the leased batches, the global step) and publishes what
it trained. Its LR warm-up spans windows, as in a central run. The rest of the fleet (1 validator that audits
every update by replaying one committed segment, 1 trainer) runs as separate processes on 127.0.0.1; at the
end the certified model is exported and loaded.

Run: `python examples/own_loop.py [DIR]`. The nodes import `factory` from this file by name.
"""
import sys
import tempfile

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

import peerloom
from peerloom import Experiment, Fleet, shards_for, torch_workload

H, CLIP = 8, 1.0  # inner steps per window; gradient clipping (the workload does what the loop does)


def mlp():
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def warmup(optimizer):  # 0.1x -> 1x over the first three windows
    return torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=3 * H)


def factory(seed, num_shards):  # every node calls this; validators replay updates with it
    digits = load_digits()
    x, y = torch.tensor(digits.data / 16.0, dtype=torch.float32), torch.tensor(digits.target)
    train, test = TensorDataset(x[:1400], y[:1400]), TensorDataset(x[1400:], y[1400:])
    workload = torch_workload(model=mlp, loss=nn.functional.cross_entropy, train_data=train, eval_data=test,
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), scheduler=warmup,
                              clip_grad_norm=CLIP, batch_size=32)
    return workload, shards_for(len(train), num_shards, seed)


if __name__ == "__main__":
    root = Experiment(workload="own_loop:factory", trainers=2, reducers=0, inner_steps=H, window_s=5.0, audit=True,
                      manifest_options={"audit_rate": 1.0, "audit_segments": 4}, base_port=0).write(
        sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="own-loop-"))
    fleet = Fleet.open(root)
    fleet.start(["validator-1", "trainer-2"])
    try:
        fleet.wait_started()
        with peerloom.join(root / "nodes" / "trainer-1") as peer:
            model = peer.model  # the head's weights are loaded into it at every window
            for window in peer.windows(limit=4):
                optimizer, scheduler = window.optimizer()  # fresh; the warm-up at step (window - 1) * H
                lr = scheduler.get_last_lr()[0]
                for inputs, targets in window.batches():
                    optimizer.zero_grad()
                    loss = nn.functional.cross_entropy(model(inputs), targets)
                    loss.backward()
                    nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                    optimizer.step()
                    scheduler.step()
                    window.record(loss, len(targets))
                print(f"window {window.number}: global step {window.step}, lr {lr:.4f}, loss {loss.item():.3f}")
    finally:
        fleet.stop()
    model = peerloom.load_head(root / "nodes" / "validator-1", mlp())  # verified from genesis, then loaded
    print(f"trained weights loaded into {type(model).__name__}; the chain is in {root}")
