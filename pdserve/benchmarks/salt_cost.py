"""What a key's prefix-cache salt costs where prompts are hashed (the router's prefix index and every
engine's lookup: block_pool.block_hashes), on CPU.

    python -m pdserve.benchmarks.salt_cost                 # 4096-token prompts, blocks of 16
    python -m pdserve.benchmarks.salt_cost --tokens 512 --rounds 9

A salted prompt's chain starts from salt_root(salt) (one sha256 of the salt) instead of the zero
root; every block after costs the same sha256 either way. So the salt adds one hash per prompt
(as the router and the engine each hash it), whatever its length. Both variants run interleaved,
round after round (in turns of order), in this one process: the ratio is of the same run; the median round is shown."""

import argparse
import random
import statistics
import timeit

from pdserve.engine.block_pool import block_hashes, salt_root


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--number", type=int, default=200, help="prompts hashed per round and variant")
    args = ap.parse_args()
    prompt = [random.Random(0).randrange(150_000) for _ in range(args.tokens)]
    salt = "group:team-a\0a-request-salt"
    variants = {"unsalted": lambda: block_hashes(prompt, args.block_size),
                "salted": lambda: block_hashes(prompt, args.block_size, salt_root(salt))}
    per_prompt: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.rounds):
        # Each round in the other order: neither variant always runs first on a warming or busy host.
        for name, fn in (list(variants.items()) if r % 2 == 0 else list(variants.items())[::-1]):
            per_prompt[name].append(timeit.timeit(fn, number=args.number) / args.number * 1e6)
    med = {k: statistics.median(v) for k, v in per_prompt.items()}
    print(f"{args.tokens} tokens, blocks of {args.block_size}, median of {args.rounds} rounds x {args.number}:")
    for name, us in med.items():
        print(f"  {name:9s} {us:8.1f} us a prompt")
    print(f"  salted / unsalted: {med['salted'] / med['unsalted']:.3f}")
    one = timeit.timeit(lambda: salt_root(salt), number=20_000) / 20_000 * 1e6
    print(f"  salt_root alone: {one:.2f} us (what a salt adds to a prompt's hashing)")


if __name__ == "__main__":
    main()
