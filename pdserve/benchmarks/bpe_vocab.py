"""A real byte-level BPE vocabulary of a chosen size, trained on the host's own Python sources, for
benchmarks that need one where no network reaches a model hub (the GPU machines, CI).

A grammar engine's mask work depends on the vocabulary: over the presets' byte tokenizer widened to
Qwen3's 151,936 ids (`<|token_N|>` entries a grammar engine rules out at once) llguidance filled a
256-row JSON mask ~9× faster than over a BPE vocabulary of the same size (the development machine,
2026-11-29), so the figure to quote is over a BPE one. Trained with `tokenizers`' BpeTrainer (byte
level, as Qwen's and GPT's are) on the first `--corpus-mb` MB of the .py files under the installed
packages' directories, in sorted order; `<|endoftext|>` is id 0.

    python -m pdserve.benchmarks.bpe_vocab OUT_DIR [--vocab 151643] [--corpus-mb 150]
"""

import argparse
import os
import site
import sys
import time
from pathlib import Path


def corpus(limit_bytes: int) -> list[str]:
    roots = sorted({p for p in site.getsitepackages() + [os.path.dirname(os.__file__)] if os.path.isdir(p)})
    files, total = [], 0
    for root in roots:
        for path in sorted(Path(root).rglob("*.py")):
            try:
                size = path.stat().st_size
            except OSError:
                continue
            files.append(str(path))
            total += size
            if total >= limit_bytes:
                return files
    return files


def train(out_dir: str, vocab: int, corpus_mb: float) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = corpus(int(corpus_mb * 1e6))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    t0 = time.perf_counter()
    tok.train_from_iterator((Path(f).read_text(errors="replace") for f in files), trainer)  # (some aren't UTF-8)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "tokenizer.json")
    tok.save(path)
    print(f"{len(files)} files, {tok.get_vocab_size()} ids, trained in {time.perf_counter() - t0:.1f} s: {path}",
          file=sys.stderr)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--vocab", type=int, default=151643, help="ids (default: Qwen's BPE vocabulary's)")
    p.add_argument("--corpus-mb", type=float, default=150)
    args = p.parse_args(argv)
    train(args.out_dir, args.vocab, args.corpus_mb)


if __name__ == "__main__":
    main()
