"""Character-level language model on the Python documentation that ships with CPython (spec/design.md §8).

Data: the text of ``pydoc_data.topics.topics`` (the help topics of the running CPython, ~465 k characters on
3.11), topics joined in sorted-key order with a newline. Characters map to `VOCAB` (newline and printable
ASCII); anything else maps to one unknown id. The split is fixed, independent of the seed: the first
``1 - VALIDATION_FRACTION`` of the characters train, the rest validate. Each sample is a non-overlapping
window of ``context + 1`` characters: input ``[context]`` ids, target the same window shifted by one.

Model (`TinyCharTransformer`): token + learned position embeddings, `layers` pre-norm causal transformer
blocks (``nn.TransformerEncoderLayer``, GELU, no dropout), a final LayerNorm and a linear head to the
vocabulary. The defaults (d_model 64, 2 layers, 4 heads, context 64: ~110 k parameters) train a window of a
few hundred samples in about a second on one CPU core.

`make_charlm_workload` returns a `CharLMWorkload`: the `TorchWorkload` interface (``initial_params(seed)``,
``train(params, indices, seed) -> (delta, metrics)``, ``num_train``, ``schema()``) whose ``evaluate`` reports
``{"loss" (nats per character), "accuracy" (next-character), "bits_per_char"}`` on the validation split.
`train_centralized` is the in-run baseline.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from .workload import TorchWorkload

VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))
"""Newline and printable ASCII; id ``len(VOCAB)`` is the unknown character."""
VOCAB_SIZE = len(VOCAB) + 1
VALIDATION_FRACTION = 0.1

# Measured with the defaults (seed 0, 1 torch thread, shared 2-core machine): at init 6.62 bits/char (uniform:
# log2(97) = 6.60); FedAvg over 8 shards (818 windows each), 1 local epoch, outer SGD lr 1: 3.85 / 3.44 / 3.31 /
# 3.25 bits/char after windows 1-4 (next-char accuracy 40.6%), ~3-4 s per trainer window; the centralized
# baseline, 4 epochs over all 6539 windows: 2.17 bits/char, 59.5% (90 s).
CHARLM_LR = 3e-3
CHARLM_BATCH_SIZE = 32
CHARLM_CONTEXT = 64


def corpus_text() -> str:
    """The Python docs text: ``pydoc_data.topics.topics`` values in sorted-key order, joined by newlines."""
    from pydoc_data.topics import topics

    return "\n".join(topics[key] for key in sorted(topics))


def encode_text(text: str) -> np.ndarray:
    """int64 ``[len(text)]`` ids into `VOCAB` (unknown characters -> ``len(VOCAB)``)."""
    table = np.full(0x110000 if any(ord(c) > 0xFFFF for c in text) else 0x10000, len(VOCAB), dtype=np.int64)
    for i, ch in enumerate(VOCAB):
        table[ord(ch)] = i
    return table[np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)]


def windows(ids: np.ndarray, context: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping ``context + 1`` windows: inputs and next-character targets, int64 ``[n, context]``."""
    n = (len(ids) - 1) // context
    x = ids[: n * context].reshape(n, context)
    y = ids[1 : n * context + 1].reshape(n, context)
    return np.ascontiguousarray(x), np.ascontiguousarray(y)


def load_charlm_split(context: int = CHARLM_CONTEXT) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x_train, y_train, x_val, y_val)``, int64 ``[n, context]``; a fixed contiguous split of the text."""
    ids = encode_text(corpus_text())
    cut = int(len(ids) * (1.0 - VALIDATION_FRACTION))
    return (*windows(ids[:cut], context), *windows(ids[cut:], context))


class TinyCharTransformer(nn.Module):
    """Causal transformer: ids int64 ``[batch, T]`` (T <= context) -> logits float32 ``[batch, T, vocab]``."""

    def __init__(self, vocab: int = VOCAB_SIZE, context: int = CHARLM_CONTEXT, d_model: int = 64,
                 layers: int = 2, heads: int = 4, ff: int = 256) -> None:
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)
        block = nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        h = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        mask = self.get_buffer("mask")
        h = self.blocks(h, mask=mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def sequence_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats) per character of ``[batch, T, V]`` logits against ``[batch, T]`` ids."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class CharLMWorkload(TorchWorkload):
    """`TorchWorkload` over character windows; `evaluate` reports per-character metrics."""

    @torch.no_grad()
    def evaluate(self, params: dict[str, np.ndarray]) -> dict[str, float]:
        """``{"loss": nats per character, "accuracy": next-character accuracy, "bits_per_char": loss / ln 2}``
        over the whole validation split."""
        model, device, _ = self._eval_model(params)
        model.eval()
        total = 0
        loss_sum = 0.0
        correct = 0
        assert self.x_eval is not None and self.y_eval is not None  # a charlm workload holds its tensors
        for start in range(0, len(self.x_eval), self.eval_batch_size):
            x = self.x_eval[start : start + self.eval_batch_size].to(device)
            y = self.y_eval[start : start + self.eval_batch_size].to(device)
            out = model(x)
            loss_sum += float(self.loss_fn(out, y)) * y.numel()
            correct += int((out.argmax(dim=-1) == y).sum())
            total += y.numel()
        if total == 0:
            return {"loss": math.nan, "accuracy": math.nan, "bits_per_char": math.nan}
        loss = loss_sum / total
        return {"loss": loss, "accuracy": correct / total, "bits_per_char": loss / math.log(2.0)}


def make_charlm_workload(
    seed: int = 0,
    *,
    context: int = CHARLM_CONTEXT,
    local_epochs: int = 1,
    lr: float = CHARLM_LR,
    batch_size: int = CHARLM_BATCH_SIZE,
    d_model: int = 64,
    layers: int = 2,
    heads: int = 4,
    num_threads: int | None = None,
) -> CharLMWorkload:
    """The bundled character LM task: `TinyCharTransformer`, Adam(`lr`), `sequence_cross_entropy`,
    mini-batches of `batch_size` windows; data `load_charlm_split(context)` (the split does not depend on
    `seed`; `seed` is accepted for the workload-registry signature: initial params and shards take their
    own seeds)."""
    del seed
    x_train, y_train, x_val, y_val = load_charlm_split(context)

    def model() -> nn.Module:
        return TinyCharTransformer(context=context, d_model=d_model, layers=layers, heads=heads, ff=4 * d_model)

    def optimizer(params: Any) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=lr)

    return CharLMWorkload(
        model,
        optimizer,
        sequence_cross_entropy,
        (x_train, y_train),
        (x_val, y_val),
        batch_size=batch_size,
        local_epochs=local_epochs,
        eval_batch_size=256,
        num_threads=num_threads,
    )


def train_centralized(workload: CharLMWorkload, epochs: int, seed: int) -> dict[str, float | int]:
    """The in-run baseline: the same model, optimizer and batch size on the whole train split.

    Returns ``{"test_accuracy", "test_loss", "test_bits_per_char", "epochs", "wall_s"}`` (validation split;
    the key names match `peerloom.backends.torch.models.train_centralized`).
    """
    start = time.perf_counter()
    params = workload.initial_params(seed)
    workload.train(params, range(workload.num_train), seed, epochs=epochs)
    metrics = workload.evaluate(workload.params())
    return {
        "test_accuracy": metrics["accuracy"],
        "test_loss": metrics["loss"],
        "test_bits_per_char": metrics["bits_per_char"],
        "epochs": epochs,
        "wall_s": time.perf_counter() - start,
    }
