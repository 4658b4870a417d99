"""What ``dispatch_scaling.py`` and ``round_cost.py`` share: their command line and a free port."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def world_size_parser(doc: str) -> argparse.ArgumentParser:
    """``--ranks`` (world sizes, each >= 2, checked by :func:`parse`) and ``--out``."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4], help="world sizes to measure")
    parser.add_argument("--out", type=Path, required=True, help="directory for the JSON and Markdown results")
    return parser


def parse(parser: argparse.ArgumentParser) -> argparse.Namespace:
    args = parser.parse_args()
    if any(n < 2 for n in args.ranks):
        parser.error(f"--ranks {args.ranks}: every world size must be >= 2")
    args.out.mkdir(parents=True, exist_ok=True)
    return args
