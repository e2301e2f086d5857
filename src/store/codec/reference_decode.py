#!/usr/bin/env python3
"""Command-line front end of Pion's numpy decoder for RAW value rows (V.FETCH ... RAW).

The decoder itself is the Python client's `pion.codecs` (clients/python/pion/codecs.py),
written from src/store/codec/README.md alone, with nothing taken from the C++ code. codec_test
runs this script on rows encoded by the server's codec and requires the same float32 bits as
RowCodec::Decode, so the client's decoder is verified against the server on every build.

    reference_decode.py FORMAT DIM BLOCK N_ROWS IN.bin OUT.bin   # OUT: float32 little-endian
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "clients" / "python"))
from pion.codecs import decode  # noqa: E402


def main(argv):
    if len(argv) != 7:
        sys.exit(__doc__)
    fmt, dim, block, n_rows, src, dst = argv[1], int(argv[2]), int(argv[3]), int(argv[4]), argv[5], argv[6]
    with open(src, "rb") as f:
        data = f.read()
    out = decode(fmt, dim, block, data, n_rows)
    out.astype("<f4").tofile(dst)


if __name__ == "__main__":
    main(sys.argv)
