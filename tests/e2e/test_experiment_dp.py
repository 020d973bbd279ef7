"""`peerloom init --dp-*`: a manifest with `privacy` (spec/protocol.md §10), sigma chosen from the
budget when init knows how many windows the run has, and one-line errors for what DP-SGD cannot run with."""

import sys

import pytest

from peerloom import cli
from peerloom.experiment import Fleet

TORCH = "digits-mlp"
NUMPY = "tests.node_cluster:numpy_digits"


def _init(capsys, *args: str) -> tuple[int, str]:
    """`peerloom init ARGS` in this process: (exit status, stderr)."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["init", *args, "--base-port", "0"])
    return exit_.value.code, capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:Optimal order")
def test_init_dp_chooses_sigma_from_the_budget_and_experiment_toml_round_trips(tmp_path, capsys):
    from peerloom.privacy import epsilon, noise_multiplier_for

    code, err = _init(capsys, str(tmp_path / "e"), "--workload", TORCH, "--inner-steps", "8", "--windows", "5",
                      "--dp-epsilon", "8", "--dp-sample-rate", "0.05")
    assert code == 0, err
    fleet = Fleet.open(tmp_path / "e")
    privacy = fleet.revision().manifest.privacy
    sigma = noise_multiplier_for(epsilon=8.0, delta=1e-5, sample_rate=0.05, steps=40)
    assert (privacy.noise_multiplier, privacy.max_grad_norm, privacy.delta, privacy.sample_rate,
            privacy.epsilon_budget) == (sigma, 1.0, 1e-5, 0.05, 8.0)
    assert epsilon(noise_multiplier=sigma, sample_rate=0.05, steps=40, delta=1e-5) <= 8.0
    assert fleet.check().manifest_options["privacy"] == privacy  # experiment.toml's table matches the manifest
    assert fleet.layout["experiment"]["manifest_options"]["privacy"]["epsilon_budget"] == 8.0

    code, err = _init(capsys, str(tmp_path / "f"), "--workload", TORCH, "--inner-steps", "4", "--dp-epsilon", "3",
                      "--dp-sample-rate", "0.1", "--dp-noise-multiplier", "1.1", "--dp-max-grad-norm", "0.5",
                      "--dp-delta", "1e-6")
    assert code == 0, err
    privacy = Fleet.open(tmp_path / "f").revision().manifest.privacy
    assert (privacy.noise_multiplier, privacy.max_grad_norm, privacy.delta, privacy.sample_rate,
            privacy.epsilon_budget) == (1.1, 0.5, 1e-6, 0.1, 3.0)
    code, err = _init(capsys, str(tmp_path / "g"), "--workload", TORCH)
    assert code == 0 and Fleet.open(tmp_path / "g").revision().manifest.privacy is None


@pytest.mark.parametrize(("args", "says"), [
    (["--workload", TORCH, "--dp-epsilon", "8", "--dp-sample-rate", "0.05", "--windows", "5"], "--inner-steps"),
    (["--workload", TORCH, "--inner-steps", "4", "--dp-epsilon", "8", "--dp-sample-rate", "0.05"], "--windows"),
    (["--workload", TORCH, "--inner-steps", "4", "--dp-epsilon", "8", "--dp-noise-multiplier", "1"],
     "--dp-sample-rate"),
    (["--workload", TORCH, "--inner-steps", "4", "--dp-delta", "1e-6"], "--dp-epsilon"),
    (["--workload", TORCH, "--inner-steps", "4", "--dp-epsilon", "8", "--dp-sample-rate", "1.5",
      "--dp-noise-multiplier", "1"], "sample_rate"),
    (["--workload", NUMPY, "--inner-steps", "4", "--dp-epsilon", "8", "--dp-sample-rate", "0.1",
      "--dp-noise-multiplier", "1"], "torch workload"),
    # Opacus's own reason for a layer DP-SGD cannot train, in one line
    (["--workload", "tests.node_cluster:batchnorm_digits", "--inner-steps", "4", "--dp-epsilon", "8",
      "--dp-sample-rate", "0.1", "--dp-noise-multiplier", "1"], "BatchNorm"),
])
def test_init_dp_errors_are_one_line(tmp_path, capsys, args, says):
    code, err = _init(capsys, str(tmp_path / "e"), *args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and says in err, err
    assert not (tmp_path / "e").exists()


def test_init_dp_without_opacus_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "opacus", None)  # `import opacus` raises ImportError
    code, err = _init(capsys, str(tmp_path / "e"), "--workload", TORCH, "--inner-steps", "4", "--dp-epsilon", "8",
                      "--dp-sample-rate", "0.1", "--dp-noise-multiplier", "1")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "pip install 'peerloom[dp]'" in err, err


def test_status_shows_each_trainers_epsilon_the_budget_and_private_trainers(tmp_path):
    """`peerloom status` reads the privacy ledger of the first validator's newest head: each trainer's epsilon
    and DP-SGD steps against the budget, a ledger entry of a peer that is no node here, and (with
    private_data) which trainers hold private data."""
    import attrs

    from peerloom.adapters.database import DB_NAME, Database
    from peerloom.adapters.keys import load_identity
    from peerloom.core.chain import encode_chain_entry
    from peerloom.core.identity import PeerId
    from peerloom.core.objects import PrivacyParams
    from peerloom.experiment import Experiment, status_lines
    from tests.edge_fixtures import certify
    from tests.helpers import ident

    params = PrivacyParams(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5, sample_rate=0.05, epsilon_budget=8.0)
    root = Experiment(workload=TORCH, trainers=3, inner_steps=8, base_port=0,
                      manifest_options={"privacy": params, "private_data": True}).write(tmp_path / "exp")
    fleet = Fleet.open(root)
    before = status_lines(root)
    assert "privacy: DP-SGD, epsilon budget 8 per trainer over the revision (sigma 1.1, clip 1, q 0.05, " \
           "delta 1e-05); epsilon as of head window 0" in before
    assert all("epsilon 0.000 of 8 (0 steps)" in line for line in before if line.startswith("  trainer-"))

    revision = fleet.revision()
    peer = {n["name"]: PeerId.from_text(n["peer"]) for n in fleet.layout["nodes"]}
    stranger = ident(40).peer_id
    ledger = sorted([(peer["trainer-1"], 40, 1.5), (peer["trainer-2"], 16, 0.75), (stranger, 8, 0.5)])
    head = attrs.evolve(revision.genesis(), window=5, privacy=tuple(ledger), private=(peer["trainer-2"],))
    validator = load_identity(root / "nodes" / "validator-1" / "key")
    db = Database(root / "nodes" / "validator-1" / "store" / DB_NAME)
    db.put_record("chain/5", encode_chain_entry(head, certify(revision, head, (validator,))))
    db.close()
    lines = status_lines(root)
    print("\n".join(lines))
    row = {line.split()[0]: line for line in lines if line.startswith("  ") and len(line.split()) > 2}
    assert row["trainer-1"].endswith("epsilon 1.500 of 8 (40 steps)")
    assert row["trainer-2"].endswith("epsilon 0.750 of 8 (16 steps)  private data")
    assert row["trainer-3"].endswith("epsilon 0.000 of 8 (0 steps)")
    assert "epsilon" not in row["validator-1"] and "epsilon" not in row["reducer-1"]
    assert f"  peer {stranger.to_text()}  epsilon 0.500 of 8 (8 steps)" in lines
    assert "private data: admitted; private trainers as of head window 5: trainer-2" in lines
    assert any(line.endswith("head window    5  " + fleet.layout["nodes"][0]["listen"]) for line in lines)
