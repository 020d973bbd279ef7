"""Small builders shared by tests: identities, a manifest, a revision, heads and their certificates; and the
pieces of a connection pair (a served handler, the peers at either end, a raw sender that plays a broken peer)."""

import functools
from collections.abc import Awaitable, Callable

import trio

from peerloom.adapters.noise import frame
from peerloom.adapters.tcp import LANE_WINDOW, SecureConnection, serve
from peerloom.adapters.transport import LANE_BULK, LANE_CONTROL, TransportError
from peerloom.core.identity import Identity
from peerloom.core.objects import PRECOMMIT, Head, Manifest, QuorumCertificate, Revision, make_artifact_ref, sign_vote


def ident(n: int) -> Identity:
    return Identity(bytes([n]) * 32)


def make_revision(*, validators=None, quorum=1, trainers=(), shards=(10, 10, 10, 10), window_s=5.0,
                  min_updates=1, genesis=b"genesis params", schema=(("w", "float32", (2,)),),
                  authority=None, chunk_size=64 * 1024, params_digest=None) -> Revision:
    authority = authority or ident(200)
    validators = validators or (ident(1),)
    ref = make_artifact_ref(genesis, chunk_size)
    manifest = Manifest(
        experiment="test", workload="digits-mlp", workload_seed=0, schema=tuple(schema), shards=tuple(shards),
        validators=tuple(v.peer_id for v in validators), quorum=quorum, window_s=window_s,
        min_updates=min_updates, max_capacity=4, aggregation="mean", outer_optimizer="fedavg", outer_lr=1.0,
        chunk_size=chunk_size, genesis_params=ref, genesis_params_digest=params_digest or ref.digest,
        roster=tuple(sorted((t.peer_id, 1) for t in trainers)))
    return Revision.verify(manifest.seal(authority), authority.peer_id)


def certify(revision, head, signers, round_=0, step=PRECOMMIT):
    """A quorum certificate for `head` from the votes of `signers`."""
    votes = {s.peer_id: sign_vote(s, revision.id, head.window, round_, step, head.id).signature for s in signers}
    return QuorumCertificate.from_votes(head.id, head.window, round_, votes)


def child(revision, parent, **changes):
    """The head after `parent` (one cohort update, the same params and roster), with `changes`."""
    fields = dict(revision=revision.id, parent=parent.id, window=parent.window + 1, skipped=False,
                  params=parent.params, params_digest=parent.params_digest, cohort=(b"\x12\x20" + b"\1" * 32,),
                  roster=parent.roster, quarantine=(), metrics={"test_accuracy": 0.5})
    fields.update(changes)
    return Head(**fields)


# A trainer's node config with every required key (the authority is make_revision's).
NODE_AUTHORITY = ident(200).peer_id.to_text()
NODE_CONFIG = f'name="n"\nroles=["trainer"]\nkey="k"\nmanifest="m"\nauthority="{NODE_AUTHORITY}"\nstore="s"\n'


def node_config(tmp_path, extra=""):
    """tmp_path/node.toml holding NODE_CONFIG and then `extra`."""
    path = tmp_path / "node.toml"
    path.write_text(NODE_CONFIG + extra)
    return path


# --- connection pairs ------------------------------------------------------------------------------------

HOST = "127.0.0.1"
SERVER = ident(1)  # the listening end
CLIENT = ident(2)  # the dialing end
OTHER = ident(3)  # a third peer: the one a dial did not expect, or a second server

Handler = Callable[[SecureConnection], Awaitable[object]]


async def echo(conn: SecureConnection) -> None:
    """Send every message back on the lane it came on, until the connection ends."""
    async def lane(n: int) -> None:
        while True:
            await conn.send_message(await conn.receive_message(n), lane=n)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lane, LANE_CONTROL)
            nursery.start_soon(lane, LANE_BULK)
    except* TransportError:
        pass


def collect_errors(errors: list[TransportError]) -> Callable[[SecureConnection], Awaitable[None]]:
    """A handler that reads until the connection fails and appends the failure to `errors`."""
    async def handler(conn: SecureConnection) -> None:
        try:
            while True:
                await conn.receive_message()
        except TransportError as exc:
            errors.append(exc)

    return handler


async def wait_for(items: list, timeout: float = 10) -> None:
    """Return once `items` holds something (a TooSlowError after `timeout` s)."""
    with trio.fail_after(timeout):
        while not items:
            await trio.sleep(0.01)


async def raw_send(conn: SecureConnection, plaintexts: list[bytes]) -> None:
    """Encrypt and write Noise transport messages by hand: a lying or broken peer."""
    await conn._stream.send_all(b"".join(frame(conn._transport.encrypt(p)) for p in plaintexts))


def run_with_server(body: Callable[[int], Awaitable[None]], handler: Handler = echo, **server_kwargs) -> None:
    """Serve TCP+Noise as SERVER on 127.0.0.1:0 with `handler`, run `body(port)` (30 s limit), then stop."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(functools.partial(serve, HOST, 0, SERVER, handler, **server_kwargs))
            with trio.fail_after(30):
                await body(port)
            nursery.cancel_scope.cancel()

    trio.run(main)


class StalledBulk:
    """A bulk lane stalled by flow control (spec/transport.md §11): `handler` (the far end) echoes control
    messages at once but reads no bulk until `stall` (the near end) has sent `count` bulk messages of `size`
    bytes, seen its credit spent and control flowing both ways meanwhile; then it reads them all and answers
    b"all". With `measure_queue` the handler records the most bulk bytes its connection queued."""

    def __init__(self, size: int, count: int, *, measure_queue: bool = False) -> None:
        self.size, self.count, self.measure_queue = size, count, measure_queue
        self.release = trio.Event()
        self.received: list[bytes] = []
        self.peak_queued = 0

    async def handler(self, conn) -> None:
        async def control() -> None:
            while True:
                await conn.send_message(await conn.receive_message(LANE_CONTROL), lane=LANE_CONTROL)

        async def bulk() -> None:
            await self.release.wait()  # the application reads no bulk until released
            while len(self.received) < self.count:
                if self.measure_queue:
                    self.peak_queued = max(self.peak_queued, conn.queued_bytes(LANE_BULK))
                self.received.append(await conn.receive_message(LANE_BULK))
            await conn.send_message(b"all", lane=LANE_CONTROL)

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(control)
                nursery.start_soon(bulk)
        except* TransportError:
            pass

    async def stall(self, conn, credit: Callable[[], int], rounds: int) -> None:
        """Send the bulk from `conn` until `credit()` (its bulk send credit) is spent, exchange `rounds`
        control messages, check the sender stalled, release the far end and check everything arrived."""
        sent = [0]

        async def send_bulk() -> None:
            for i in range(self.count):
                await conn.send_message(bytes([i]) * self.size, lane=LANE_BULK)
                sent[0] += 1

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_bulk)
            with trio.fail_after(10):
                while credit() > 0 or sent[0] == 0:  # the sender has spent its credit
                    await trio.sleep(0.01)
            for i in range(rounds):  # control keeps flowing both ways while bulk is stalled
                await conn.send_message(str(i).encode(), lane=LANE_CONTROL)
                assert await conn.receive_message(LANE_CONTROL) == str(i).encode()
            assert sent[0] <= LANE_WINDOW // self.size + 1 < self.count  # stalled by flow control, not finished
            self.release.set()
        assert await conn.receive_message(LANE_CONTROL) == b"all"
        assert self.received == [bytes([i]) * self.size for i in range(self.count)]
