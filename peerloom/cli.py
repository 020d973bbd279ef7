"""The `peerloom` command: `demo`, `node`, `verify`, `keygen`, `admit`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from peerloom import admit as admit_cmd
from peerloom import inspect as inspect_cmd
from peerloom import light as light_cmd
from peerloom import simulate


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="peerloom", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a real model across local OS processes over TCP+Noise")
    demo.add_argument("--profile", choices=("smoke", "default"), default="default")
    demo.add_argument("--out", type=Path, default=Path("peerloom-demo"), help="output directory")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--kill-trainer-at", type=int, default=None, metavar="WINDOW",
                      help="SIGKILL a trainer holding a lease in WINDOW as that window opens (not restarted)")
    demo.add_argument("--rule", default=None, metavar="RULE",
                      help="aggregation rule for the manifest (default: the profile's robust rule; "
                           "`mean` shows what the defence is worth)")
    demo.add_argument("--workload", choices=("digits", "charlm"), default="digits",
                      help="digits: MLP on scikit-learn digits; charlm: character-level transformer on the "
                           "Python docs that ship with CPython")

    node = sub.add_parser("node", help="run one node from a TOML config until SIGTERM")
    node.add_argument("--config", type=Path, required=True)

    verify = sub.add_parser("verify", help="verify a chain directory (manifest.cbor + NNNNNN.cbor) from genesis")
    verify.add_argument("chain", type=Path)
    verify.add_argument("--authority", default=None, help="peer id that must have signed the manifest")

    keygen = sub.add_parser("keygen", help="create an identity key file (mode 0600) and print its peer id")
    keygen.add_argument("path", type=Path)
    admit_cmd.add_parser(sub)
    simulate.add_parser(sub)
    inspect_cmd.add_parser(sub)
    light_cmd.add_parser(sub)

    args = parser.parse_args(argv)
    if args.command == "demo":
        from peerloom.demo import run_demo

        sys.exit(run_demo(profile=args.profile, out=args.out, seed=args.seed,
                          kill_trainer_at=args.kill_trainer_at, rule=args.rule, workload=args.workload))
    elif args.command == "node":
        from peerloom.node import ConfigError, run_node

        try:
            run_node(args.config)
        except ConfigError as exc:
            sys.exit(f"peerloom node: {exc}")
    elif args.command == "verify":
        from peerloom.verify import run_verify

        sys.exit(run_verify(args.chain, args.authority))
    elif args.command == "sim":
        sys.exit(simulate.run(args))
    elif args.command == "inspect":
        sys.exit(inspect_cmd.run(args))
    elif args.command == "light":
        sys.exit(light_cmd.run(args))
    elif args.command == "admit":
        sys.exit(admit_cmd.run(args))
    elif args.command == "keygen":
        from peerloom.adapters.keys import generate_identity, save_identity

        identity = generate_identity()
        try:
            save_identity(identity, args.path)
        except FileExistsError:
            sys.exit(f"peerloom keygen: {args.path} exists; refusing to overwrite a key")
        print(identity.peer_id.to_text())
