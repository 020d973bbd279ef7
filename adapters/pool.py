"""Trainer pools: one peer identity trains on many processes or GPUs with torch.distributed
(spec/pools.md).

A pool is one torch.distributed process group — gloo on the CPU, nccl on CUDA — whose rank 0 is the
ordinary `peerloom node` (identity key, connections, store) and whose other ranks are small workers that
hold only the workload. Two ways to start one, both from the trainer's own config:

- ``torchrun --nproc-per-node N -m peerloom node --config trainer.toml``: torchrun starts N copies and
  sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (`RankEnv.from_environ`);
- ``[pool] ranks = N`` in the config: rank 0 spawns ranks 1..N-1 itself (``python -m peerloom node`` with the
  same variables, on a free port of 127.0.0.1).

Per train task, rank 0 (`TrainerPool.train`, on the node's compute thread) announces the task — lease
sample indices, seed, inner steps — as JSON under ``peerloom/task/<k>`` in the group's TCPStore (never a
pickle); every worker (`run_worker`) waits for that key, and then all ranks run
`peerloom.backends.torch.pool.pool_train` together: broadcast of the head's weights, DDP inner steps on
their split of the lease, a closing all_gather. Rank 0 alone returns the pseudo-gradient, which the node
encodes, signs and announces as usual.

Failure (spec/pools.md "Failure"): any error on rank 0 during a task — a dead rank (gloo: connection
closed), a hung one (the group's ``timeout_s``), replicas that disagree — fails the task with `PoolError`
(logged as an error naming the cause): the engine gets TaskFailed and the trainer publishes nothing that
window. Rank 0 then tears the group down (``destroy_process_group``; its spawned ranks are terminated)
and re-forms it at once with fresh ranks on a fresh port; under torchrun, whose agent owns the ranks, it
shrinks to rank 0 alone for the rest of its life (restart torchrun to re-form). A worker exits on any
error, and when rank 0's store goes away.

torch is imported on first use, so numpy-only nodes import this module for free.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import attrs

from peerloom.backends.workload import takes_step

__all__ = ["DEFAULT_TIMEOUT_S", "PoolError", "PoolWorkload", "RankEnv", "TrainerPool", "check_pool_table",
           "run_worker"]

log = logging.getLogger("peerloom.pool")

DEFAULT_TIMEOUT_S = 60.0
"""Seconds a collective may wait for a rank before the pool fails."""
START_TIMEOUT_S = 300.0
"""Seconds rank 0 waits for the other ranks to start (import torch, build the workload) and check in."""
BACKENDS = ("auto", "gloo", "nccl")
TASK_PREFIX = "peerloom/task/"
READY_PREFIX = "peerloom/ready/"
GROUP_PREFIX = "peerloom/pg"
POLL_S = 0.02
"""How often a waiting worker looks for its next task in the store (seconds)."""
SPAWNED = "PEERLOOM_POOL_SPAWNED"
"""Set (to rank 0's pid) in the environment of the ranks a ``[pool]`` node spawns."""


class PoolError(RuntimeError):
    """A trainer pool failed a train task (a rank died or hung, or the replicas disagreed): no update for
    this window (spec/pools.md "Failure")."""


@attrs.frozen(kw_only=True)
class RankEnv:
    """Where this process sits in a pool, from torchrun's (or a spawning rank 0's) environment variables."""

    rank: int
    world: int
    local_rank: int
    master_addr: str
    master_port: int
    agent_store: bool = False
    """torchrun's agent hosts the TCPStore (``TORCHELASTIC_USE_AGENT_STORE``); else rank 0 does."""
    spawned_by: int | None = None
    """Rank 0's pid when rank 0 spawned this process (``[pool] ranks``); None under torchrun."""
    attempt: int = 0
    """torchrun's restart count (``TORCHELASTIC_RESTART_COUNT``): each restart's keys live apart in its store."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> RankEnv | None:
        """The pool position ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` name, or
        None when ``WORLD_SIZE`` is absent or 1 (not a pool). ValueError for a missing or malformed variable."""
        env = os.environ if environ is None else environ
        if int(env.get("WORLD_SIZE", "1") or "1") <= 1:
            return None
        try:
            world, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
            local = int(env.get("LOCAL_RANK", env["RANK"]))
            addr, port = env.get("MASTER_ADDR", "127.0.0.1"), int(env["MASTER_PORT"])
            spawned = int(env[SPAWNED]) if env.get(SPAWNED) else None
            attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or "0")
        except (KeyError, ValueError) as exc:
            raise ValueError(f"a pool rank needs RANK, WORLD_SIZE and MASTER_PORT as integers: {exc}") from None
        if not 0 <= rank < world or not 0 < port < 65536:
            raise ValueError(f"RANK {rank} must lie in [0, {world}) and MASTER_PORT {port} in [1, 65535]")
        return cls(rank=rank, world=world, local_rank=local, master_addr=addr, master_port=port,
                   agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True", spawned_by=spawned,
                   attempt=attempt)


POOL_KEYS = ("ranks", "timeout_s", "backend", "parallel", "split_points", "schedule", "microbatches")
PARALLEL_MODES = ("ddp", "fsdp", "pipeline")
"""``[pool] parallel``: replicas with DDP (spec/pools.md §2), FSDP2 shards (§6) or pipeline stages (§7)."""
SCHEDULES = ("gpipe", "1f1b")


def check_pool_table(table: Mapping[str, Any]) -> None:
    """Check a config's ``[pool]`` table: ``ranks`` (int >= 1), ``timeout_s`` (seconds > 0), ``backend``
    (auto, gloo or nccl), ``parallel`` (ddp, fsdp or pipeline), and for a pipeline ``split_points`` (names of
    the model's children where stages 1..N-1 begin), ``schedule`` (gpipe or 1f1b) and ``microbatches`` (int
    >= 1). ValueError naming the problem."""
    unknown = set(table) - set(POOL_KEYS)
    if unknown:
        raise ValueError(f"pool: unknown keys {', '.join(sorted(unknown))} ({', '.join(POOL_KEYS)})")
    parallel = table.get("parallel", "ddp")
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"pool.parallel must be one of {', '.join(PARALLEL_MODES)}, got {parallel!r}")
    staging = {"split_points", "schedule", "microbatches"} & set(table)
    if staging and parallel != "pipeline":
        raise ValueError(f"pool: {', '.join(sorted(staging))} only apply to parallel = \"pipeline\"")
    points = table.get("split_points", [])
    if not isinstance(points, list) or not all(isinstance(p, str) and p for p in points):
        raise ValueError(f"pool.split_points must be a list of child module names, got {points!r}")
    if table.get("schedule", "gpipe") not in SCHEDULES:
        raise ValueError(f"pool.schedule must be one of {', '.join(SCHEDULES)}, got {table['schedule']!r}")
    micro = table.get("microbatches", 1)
    if not isinstance(micro, int) or isinstance(micro, bool) or not 1 <= micro <= 4096:
        raise ValueError(f"pool.microbatches must be an integer in [1, 4096], got {micro!r}")
    ranks = table.get("ranks", 1)
    if not isinstance(ranks, int) or isinstance(ranks, bool) or not 1 <= ranks <= 1024:
        raise ValueError(f"pool.ranks must be an integer in [1, 1024], got {ranks!r}")
    timeout = table.get("timeout_s", DEFAULT_TIMEOUT_S)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout < float("inf"):
        raise ValueError(f"pool.timeout_s must be a positive number of seconds, got {timeout!r}")
    if table.get("backend", "auto") not in BACKENDS:
        raise ValueError(f"pool.backend must be one of {', '.join(BACKENDS)}, got {table['backend']!r}")


def _backend(choice: str, workload: Any) -> str:
    device = getattr(workload, "device", None)
    if choice != "auto":
        return choice
    return "nccl" if getattr(device, "type", "cpu") == "cuda" else "gloo"


def _step(workload: Any, parallel: str = "ddp", options: Mapping[str, Any] | None = None) -> Any:
    """The pool's train step for `workload`: DDP for a `TorchWorkload`, FSDP2 or pipeline stages when the pool
    shards it (`parallel`, with the pipeline's `options`), else the generic path. ValueError for a sharded
    pool of a workload that is not a `TorchWorkload` (only its model factory can be built sharded)."""
    import functools

    from peerloom.backends.torch import pool
    from peerloom.backends.torch.workload import TorchWorkload

    if parallel != "ddp":
        if not isinstance(workload, TorchWorkload):
            raise ValueError(f"a {parallel} pool builds a TorchWorkload's model sharded; "
                             f"{type(workload).__name__} is not one")
        from peerloom.backends.torch.pool_sharded import pool_train_sharded

        return functools.partial(pool_train_sharded, parallel=parallel, **(options or {}))
    return pool.pool_train if isinstance(workload, TorchWorkload) else pool.pool_train_generic


def _init_group(backend: str, store: Any, rank: int, world: int, timeout_s: float) -> None:
    import torch.distributed as dist

    dist.init_process_group(backend, store=dist.PrefixStore(GROUP_PREFIX, store), rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def _destroy_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group may fail to shut down cleanly; it is dropped either way
            log.debug("destroying a broken process group failed", exc_info=True)


class TrainerPool:
    """Rank 0 of a trainer pool: forms the group, announces each train task, fails and re-forms loudly.

    Args:
        workload: this node's workload (a `TorchWorkload` trains with DDP; any other workload with the
            generic path of `peerloom.backends.torch.pool`).
        ranks: the group size N (a node pools from 2; a group of 1 measures the pool's own overhead).
        timeout_s: the group's timeout (seconds): every collective.
        start_timeout_s: how long the other ranks may take to start and check in (seconds).
        backend: ``"gloo"``, ``"nccl"`` or ``"auto"`` (nccl when the workload trains on CUDA).
        argv: the command that starts one more rank (``python -m peerloom node --config ...``), for a pool
            that spawns its ranks; None under torchrun.
        env: this process's `RankEnv` under torchrun (rank 0); None for a spawning pool.
        parallel: ``"ddp"`` (every rank holds the whole model, spec/pools.md §2), ``"fsdp"`` (each holds 1/N
            of the params, gradients and optimizer state, §6) or ``"pipeline"`` (each holds one stage, §7).
        split_points, schedule, microbatches: a pipeline's stages (child names where stages 1..N-1 begin;
            None takes the workload's own ``split_points`` attribute if it has one, else balances the
            stages by parameter count), schedule (``gpipe`` or ``1f1b``) and micro-batches per
            global batch (None: N). Announced with every task, so the other ranks need no config of their own.

    `start` forms the group (blocking, up to `start_timeout_s`); `train` is the workload's ``train`` for the node's
    compute thread; `close` stops the workers. Thread-safe (one task at a time).
    """

    def __init__(self, workload: Any, *, ranks: int, timeout_s: float = DEFAULT_TIMEOUT_S, backend: str = "auto",
                 argv: Sequence[str] | None = None, env: RankEnv | None = None,
                 start_timeout_s: float = START_TIMEOUT_S, parallel: str = "ddp",
                 split_points: Sequence[str] | None = None, schedule: str = "gpipe",
                 microbatches: int | None = None) -> None:
        if ranks < 1:
            raise ValueError(f"a pool has at least 1 rank, got {ranks}")
        if parallel not in PARALLEL_MODES or schedule not in SCHEDULES:
            raise ValueError(f"parallel must be one of {PARALLEL_MODES} and schedule one of {SCHEDULES}")
        self.parallel = parallel
        self.options: dict[str, Any] = {} if parallel != "pipeline" else {
            "split_points": list(split_points or getattr(workload, "split_points", None) or []) or None,
            "schedule": schedule,
            "microbatches": microbatches}
        _step(workload, parallel)  # refuses a workload the mode cannot shard, before any rank starts
        if (argv is None) == (env is None):
            raise ValueError("a pool either spawns its ranks (argv) or runs under torchrun (env)")
        self.workload = workload
        self.ranks = ranks
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self.backend = _backend(backend, workload)
        self.argv = list(argv) if argv is not None else None
        self.env = env
        self.generation = 0
        self.failures = 0
        self.shrunk = False
        self._store: Any = None
        self._task = 0
        self._procs: list[subprocess.Popen[bytes]] = []
        self._lock = threading.Lock()

    @property
    def formed(self) -> bool:
        return self._store is not None

    def start(self) -> None:
        """Form the group: spawn ranks 1..N-1 (or meet torchrun's) and wait for all of them. PoolError if
        they do not all join within the timeout (the pool stays unformed; `train` tries again)."""
        with self._lock:
            self._form()

    def _form(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            raise PoolError("this process already holds a torch.distributed process group: one pool per process")
        self.generation += 1
        self._task = 0
        started = time.monotonic()
        try:
            store: dist.Store
            if self.env is not None:
                store = dist.PrefixStore(f"peerloom/attempt_{self.env.attempt}/", dist.TCPStore(
                    self.env.master_addr, self.env.master_port, self.ranks, is_master=not self.env.agent_store,
                    wait_for_workers=False, timeout=timedelta(seconds=self.timeout_s)))
            else:
                tcp_store = dist.TCPStore("127.0.0.1", 0, self.ranks, is_master=True, wait_for_workers=False,
                                          timeout=timedelta(seconds=self.timeout_s))
                self._spawn(tcp_store.port)
                store = tcp_store
            self._await_ranks(store)
            _init_group(self.backend, store, 0, self.ranks, self.timeout_s)
        except Exception as exc:
            self._teardown()
            raise PoolError(f"the pool could not form ({self.ranks} ranks, {self.backend}): {exc!r}") from exc
        self._store = store
        reset = getattr(self.workload, "reset_optimizer_state", None)
        if reset is not None:
            reset(None)  # fresh ranks hold no kept optimizer state: every replica starts fresh together
        log.info("trainer pool formed", extra={"fields": {
            "ranks": self.ranks, "backend": self.backend, "parallel": self.parallel, "generation": self.generation,
            "launcher": "torchrun" if self.env is not None else "spawn",
            "seconds": round(time.monotonic() - started, 3)}})

    def _await_ranks(self, store: Any) -> None:
        """Wait until ranks 1..N-1 have checked in (built their workload); PoolError if one exits first or
        `start_timeout_s` passes."""
        keys = [f"{READY_PREFIX}{rank}" for rank in range(1, self.ranks)]
        deadline = time.monotonic() + self.start_timeout_s
        while keys and not store.check(keys):
            if self._dead_ranks():
                raise PoolError(f"rank(s) {self._dead_ranks()} exited while starting")
            if time.monotonic() > deadline:
                raise PoolError(f"ranks did not start within {self.start_timeout_s} s")
            time.sleep(POLL_S)

    def _spawn(self, port: int) -> None:
        assert self.argv is not None
        for rank in range(1, self.ranks):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(self.ranks), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(self.ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            env[SPAWNED] = str(os.getpid())
            self._procs.append(subprocess.Popen(self.argv, env=env))

    def _teardown(self) -> None:
        """Drop the group and the store; terminate the ranks this process spawned."""
        _destroy_group()
        self._store = None
        for proc in self._procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self._procs:
            try:
                proc.wait(timeout=3.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs = []

    def rank_pids(self) -> list[int]:
        """The pids of the ranks this pool spawned (ranks 1..N-1 in order; empty under torchrun)."""
        return [p.pid for p in self._procs]

    def _dead_ranks(self) -> list[int]:
        return [rank for rank, p in enumerate(self._procs, start=1) if p.poll() is not None]

    def train(self, params: Any, indices: Sequence[int], seed: int, *, epochs: int | None = None,
              inner_steps: int | None = None, state_key: Any = None, step: int = 0,
              sink: Any = None) -> tuple[Any, dict[str, float | int]]:
        """The workload's ``train`` run by the whole pool; returns rank 0's ``(delta, metrics)``. `step` is the
        run's global step (spec/protocol.md §5.1), passed on to a workload that takes it (``TAKES_STEP``).
        `sink` (sharded pools only): ``sink(name, float32 array)`` gets the pseudo-gradient one tensor at a
        time in name order, and the delta returned is None; after a PoolError, what it got is partial and
        must be dropped (spec/pools.md §6). `params` may then be `FileTensor`s read one tensor at a time.

        Raises ValueError (checked on rank 0 before the ranks hear of the task: empty lease, out-of-range
        index, params of the wrong schema) and PoolError when the pool fails the task; after a PoolError the
        group is re-formed (spawning pool) or the pool shrinks to rank 0 (torchrun). `state_key` must be None
        (one trainer per pool).
        """
        if state_key is not None:
            raise ValueError("a trainer pool trains for one peer: state_key must be None")
        if sink is not None and self.parallel == "ddp":
            raise ValueError("only a sharded pool (fsdp, pipeline) streams its delta to a sink")
        with self._lock:
            if self.shrunk and self.parallel != "ddp":
                raise PoolError(f"a {self.parallel} pool cannot shrink to rank 0 (the model is sharded): "
                                "restart torchrun to re-form it; no update")
            if self.shrunk:
                options = {k: v for k, v in (("epochs", epochs), ("inner_steps", inner_steps)) if v is not None}
                if step and takes_step(self.workload):
                    options["step"] = step
                return self.workload.train(params, indices, seed, **options)
            if not self.formed:
                self._form()
            self._check_task(params, indices)
            task = {"op": "train", "indices": [int(i) for i in indices], "seed": int(seed),
                    "inner_steps": inner_steps, "epochs": epochs, "step": int(step), "parallel": self.parallel,
                    "options": self.options}
            started = time.monotonic()
            try:
                dead = self._dead_ranks()
                if dead:
                    raise PoolError(f"rank(s) {dead} exited")
                self._announce(task)
                extra = {"sink": sink} if sink is not None else {}
                delta, metrics = _step(self.workload, self.parallel, self.options)(
                    self.workload, params, indices, seed, inner_steps=inner_steps, epochs=epochs, step=step,
                    **extra)
            except Exception as exc:
                self._fail(exc, time.monotonic() - started)
                raise PoolError(f"trainer pool failed this task, no update: {exc!r}") from exc
            assert delta is not None or sink is not None
            return delta, metrics

    def _check_task(self, params: Any, indices: Sequence[int]) -> None:
        if len(indices) == 0:
            raise ValueError("indices must be a non-empty sequence of ints")
        num_train = getattr(self.workload, "num_train", None)
        if num_train is not None and not all(0 <= int(i) < num_train for i in indices):
            raise ValueError(f"indices must lie in [0, {num_train})")
        from peerloom.backends.numpy.tensors import schema_of

        if schema_of(params) != tuple(self.workload.schema()):
            raise ValueError(f"params have schema {schema_of(params)}, expected {self.workload.schema()}")

    def _announce(self, task: dict[str, Any]) -> None:
        self._store.set(f"{TASK_PREFIX}{self._task}", json.dumps(task))
        self._task += 1

    def _fail(self, exc: BaseException, seconds: float) -> None:
        """Log the failure, tear the group down and re-form it (spawning) or shrink to rank 0 (torchrun)."""
        self.failures += 1
        log.error("trainer pool failed: this window's update is skipped", extra={"fields": {
            "error": repr(exc), "ranks": self.ranks, "backend": self.backend, "generation": self.generation,
            "dead_ranks": self._dead_ranks(), "seconds": round(seconds, 3), "timeout_s": self.timeout_s}})
        self._teardown()
        if self.env is not None:
            self.shrunk = True
            log.error("trainer pool shrunk to rank 0: torchrun owns the other ranks; restart torchrun to "
                      "re-form the pool", extra={"fields": {"ranks": self.ranks}})
            return
        try:
            self._form()
        except PoolError as form_error:
            log.error("trainer pool could not re-form; trying again at the next task",
                      extra={"fields": {"error": repr(form_error)}})

    def close(self) -> None:
        """Tell the workers to stop, then tear the group down. Idempotent."""
        with self._lock:
            if self._store is not None:
                try:
                    self._announce({"op": "stop"})
                    deadline = time.monotonic() + 5.0
                    while any(p.poll() is None for p in self._procs) and time.monotonic() < deadline:
                        time.sleep(POLL_S)
                except Exception:
                    log.debug("stopping the pool's workers failed", exc_info=True)
            self._teardown()


class PoolWorkload:
    """A workload whose ``train`` runs on a `TrainerPool`; everything else (``evaluate``, ``loss``, ``schema``,
    ``initial_params``, ...) is the wrapped workload's, on rank 0 alone (``loss`` is forward passes only: it
    needs no collective, and the other ranks never hear of it)."""

    TAKES_STEP = True
    """``train`` takes the run's global step (``step``) and hands it to every rank (`TrainerPool.train`), so a
    pooled trainer's LR schedule spans windows as the validators' replay does (spec/protocol.md §5.1)."""

    def __init__(self, workload: Any, pool: TrainerPool) -> None:
        self.workload = workload
        self.pool = pool

    @property
    def inner(self) -> Any:
        """The wrapped workload (`peerloom.backends.workload.Wrapper`)."""
        return self.workload

    @property
    def STREAMS_DELTA(self) -> bool:
        """``train`` takes ``sink`` and params read from the store (a sharded pool: spec/pools.md §6), so the
        node streams the head in and the pseudo-gradient out, never holding the whole model."""
        return self.pool.parallel != "ddp"

    def train(self, params: Any, indices: Sequence[int], seed: int, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        return self.pool.train(params, indices, seed, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.workload, name)


def run_worker(workload: Any, env: RankEnv, *, timeout_s: float = DEFAULT_TIMEOUT_S, backend: str = "auto") -> int:
    """A pool rank > 0: join the group, then run every task rank 0 announces until it says stop (returns 0)
    or goes away (its store closes, or, for a spawned rank, rank 0's pid changes: returns 1). Errors during
    a task propagate: the worker exits and rank 0 fails the task and re-forms the pool."""
    import torch
    import torch.distributed as dist

    chosen = _backend(backend, workload)
    if chosen == "nccl":
        torch.cuda.set_device(env.local_rank)
    store: dist.Store = dist.TCPStore(env.master_addr, env.master_port, env.world, is_master=False,
                                      timeout=timedelta(seconds=timeout_s))
    if env.spawned_by is None:  # torchrun's store outlives a restart: this attempt's keys apart (as rank 0's)
        store = dist.PrefixStore(f"peerloom/attempt_{env.attempt}/", store)
    store.set(f"{READY_PREFIX}{env.rank}", "1")
    _init_group(chosen, store, env.rank, env.world, timeout_s)
    log.info("pool rank joined", extra={"fields": {"rank": env.rank, "ranks": env.world, "backend": chosen}})
    task_number = 0
    try:
        while True:
            key = f"{TASK_PREFIX}{task_number}"
            while not store.check([key]):
                if env.spawned_by is not None and os.getppid() != env.spawned_by:
                    log.warning("pool rank 0 is gone: exiting", extra={"fields": {"rank": env.rank}})
                    return 1
                time.sleep(POLL_S)
            task = json.loads(store.get(key))
            task_number += 1
            if task.get("op") == "stop":
                log.info("pool rank stopping", extra={"fields": {"rank": env.rank}})
                return 0
            step = _step(workload, task.get("parallel", "ddp"), task.get("options"))  # rank 0's choice
            step(workload, None, task["indices"], int(task["seed"]), inner_steps=task.get("inner_steps"),
                 epochs=task.get("epochs"), step=int(task.get("step", 0)))
    except (dist.DistError, RuntimeError, ValueError, MemoryError) as exc:
        log.error("pool rank failed: exiting", extra={"fields": {"rank": env.rank, "error": repr(exc)}})
        return 1
    finally:
        _destroy_group()

