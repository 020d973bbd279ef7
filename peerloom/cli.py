"""The `peerloom` command.

Your own experiment: `init` (a directory: manifest, keys, node configs), `up` (its fleet as local
processes), `status`, then `export` (the certified weights) and `verify`. Also: `demo`, `node` (one node of
a deployment), `keygen`, `admit`, `auth`, `login`, `light`, `inspect`, `sim`.

Errors a user can cause (a missing file, invalid TOML, a wrong key or type, a port in use, a missing
extra) end in one line on stderr and exit status 2; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import errno
import sys
import tomllib
from pathlib import Path

from peerloom import admit as admit_cmd
from peerloom import auth as auth_cmd
from peerloom import experiment as experiment_cmd
from peerloom import export as export_cmd
from peerloom import inspect as inspect_cmd
from peerloom import light as light_cmd
from peerloom import login as login_cmd
from peerloom import simulate


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _dispatch(args)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:
        message = None if args.debug else user_error(exc, args.command)
        if message is None:
            raise
        print(f"peerloom {args.command}: {message}", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    """The `peerloom` command line: every command and its options (`peerloom --help`)."""
    parser = argparse.ArgumentParser(prog="peerloom", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    experiment_cmd.add_parsers(sub)  # init, up, status: the way in, listed first

    demo = sub.add_parser("demo", help="train a real model across local OS processes over TCP+Noise")
    demo.add_argument("--profile", choices=("smoke", "default"), default="default")
    demo.add_argument("--out", type=Path, default=Path("peerloom-demo"), help="output directory")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--kill-trainer-at", type=int, default=None, metavar="WINDOW",
                      help="SIGKILL a trainer holding a lease in WINDOW as that window opens (not restarted)")
    demo.add_argument("--rule", default=None, metavar="RULE",
                      help="aggregation rule for the manifest (default: the profile's robust rule; "
                           "`mean` shows what the defence is worth)")
    demo.add_argument("--workload", choices=("digits", "mnist1d", "charlm"), default="digits",
                      help="digits: MLP on scikit-learn digits; mnist1d: MLP on MNIST-1D, generated locally and "
                           "harder; charlm: character-level transformer on the "
                           "Python docs that ship with CPython")

    node = sub.add_parser("node", help="run one node from a TOML config until SIGTERM")
    node.add_argument("--config", type=Path, required=True)
    node.add_argument("--stop-after-window", type=int, default=None, metavar="WINDOW",
                      help="open no window after this one (replaces the config's stop_after_window)")

    verify = sub.add_parser("verify", help="verify a chain from genesis: an experiment directory (its first "
                                           "validator's store), a chain directory (manifest.cbor + NNNNNN.cbor) "
                                           "or a node store (node.db, or a node directory with store/)")
    verify.add_argument("chain", type=Path, metavar="PATH")
    verify.add_argument("--authority", default=None, help="peer id that must have signed the manifest")
    verify.add_argument("--manifest", type=Path, default=None, metavar="FILE",
                        help="the signed manifest, for a store or directory that holds no manifest.cbor")

    keygen = sub.add_parser("keygen", help="create an identity key file (mode 0600) and print its peer id")
    keygen.add_argument("path", type=Path)
    export_cmd.add_parser(sub)
    admit_cmd.add_parser(sub)
    auth_cmd.add_parser(sub)
    login_cmd.add_parser(sub)
    simulate.add_parser(sub)
    inspect_cmd.add_parser(sub)
    light_cmd.add_parser(sub)
    return parser


# Which extra brings each optional module (pyproject.toml's [project.optional-dependencies]).
EXTRA_OF = {"trio": "node", "aiohttp": "node", "prometheus_client": "node", "cryptography": "node",
            "zeroconf": "node", "tomli_w": "node", "jwt": "auth",
            "torch": "torch", "sklearn": "demo", "matplotlib": "demo"}


def user_error(exc: BaseException, command: str = "") -> str | None:
    """The one-line message for an error the user caused, or None for a bug (whose traceback shows).

    A missing optional module names the extra that brings it (`demo` for anything `peerloom demo` lacks).
    An exception group holding a single such error (trio's nurseries wrap them) is unwrapped.
    """
    from peerloom.core.errors import LocalProtocolError, PeerloomError
    from peerloom.sim.scenario import ScenarioError

    node = sys.modules.get("peerloom.node")  # imported only by commands that can raise its ConfigError
    config_errors = (ScenarioError, PeerloomError, *((node.ConfigError,) if node is not None else ()))

    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] in EXTRA_OF:
        extra = "demo" if command == "demo" else EXTRA_OF[(exc.name or "").split(".")[0]]
        return f"needs the '{extra}' extra ({exc.name} is not installed): pip install 'peerloom[{extra}]'"
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return f"{exc.strerror or exc}; pick another port or stop the process that holds it"
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    if isinstance(exc, tomllib.TOMLDecodeError):
        return f"invalid TOML: {exc}"
    if isinstance(exc, config_errors) and not isinstance(exc, LocalProtocolError):
        return str(exc)
    return None


def _dispatch(args: argparse.Namespace) -> None:
    if args.command == "demo":
        from peerloom.demo import run_demo

        sys.exit(run_demo(profile=args.profile, out=args.out, seed=args.seed,
                          kill_trainer_at=args.kill_trainer_at, rule=args.rule, workload=args.workload))
    elif args.command == "node":
        from peerloom.node import run_node

        run_node(args.config, stop_after_window=args.stop_after_window)
    elif args.command == "verify":
        from peerloom.verify import run_verify

        sys.exit(run_verify(args.chain, args.authority, manifest=args.manifest))
    elif args.command == "export":
        sys.exit(export_cmd.run(args))
    elif args.command == "sim":
        sys.exit(simulate.run(args))
    elif args.command == "inspect":
        sys.exit(inspect_cmd.run(args))
    elif args.command == "light":
        sys.exit(light_cmd.run(args))
    elif args.command == "login":
        sys.exit(login_cmd.run(args))
    elif args.command in ("admit", "auth"):
        result = admit_cmd.run(args) if args.command == "admit" else auth_cmd.run(args)
        if isinstance(result, str):  # a user error, already one line
            print(result, file=sys.stderr)
            sys.exit(2)
        sys.exit(result)
    elif args.command in experiment_cmd.COMMANDS:
        sys.exit(experiment_cmd.run(args))
    elif args.command == "keygen":
        from peerloom.adapters.keys import generate_identity, save_identity

        identity = generate_identity()
        try:
            save_identity(identity, args.path)
        except FileExistsError:
            sys.exit(f"peerloom keygen: {args.path} exists; refusing to overwrite a key")
        print(identity.peer_id.to_text())
