"""Named workloads a manifest can refer to (`Manifest.workload`).

A workload name plus its seed must mean the same model, data split and shard contents on every peer,
because leases name shards by number and sample weights come from the manifest's shard sizes.

=============== ========================================================================================
name            workload
=============== ========================================================================================
``digits-mlp``  `peerloom.backends.torch.models.make_digits_workload`: torch MLP 64-128-10 on digits
``digits-numpy`` `peerloom.backends.numpy.workload.make_digits_numpy_workload`: the same model and schema
                in pure numpy (peers without torch, the simulator, the robustness bench)
``quadratic``   `peerloom.backends.synthetic.QuadraticWorkload`: noisy quadratic for 10,000-node
                simulations; shards cut from its ``num_train`` (default 1,000,000) samples
``charlm``      `peerloom.backends.torch.charlm.make_charlm_workload`: tiny causal character transformer on
                the Python documentation that ships with CPython (``pydoc_data.topics``)
=============== ========================================================================================

`options` are passed to the factory (e.g. ``local_epochs``, ``inner_steps``, ``keep_optimizer_state`` for
the digits workloads; ``dim``, ``local_steps``, ``num_train`` for ``quadratic``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .numpy.workload import NumpyWorkload
    from .synthetic import QuadraticWorkload
    from .torch.workload import TorchWorkload
    from .workload import LossCheckable, Resumable, Workload

    def _bundled_workloads_are_workloads(a: NumpyWorkload, b: TorchWorkload, c: QuadraticWorkload) -> None:
        """Type checking only: each bundled workload class implements `Workload` and the loss check's and segment
        audits' capabilities (mypy fails here otherwise)."""
        _a: Workload = a
        _b: Workload = b
        _c: Workload = c
        for w in (a, b, c):
            _l: LossCheckable = w
            _r: Resumable = w

WORKLOADS = ("digits-mlp", "digits-numpy", "mnist1d-mlp", "mnist1d-numpy", "quadratic", "charlm")


def _contiguous_shards(n: int, num_shards: int) -> list[list[int]]:
    """``range(n)`` cut into `num_shards` contiguous near-equal ranges (the quadratic's samples are
    exchangeable, so no permutation is needed)."""
    if not 1 <= num_shards <= n:
        raise ValueError(f"need 1 <= num_shards <= n, got num_shards={num_shards}, n={n}")
    base, extra = divmod(n, num_shards)
    out, start = [], 0
    for s in range(num_shards):
        size = base + (s < extra)
        out.append(list(range(start, start + size)))
        start += size
    return out


def build_workload(name: str, seed: int, num_shards: int, **options: Any) -> tuple[Any, list[list[int]]]:
    """(workload, shard -> train sample indices) for a workload name. ValueError for unknown names."""
    if name in ("digits-mlp", "digits-numpy"):
        from .datasets import shard_indices

        if name == "digits-mlp":
            from .torch.models import make_digits_workload

            workload: Any = make_digits_workload(seed=seed, **options)
        else:
            from .numpy.workload import make_digits_numpy_workload

            workload = make_digits_numpy_workload(seed=seed, **options)
        return workload, shard_indices(workload.num_train, num_shards, seed)
    if name in ("mnist1d-mlp", "mnist1d-numpy"):
        from .datasets import shard_indices
        from .mnist1d import make_mnist1d_numpy_workload, make_mnist1d_workload

        make = make_mnist1d_workload if name == "mnist1d-mlp" else make_mnist1d_numpy_workload
        workload = make(seed=seed, **options)
        return workload, shard_indices(workload.num_train, num_shards, seed)
    if name == "charlm":
        from .datasets import shard_indices
        from .torch.charlm import make_charlm_workload

        workload = make_charlm_workload(seed=seed, **options)
        return workload, shard_indices(workload.num_train, num_shards, seed)
    if name == "quadratic":
        from .synthetic import QuadraticWorkload

        workload = QuadraticWorkload(seed, **options)
        # Shards of at most 64 samples each keep lease targets noisy (non-i.i.d.) and lists small.
        if not 1 <= num_shards <= workload.num_train:
            raise ValueError(f"need 1 <= num_shards <= {workload.num_train}, got {num_shards}")
        per = min(64, workload.num_train // num_shards)
        return workload, _contiguous_shards(per * num_shards, num_shards)
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
