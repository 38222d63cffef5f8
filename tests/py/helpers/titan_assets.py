"""Tokenizer and text data for torchtitan runs, made on the spot.

torchtitan's wheel ships neither its test tokenizer nor its test data
(``tests/assets/``), and nothing may be downloaded, so a run makes both in a
scratch folder:

- ``tokenizer/``: a byte-level BPE tokenizer (``tokenizer.json`` and a
  ``tokenizer_config.json`` naming its BOS and EOS tokens) trained with
  ``tokenizers`` on the corpus below; its vocabulary fits the debug model's
  2048 embeddings.
- ``data/``: ``train.jsonl``, one ``{"text": ...}`` object a line, the format
  torchtitan's ``c4_test`` loader (``load_dataset(path, split="train")``)
  reads from a local folder.

The corpus is synthetic and seeded: sentences from a small word list, so
the same seed gives the same files byte for byte.  Making both takes well
under a second.

Run as a script (``python titan_assets.py DIR``) it writes both under DIR
and prints the two paths.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

VOCAB_SIZE = 1024  # at most the debug model's 2048 embeddings
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"

_WORDS = (
    "the a one every some replica group step model loss gradient heals joins "
    "quorum lighthouse manager commits trains fails restarts waits sends "
    "receives shard parameter optimizer state token batch layer attention "
    "quickly slowly again never always before after while because fast small "
    "large red green blue river mountain city forest light stone water fire "
    "runs walks speaks writes reads counts builds opens closes keeps"
).split()


def corpus(n_docs: int = 2000, seed: int = 0) -> list[str]:
    """``n_docs`` short documents of a few sentences each (seeded)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        sentences = []
        for _ in range(rng.randint(3, 8)):
            words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 14))]
            sentences.append(" ".join(words).capitalize() + rng.choice(".!?"))
        docs.append(" ".join(sentences))
    return docs


def make_tokenizer(out: Path, docs: list[str]) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "add_bos_token": False,
                    "add_eos_token": False}, indent=1)
    )
    return out


def make_dataset(out: Path, docs: list[str]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    return out


def make_assets(root: Path, seed: int = 0) -> tuple[Path, Path]:
    """Writes ``root/tokenizer`` and ``root/data``; returns both paths."""
    docs = corpus(seed=seed)
    return make_tokenizer(root / "tokenizer", docs), make_dataset(root / "data", docs)


if __name__ == "__main__":
    tok_dir, data_dir = make_assets(Path(sys.argv[1]))
    print(tok_dir)
    print(data_dir)
