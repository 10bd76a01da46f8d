"""A small Llama-2 style SentencePiece model (BPE, byte fallback, no normalisation), trained in the test."""
import os
import random


def train_sentencepiece(folder, pad: bool = False) -> str:
    """Train on a few hundred generated lines; write `folder/tokenizer.model` and return its path.

    Ids as in Llama-2: 0 <unk>, 1 <s>, 2 </s>; with `pad`, 3 is <pad> (Llama-2 has none).
    """
    import sentencepiece as spm

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 7))) for _ in range(300)]
    words += ["hello", "world", "answer", "1+2=3", "<think>", "</think>"]
    corpus = os.path.join(folder, "corpus.txt")
    with open(corpus, "w") as f:
        for _ in range(400):
            f.write(" ".join(rng.choice(words) for _ in range(rng.randint(1, 12))) + "\n")
    prefix = os.path.join(folder, "tokenizer")
    spm.SentencePieceTrainer.train(
        input=corpus, model_prefix=prefix, vocab_size=300, model_type="bpe", byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=3 if pad else -1, minloglevel=2,
    )
    os.remove(corpus)
    os.remove(prefix + ".vocab")
    return prefix + ".model"
