"""`peerloom node` config validation gives clear errors; `peerloom keygen` never overwrites a key."""


import pytest

from peerloom.node import ConfigError, build_node_workload, build_runtime, load_config
from tests.helpers import NODE_AUTHORITY, NODE_CONFIG, ident, make_revision, node_config
from tests.node_zygote import run_cli


def test_missing_keys_are_named(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text('name = "x"\nroles = ["trainer"]\n')
    with pytest.raises(ConfigError, match="missing key, manifest, authority, store"):
        load_config(path)


def test_bad_toml_is_reported(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text("name = \n")
    with pytest.raises(ConfigError, match=r"node\.toml"):
        load_config(path)


def test_relative_paths_resolve_next_to_config(tmp_path):
    assert load_config(node_config(tmp_path))["store"] == tmp_path / "s"


@pytest.mark.parametrize(("extra", "message"), [
    ('compute = "jax"\n', "compute must be numpy or torch, got 'jax'"),
    ("compute = 1\n", "compute must be"),
    ("compute_threads = 0\n", "compute_threads must be in [1, 8], got 0"),
    ("compute_threads = 9\n", "compute_threads must be in [1, 8], got 9"),
    ('compute_threads = "2"\n', "compute_threads"),
    ('device = "tpu"\n', "device 'tpu' is not one of cpu, cuda, cuda:N, mps, auto"),
    ('device = "cuda:x"\n', "device 'cuda:x' is not one of"),
    ('device = "cuda:64"\n', "device 'cuda:64' is not available on this machine"),
    ('listen = "127.0.0.1"\n', "must be host:port"),
    ('bootstrap = ["127.0.0.1:x"]\n', "must be host:port"),
    ("bootstrap = [7001]\n", "bootstrap entries"),
    ("capacity = 0\n", "capacity must be at least 1"),
    ("keep_windows = -1\n", "keep_windows must be 0 (keep every artifact) or more, got -1"),
    ("keep_windows = \"2\"\n", "keep_windows"),
    ("agreement_timeout_s = 0\n", "agreement_timeout_s must be positive, got 0"),
    ('agreement_timeout_s = "1"\n', "agreement_timeout_s"),
    ('capacity = "2"\n', "capacity must be an integer, got '2'"),
    ('lisen = "127.0.0.1:1"\n', "lisen: unknown key (did you mean 'listen'?); valid keys: admission,"),
    ('log_format = "xml"\n', "log_format"),
    ("[http]\nenabled = 1\n", "http.enabled"),
    ('[http]\nenabled = true\nlisten = "nope"\n', "must be host:port"),
    ('[http]\nport = 80\n', "http: unknown keys port"),
    ("[discovery]\nmdns = 1\n", "discovery takes one key"),
    ('workload = "no-such-workload"\n', "not a registry name"),
    ('workload = "no_such_module_xyz:make"\n', "cannot import no_such_module_xyz"),
    ('workload = "json:no_such_function"\n', "has no callable"),
])
def test_bad_values_are_named(tmp_path, extra, message):
    with pytest.raises(ConfigError) as caught:
        load_config(node_config(tmp_path, extra))
    assert message in str(caught.value)


def test_bad_roles_and_authority(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text(NODE_CONFIG.replace('["trainer"]', '["trainer", "miner"]'))
    with pytest.raises(ConfigError, match="roles must be"):
        load_config(path)
    path.write_text(NODE_CONFIG.replace(NODE_AUTHORITY, "12D3KooWnotapeer"))
    with pytest.raises(ConfigError, match="is not a peer id"):
        load_config(path)


def test_missing_manifest_is_a_config_error(tmp_path):
    config = load_config(node_config(tmp_path))
    with pytest.raises(ConfigError, match="manifest"):
        build_runtime(config)
    assert (tmp_path / "k").exists()  # the identity key was created first, with 0600 (tests/adapters/test_storage.py)


def make_tiny_workload(seed, num_shards):
    """A user's workload factory (the `module:function` form); returns (workload, shards)."""
    return ("tiny", seed), [[i] for i in range(num_shards)]


def make_three_shards(seed, num_shards):
    return "fixed", [[0], [1], [2]]


def test_workload_factory_by_import_path(tmp_path):
    config = load_config(node_config(tmp_path, 'workload = "tests.peerloom.test_node_config:make_tiny_workload"\n'))
    workload, shards = build_node_workload(config, "digits-mlp", 5, 3)
    assert workload == ("tiny", 5) and shards == [[0], [1], [2]]
    fixed = load_config(node_config(tmp_path, 'workload = "tests.peerloom.test_node_config:make_three_shards"\n'))
    with pytest.raises(ConfigError, match="returned 3 shards, the manifest has 4"):
        build_node_workload(fixed, "digits-mlp", 5, 4)
    other = load_config(node_config(tmp_path, 'workload = "digits-numpy"\n'))
    with pytest.raises(ConfigError, match="differs from the manifest"):
        build_node_workload(other, "digits-mlp", 0, 4)


def test_cli_reports_config_errors_without_a_traceback(tmp_path):
    path = node_config(tmp_path, "capacity = 0\n")
    out = run_cli(["node", "--config", path])
    assert out.returncode != 0 and "capacity must be at least 1" in out.stderr and "Traceback" not in out.stderr


def test_keygen_prints_peer_id_and_refuses_overwrite(tmp_path):
    key = tmp_path / "id.key"
    out = run_cli(["keygen", key])
    assert out.returncode == 0 and out.stdout.startswith("12D3KooW")
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    again = run_cli(["keygen", key])
    assert again.returncode != 0 and "refusing to overwrite" in again.stderr


def test_behaviour_is_checked_and_applies_to_trainers_only(tmp_path):
    with pytest.raises(ConfigError, match="behaviour must be honest or one of"):
        load_config(node_config(tmp_path, 'behaviour = "nice"\n'))
    path = tmp_path / "node.toml"
    path.write_text(NODE_CONFIG.replace('["trainer"]', '["validator"]') + 'behaviour = "alie"\n')
    with pytest.raises(ConfigError, match="only role is trainer"):
        load_config(path)
    assert load_config(node_config(tmp_path, 'behaviour = "sign-flip-scale"\n'))["behaviour"] == "sign-flip-scale"


def test_byzantine_workload_sends_the_attack_update():
    import numpy as np

    from peerloom.backends.behaviours import ByzantineWorkload
    from tests.node_cluster import numpy_digits

    honest, shards = numpy_digits(0, 4)
    params = honest.initial_params(0)
    good, _ = honest.train(params, shards[0], 5)
    flipped, metrics = ByzantineWorkload(honest, "sign-flip-scale").train(params, shards[0], 5)
    assert set(flipped) == set(good) and "train_loss" in metrics
    for name in good:
        np.testing.assert_allclose(flipped[name], -10.0 * good[name], rtol=1e-6)
    alie, _ = ByzantineWorkload(honest, "alie").train(params, shards[0], 5)
    assert any(not np.allclose(alie[n], good[n]) for n in good)
    assert ByzantineWorkload(honest, "alie").evaluate(params) == honest.evaluate(params)  # the rest is honest


class _Counted:
    """A workload instance per factory call, with `make_revision`'s schema (a node checks it at start)."""

    @staticmethod
    def schema():
        return (("w", "float32", (2,)),)


def make_counted_workload(seed, num_shards):
    return _Counted(), [[i] for i in range(num_shards)]


@pytest.mark.parametrize(("roles", "extra", "worker"), [
    ('["validator"]', "", True),
    ('["validator"]', "audit_worker = false\n", False),
    ('["trainer"]', "", False),
])
def test_validators_under_sampled_audits_get_an_audit_worker(tmp_path, roles, extra, worker):
    """A validator under sampled audits runs them on an executor of its own, with its own workload instance
    over the same store (`ComputeSlot`, spec/protocol.md §6.3 "Scheduling"); ``audit_worker = false`` and
    other roles run them (if at all) on the one executor."""
    import attrs

    from peerloom.core.objects import Revision

    authority = ident(200)
    manifest = attrs.evolve(make_revision().manifest, audit=True, audit_rate=0.5)
    revision = Revision.verify(manifest.seal(authority), authority.peer_id)
    (tmp_path / "m").write_bytes(revision.envelope.to_bytes())
    text = node_config(tmp_path, 'workload = "tests.peerloom.test_node_config:make_counted_workload"\n' + extra)
    text.write_text(text.read_text().replace('roles=["trainer"]', f"roles={roles}"))
    runtime = build_runtime(load_config(text))
    try:
        audits = runtime.audit_executor
        assert (audits is not None) == worker
        if audits is not None:
            assert audits.store is runtime.executor.store
            assert isinstance(audits.workload, _Counted) and audits.workload is not runtime.executor.workload
    finally:
        runtime.close()


@pytest.mark.parametrize(("extra", "timeout_s"), [("", 2.0), ("agreement_timeout_s = 0.5\n", 0.5)])
def test_agreement_timeout_reaches_the_engine(tmp_path, extra, timeout_s):
    from peerloom.core.objects import Revision

    authority = ident(200)
    revision = Revision.verify(make_revision().manifest.seal(authority), authority.peer_id)
    (tmp_path / "m").write_bytes(revision.envelope.to_bytes())
    text = node_config(tmp_path, 'workload = "tests.peerloom.test_node_config:make_counted_workload"\n' + extra)
    runtime = build_runtime(load_config(text))
    try:
        assert runtime.engine.config.agreement_timeout_s == timeout_s
    finally:
        runtime.close()
