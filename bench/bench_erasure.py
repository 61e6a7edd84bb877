"""Erasure-coding libraries compared on this machine: zfec against pyeclib (liberasurecode).

Encodes stripes of W data blocks into K parity blocks, and rebuilds K lost data blocks, the
way `ckpt protect` / `ckpt repair` use a codec; prints MB/s of *data* per library and backend.

    python bench/bench_erasure.py [--width 8] [--parity 2] [--block-mib 1] [--mib 256]

pyeclib's API takes one buffer per stripe and returns fragments with its own 80-byte headers,
so its figures include the split/join it does; zfec takes and returns raw blocks.
"""

from __future__ import annotations

import argparse
import os
import time


def bench_zfec(
    width: int, parity: int, block: int, stripes: int, data: list[bytes]
) -> tuple[float, float]:
    import zfec

    enc = zfec.Encoder(width, width + parity)
    wanted = list(range(width, width + parity))
    t = time.perf_counter()
    for s in range(stripes):
        blocks = data[s % width : s % width + width]
        par = enc.encode(blocks, wanted)
    t_enc = time.perf_counter() - t
    blocks = data[:width]
    par = enc.encode(blocks, wanted)
    dec = zfec.Decoder(width, width + parity)
    shares = blocks[parity:] + list(par)
    nums = list(range(parity, width)) + wanted
    t = time.perf_counter()
    for _ in range(stripes):
        out = dec.decode(list(shares), list(nums))  # zfec reorders its arguments in place
    t_dec = time.perf_counter() - t
    assert [bytes(b) for b in out] == blocks
    return t_enc, t_dec


def bench_pyeclib(
    ec_type: str, width: int, parity: int, block: int, stripes: int, data: list[bytes]
) -> tuple[float, float]:
    from pyeclib.ec_iface import ECDriver

    drv = ECDriver(k=width, m=parity, ec_type=ec_type)
    buf = b"".join(data[:width])
    t = time.perf_counter()
    for _ in range(stripes):
        frags = drv.encode(buf)
    t_enc = time.perf_counter() - t
    frags = drv.encode(buf)
    survivors = frags[parity:]
    t = time.perf_counter()
    for _ in range(stripes):
        rebuilt = drv.reconstruct(survivors, list(range(parity)))
    t_dec = time.perf_counter() - t
    assert rebuilt[0] == frags[0]
    return t_enc, t_dec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--parity", type=int, default=2)
    parser.add_argument("--block-mib", type=float, default=1.0)
    parser.add_argument("--mib", type=int, default=256, help="data encoded per library")
    args = parser.parse_args()
    block = int(args.block_mib * (1 << 20))
    stripes = max(1, (args.mib << 20) // (block * args.width))
    data = [os.urandom(block) for _ in range(args.width * 2)]
    total = stripes * args.width * block / 1e6
    print(
        f"W={args.width} data blocks + K={args.parity} parity, block {block >> 10} KiB, "
        f"{total:.0f} MB of data, {os.cpu_count()} CPUs"
    )
    rows = [("zfec", lambda: bench_zfec(args.width, args.parity, block, stripes, data))]
    for ec_type in ("isa_l_rs_vand", "isa_l_rs_cauchy", "liberasurecode_rs_vand"):
        rows.append(
            (
                f"pyeclib {ec_type}",
                lambda t=ec_type: bench_pyeclib(t, args.width, args.parity, block, stripes, data),
            )
        )
    for name, fn in rows:
        try:
            t_enc, t_dec = fn()
        except Exception as exc:  # a backend missing from this build of liberasurecode
            print(f"{name:32s} unavailable ({exc})")
            continue
        print(
            f"{name:32s} encode {total / t_enc:8.0f} MB/s   rebuild {args.parity} lost {total / t_dec:8.0f} MB/s"
        )


if __name__ == "__main__":
    main()
