"""`ppring keygen DIR --name NAME`: write a CURVE key pair, DIR/NAME.key and DIR/NAME.key_secret.

For a ring of N nodes, on each node R:

    ppring keygen keys --name nodeR            # then copy keys/nodeR.key to every other node
    ppring serve --node-rank R --curve-dir keys ...

and for each client: `ppring keygen client-keys --name alice`, then copy alice.key into node 0's
keys/clients/ and run `ppring generate --server-key node0.key --curve-key
client-keys/alice.key_secret ...`. A secret file never leaves the machine it was made on.
"""

from __future__ import annotations

import argparse
import sys

from protocol.curve import CurveError, keygen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ppring keygen",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("directory", help="where the two files go (made if missing)")
    parser.add_argument(
        "--name", required=True, help="nodeR for the node of rank R; any name for a client"
    )
    args = parser.parse_args(argv)
    try:
        public, secret = keygen(args.directory, args.name)
    except (CurveError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"public key: {public} (share it)")
    print(f"key pair:   {secret} (keep it on this machine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
