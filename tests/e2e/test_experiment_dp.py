"""`peerloom init --dp-*` (issue 32): a manifest with `privacy` (spec/protocol.md §10), sigma chosen from the
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
