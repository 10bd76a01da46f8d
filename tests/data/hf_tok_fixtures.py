"""Tiny HF fast tokenizers built offline with the `tokenizers` library: one token per character."""


def save_char_level_hf_tokenizer(path, specials, chars, chat_template, **special_tokens) -> str:
    """Ids: `specials` from 0, then `chars`; save `PreTrainedTokenizerFast` with `chat_template` in `path`.

    `special_tokens` are its named tokens (bos_token="<s>", ...); `specials` other than <unk> are matched
    as whole tokens in text, as HF tokenizers do.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(list(specials) + list(chars))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True) for t in specials if t != "<unk>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", clean_up_tokenization_spaces=False,
                                   **special_tokens)
    fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    return str(path)
