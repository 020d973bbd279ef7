"""Your own training loop as a trainer of a run (spec/protocol.md §5.1): `join` and its `Peer` and `Window`.

::

    import peerloom

    with peerloom.join("run/nodes/trainer-1") as peer:     # the node runs on a background thread
        model = peer.model                                # your nn.Module, from your workload factory
        for window in peer.windows():                     # blocks until this trainer holds a lease
            optimizer, scheduler = window.optimizer()     # fresh; the schedule at the run's global step
            for inputs, targets in window.batches():      # the leased batches, in the training seed's order
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(model(inputs), targets)
                loss.backward()
                optimizer.step()
                scheduler.step()
                window.record(loss)                       # optional: the train loss the update announces
            # the body's end publishes: pseudo-gradient = head - model, the manifest's codec, signed, served

The node is the one `peerloom node --config DIR/node.toml` would run (its key, store, addresses, the
manifest's workload from the factory its config names), on a background thread; only its ``train`` task is
handed to this loop. Each `Window` holds the head's weights already loaded into `Peer.model` (in place),
the leased sample indices, the training seed, ``inner_steps`` and the global step. Leaving the loop's body
(or `Window.publish`) takes the trained module back and returns the update to the node, which encodes it
in the manifest's codec, persists, signs, announces and serves it as for any trainer.

Auditability (spec/protocol.md §5.1). Validators replay a trainer's update with the manifest's workload,
the same factory this node built (`TorchWorkload.train` / `resume`, §6, §6.2, §6.3). Under a revision with
audits (``audit = true``) the loop must compute what that replay computes: one optimizer step per batch of
`Window.batches` (all of them, in order), with the optimizer and scheduler of `Window.optimizer`, the step
as the workload takes it (zero_grad, forward and loss, backward, the workload's gradient clipping, step,
scheduler step) and nothing else drawn from torch's global RNG. It is enforced twice: before the first
window's update leaves the process (and every window's with ``check="every"``) the peer replays the window
with the workload and refuses to publish an update the replay does not reproduce (`LoopMismatch`, raised
in the loop: a trainer never signs an update the audits would fail and quarantine it for); and the
validators' audits check every selected update as any other. Under a revision without audits the loop is
free (any optimizer, any number of passes): nothing replays training there, so only screening (norm
bounds, cosine, the loss check) judges its updates.

Shutdown: leaving the ``with`` block (or `Peer.close`) abandons a window still in the loop (its task fails,
nothing is announced), stops the node (connections closed, the store's database closed, ``stats`` written)
and joins its thread. An error of the node's thread is raised in the loop by `Peer.windows`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from peerloom.core.errors import PeerloomError
from peerloom.node import ConfigError, build_runtime, load_config, write_stats

CHECKS = ("first", "every")
"""`join`'s ``check``: replay the first window this peer trains, or every one (under audits only)."""


class LoopMismatch(PeerloomError, RuntimeError):
    """The loop's update does not reproduce the manifest's workload replaying the same window (under a
    revision with audits): the validators' audits would fail it. Nothing was published."""


class LoopStopped(PeerloomError, RuntimeError):
    """The loop stopped with a window unfinished (the peer closed, or the loop left its body by ``break`` or an
    exception): that window's train task fails and nothing is announced."""


class _Job:
    """One ``train`` task of the node, handed from its compute thread to the loop."""

    def __init__(self, params: dict[str, np.ndarray], indices: list[int], seed: int, inner_steps: int | None,
                 epochs: int | None, step: int, checkpoints: int) -> None:
        self.params, self.indices, self.seed = params, indices, seed
        self.inner_steps, self.epochs, self.step, self.checkpoints = inner_steps, epochs, step, checkpoints
        self.done = threading.Event()
        self.result: tuple[dict[str, np.ndarray], dict[str, Any], list[dict[str, np.ndarray]]] | None = None
        self.error: BaseException | None = None

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        if not self.done.is_set():
            self.result, self.error = result, error
            self.done.set()


class _LoopWorkload:
    """What the node's compute executor trains with: the manifest's `TorchWorkload` (every other call goes
    to it), whose ``train`` hands the task to the user's loop and waits for its update."""

    TAKES_STEP = True  # the executor passes the global step (`ComputeExecutor._global_step`)

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.jobs: queue.Queue[_Job] = queue.Queue()
        self.closed = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def train(self, params: dict[str, np.ndarray], indices: Any, seed: int, *, epochs: int | None = None,
              inner_steps: int | None = None, state_key: Any = None, checkpoints: int = 0,
              on_checkpoint: Any = None, step: int = 0) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        if self.closed.is_set():
            raise LoopStopped("the loop has stopped")
        job = _Job({n: np.array(t, dtype=np.float32) for n, t in params.items()}, [int(i) for i in indices],
                   int(seed), inner_steps, epochs, int(step), int(checkpoints))
        self.jobs.put(job)
        while not job.done.wait(0.2):
            if self.closed.is_set():
                job.finish(error=LoopStopped("the loop stopped before it trained this window"))
        if job.error is not None:
            raise job.error
        assert job.result is not None
        delta, metrics, states = job.result
        if checkpoints and on_checkpoint is not None:
            for j, state in enumerate(states, 1):
                on_checkpoint(j, state)
        return delta, metrics


class Window:
    """One window's training, handed to the loop by `Peer.windows`.

    Attributes: ``number`` (the window trained; its base head is window ``number - 1``), ``step`` (the run's
    global step at its start, ``(number - 1) * inner_steps``; 0 under FedAvg local epochs), ``inner_steps``
    (the manifest's H; 0 = the workload's local epochs), ``seed`` (the training seed, spec/protocol.md §6),
    ``indices`` (the leased sample indices, in lease order), ``auditable`` (the revision audits updates:
    the loop must reproduce the workload, module docstring). The head's weights are in `Peer.model` when the
    window is handed over.
    """

    def __init__(self, peer: Peer, job: _Job, number: int) -> None:
        self._peer, self._job = peer, job
        self.number = number
        self.step = job.step
        self.inner_steps = job.inner_steps or 0
        self.seed = job.seed
        self.indices = tuple(job.indices)
        self.auditable = peer.auditable
        self._optimizer: Any = None
        self._states: list[dict[str, np.ndarray]] = []
        self._done = 0  # optimizer steps' batches the loop has taken
        self._exhausted = False
        self._losses: list[float] = []
        self._published = False

    def optimizer(self) -> tuple[Any, Any]:
        """``(optimizer, scheduler)``: a fresh inner optimizer on `Peer.model` from the workload's optimizer
        factory, and its scheduler factory's scheduler (None without one) stepped to this window's global
        step, as the validators' replay builds them. Step the scheduler after every optimizer step."""
        workload = self._peer._workload
        optimizer = workload.optimizer_factory(workload.model.parameters())
        scheduler = workload._scheduler(optimizer, self.step)
        self._optimizer = optimizer
        return optimizer, scheduler

    def batches(self, optimizer: Any = None) -> Iterator[tuple[Any, Any]]:
        """The leased ``(inputs, targets)`` batches on the workload's device: ``inner_steps`` of them (else the
        workload's local epochs), drawn exactly as `TorchWorkload.train` draws them from the training seed.
        While iterating, torch's global RNG (dropout) is seeded with the training seed; it is put back after.
        Under segment audits the whole training state (`TorchWorkload.resume`'s layout) is committed after
        steps ``(j * H) // S``, which needs the optimizer: `optimizer`'s, else `Window.optimizer`'s.
        Iterate it once, taking one optimizer step per batch."""
        import torch

        from peerloom.backends.torch.workload import _move

        if self._done or self._exhausted:
            raise RuntimeError("Window.batches() is one pass over the window's batches; iterate it once")
        if optimizer is not None:
            self._optimizer = optimizer
        workload, job = self._peer._workload, self._job
        steps = job.inner_steps
        epochs = workload.local_epochs if job.epochs is None else job.epochs
        bounds: dict[int, int] = {}
        if job.checkpoints:
            assert steps is not None  # checkpoints are committed only under inner steps (spec/protocol.md §6.3)
            bounds = {(j * steps) // job.checkpoints: j for j in range(1, job.checkpoints + 1)}
        index = workload._lease_index(job.indices)
        generator = torch.Generator().manual_seed(job.seed)
        current: list[Any] = [0, None]

        def on_pass(done: int) -> None:
            current[:] = [done, workload._rng_states()]

        saved = workload._rng_states()
        try:
            torch.manual_seed(job.seed)
            batches = workload._train_batches(index, generator, steps, epochs,
                                              on_pass=on_pass if bounds and workload.train_loader else None)
            for _first, (inputs, targets) in batches:
                self._checkpoint(bounds, current)
                yield _move(inputs, workload.device), _move(targets, workload.device)
                self._done += 1
            self._checkpoint(bounds, current)
            self._exhausted = True
        finally:
            workload._set_rng_states(saved)

    def _checkpoint(self, bounds: dict[int, int], current: list[Any]) -> None:
        if self._done not in bounds or len(self._states) >= bounds[self._done]:
            return
        if self._optimizer is None:
            raise RuntimeError("this revision has segment audits: the window commits the optimizer's state, "
                               "so build it with window.optimizer() (or pass it to window.batches(optimizer))")
        self._states.append(self._peer._workload._training_state(self._optimizer, self._done, current))

    def record(self, loss: Any, count: int | None = None) -> None:
        """Note one step's training loss (a scalar tensor or float; `count` samples, default 1): the update
        announces their weighted mean as its ``train_loss`` (else the workload's loss of the trained params
        on the lease, forward passes only)."""
        value = float(loss.detach()) if hasattr(loss, "detach") else float(loss)
        self._losses.extend([value] * (count or 1))

    def publish(self) -> None:
        """Hand the trained `Peer.model` back: the node encodes ``head - model`` in the manifest's codec, signs,
        announces and serves it. Called by `Peer.windows` when the loop's body ends; once per window. Under
        audits it raises `LoopMismatch` (nothing published) when the loop took fewer batches than the window
        has, or when the check replay (`join`'s ``check``) does not reproduce the update."""
        if self._published:
            return
        self._published = True
        peer, job = self._peer, self._job
        workload = peer._workload
        try:
            if self.auditable and not self._exhausted:
                raise LoopMismatch(f"window {self.number}: the loop took {self._done} batches of the window's "
                                   "batches() and stopped; under audits it must train on every one")
            trained = workload.params()
            delta = {n: np.subtract(job.params[n], trained[n], dtype=np.float32) for n in trained}
            if self.auditable and (peer.check == "every" or not peer._checked):
                self._reproduce(delta)
                workload._load(trained)  # the replay moved the model: the loop's result again
                peer._checked = True
            if job.checkpoints and len(self._states) != job.checkpoints:
                raise LoopMismatch(f"window {self.number}: {len(self._states)} of {job.checkpoints} training "
                                   "states committed")
            loss = sum(self._losses) / len(self._losses) if self._losses else workload.loss(trained, job.indices)
            job.finish((delta, {"train_loss": float(loss), "samples": len(job.indices)}, self._states))
        except BaseException as exc:
            job.finish(error=LoopStopped(f"window {self.number}: not published ({exc})"))
            raise

    def _reproduce(self, delta: dict[str, np.ndarray]) -> None:
        """`LoopMismatch` unless the workload's own training of this window reproduces `delta` (and, under
        segment audits, each committed segment), by the audits' measure: cosine >= ``audit_min_cosine``."""
        from peerloom.adapters.compute import _moved_alike

        peer, job = self._peer, self._job
        workload = peer._workload
        states: list[dict[str, np.ndarray]] = []
        options: dict[str, Any] = {"step": job.step}
        if job.inner_steps:
            options["inner_steps"] = job.inner_steps
        if job.epochs is not None:
            options["epochs"] = job.epochs
        if job.checkpoints:
            options.update(checkpoints=job.checkpoints, on_checkpoint=lambda j, state: states.append(state))
        expected, _ = workload.train(job.params, job.indices, job.seed, **options)
        names = sorted(delta)
        minimum = peer.min_cosine
        zeros = {n: np.zeros_like(delta[n]) for n in names}
        if not _moved_alike(zeros, delta, expected, names, minimum):
            raise LoopMismatch(f"window {self.number}: the loop's update is not what the manifest's workload trains "
                               f"from the same head, batches and seed (cosine below {minimum:g}); the validators' "
                               "audits would fail it and quarantine this trainer. Step once per batch of "
                               "window.batches(), with window.optimizer(), as the workload does (peerloom/loop.py)")
        for j, (ours, theirs) in enumerate(zip(self._states, states, strict=False), 1):
            start = job.params if j == 1 else self._states[j - 2]
            if set(ours) != set(theirs) or not _moved_alike(start, ours, theirs, names, minimum):
                raise LoopMismatch(f"window {self.number}: committed training state {j} is not the workload's "
                                   "(segment audits replay from it)")


class Peer:
    """A trainer node whose training is the caller's loop (`join`; module docstring)."""

    def __init__(self, node_dir: str | Path, *, model: Any = None, check: str = "first") -> None:
        if check not in CHECKS:
            raise ValueError(f"check must be one of {', '.join(CHECKS)}, got {check!r}")
        path = Path(node_dir)
        config_path = path / "node.toml" if path.is_dir() else path
        config = load_config(config_path)
        if "trainer" not in config["roles"]:
            raise ConfigError(f"{config_path}: roles: a loop of your own trains; this node is not a trainer")
        for key in ("pool", "behaviour"):
            if key in config and (key != "behaviour" or config[key] != "honest"):
                raise ConfigError(f"{config_path}: {key}: not for a node whose loop is yours")
        self.check = check
        self._config = config
        self._runtime = build_runtime(config, config_path)
        from peerloom.backends.torch.workload import TorchWorkload

        workload = self._runtime.executor.workload
        if not isinstance(workload, TorchWorkload):
            self._runtime.close()
            raise ConfigError(f"{config_path}: workload: a loop of your own needs a torch workload "
                              f"(peerloom.workloads.torch_workload), got {type(workload).__name__}")
        if model is not None:
            try:
                _adopt(workload, model, config_path)
            except BaseException:
                self._runtime.close()
                raise
        self._workload: TorchWorkload = workload
        self._loop: _LoopWorkload = _LoopWorkload(workload)
        self._runtime.executor.workload = self._loop
        manifest = self._runtime.engine.revision.manifest
        self.auditable: bool = bool(manifest.audit)
        self.min_cosine: float = float(manifest.audit_min_cosine)
        self._checked: bool = False
        self._window: Window | None = None
        self._error: BaseException | None = None
        self._stop: Any = None  # (trio token, cancel scope) once running
        self._started: threading.Event = threading.Event()
        self._thread: threading.Thread = threading.Thread(target=self._run, name=f"peerloom-{config['name']}",
                                                          daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error

    @property
    def model(self) -> Any:
        """The trainer's ``nn.Module`` (the workload's, or the one `join` was given): each window loads the
        head's weights into it in place and publishes what it holds when the window's body ends."""
        return self._workload.model

    @property
    def peer_id(self) -> str:
        return self._runtime.identity.peer_id.to_text()

    def _run(self) -> None:
        import trio

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                port = await nursery.start(self._runtime.run)
                if "port_file" in self._config and port is not None:
                    from peerloom.adapters.storage import atomic_write

                    atomic_write(Path(self._config["port_file"]), f"{port}\n".encode())
                self._stop = (trio.lowlevel.current_trio_token(), nursery.cancel_scope)
                self._started.set()

        try:
            trio.run(main)
        except BaseException as exc:  # handed to the loop's thread by `windows`
            self._error = exc
        finally:
            self._loop.closed.set()
            self._started.set()
            self._close_runtime()

    def _close_runtime(self) -> None:
        self._runtime.close()
        write_stats(self._runtime, self._config)

    def _next_job(self) -> _Job | None:
        while True:
            try:
                return self._loop.jobs.get(timeout=0.2)
            except queue.Empty:
                if not self._thread.is_alive():
                    if self._error is not None:
                        raise RuntimeError(f"the node stopped: {self._error}") from self._error
                    return None

    def windows(self, limit: int | None = None) -> Iterator[Window]:
        """Each window this trainer holds a lease in, as it opens: the head's weights loaded into `model`. The
        body's end publishes it (`Window.publish`); a ``break`` or an exception abandons it (nothing is
        announced). Ends after `limit` windows, or when the node stops (RuntimeError if it failed)."""
        count = 0
        while limit is None or count < limit:
            job = self._next_job()
            if job is None:
                return
            workload = self._workload
            workload._load(job.params)
            workload.model.train()
            if job.checkpoints:
                workload._reset_buffers()  # as a checkpointed `train` starts (TorchWorkload.train)
            inner = job.inner_steps or 0
            number = job.step // inner + 1 if inner else self._runtime.engine.head.window + 1
            window = self._window = Window(self, job, number)
            try:
                yield window
            except GeneratorExit:  # the loop left by `break`, an exception or the peer closing
                job.finish(error=LoopStopped(f"window {number}: the loop left it unpublished"))
                raise
            window.publish()
            self._window = None
            count += 1

    def close(self) -> None:
        """Abandon the window in the loop, if any, stop the node and join its thread. Idempotent."""
        self._loop.closed.set()
        if self._window is not None:
            self._window._job.finish(error=LoopStopped("the peer closed"))
        while True:  # tasks queued but never handed to the loop
            try:
                self._loop.jobs.get_nowait().finish(error=LoopStopped("the peer closed"))
            except queue.Empty:
                break
        if self._stop is not None and self._thread.is_alive():
            import trio

            token, scope = self._stop
            try:
                trio.from_thread.run_sync(scope.cancel, trio_token=token)
            except trio.RunFinishedError:
                pass
        self._thread.join()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _adopt(workload: Any, model: Any, where: Path) -> None:
    """Train `model` (the caller's own module) in place of the workload's: ConfigError naming the first tensor
    whose name or shape differs from the workload's schema (the manifest's, checked at build)."""
    model.to(workload.device)
    state = {n: t for n, t in model.state_dict(keep_vars=True).items() if t.is_floating_point()}
    ours = {n: tuple(t.shape) for n, t in state.items()}
    theirs = {n: tuple(shape) for n, _, shape in workload.schema()}
    for name in sorted(set(ours) | set(theirs)):
        if ours.get(name) != theirs.get(name):
            raise ConfigError(f"{where}: model: tensor {name!r} is {ours.get(name, 'missing')}, the manifest's is "
                              f"{theirs.get(name, 'absent')}")
    workload.model = model
    workload._state = workload._state_tensors(model, workload.device)


def join(node_dir: str | Path, *, model: Any = None, check: str = "first") -> Peer:
    """Run the trainer node of `node_dir` (a node directory holding ``node.toml``, or the file) with your own
    training loop: a `Peer`, to use as a context manager and iterate with `Peer.windows` (module docstring).

    `model`: your ``nn.Module`` to train (default: the one your workload factory built), of the manifest's
    schema. `check`: under a revision with audits, replay the ``"first"`` window this peer trains (or
    ``"every"`` one) with the manifest's workload before publishing, and raise `LoopMismatch` in the loop
    when the update differs (spec/protocol.md §5.1). Raises ConfigError (one line) for an unusable config,
    a node that is not a trainer, a trainer pool or behaviour, a workload that is not a torch one, or a
    model whose tensors differ from the manifest's.
    """
    return Peer(node_dir, model=model, check=check)


__all__ = ["CHECKS", "LoopMismatch", "LoopStopped", "Peer", "Window", "join"]
