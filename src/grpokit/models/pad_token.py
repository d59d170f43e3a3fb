"""The one rule every tokenizer grpokit loads follows: it has a pad token (its EOS where it lacks one)."""


def with_pad_token(tokenizer):
    """`tokenizer`, given its EOS as pad token where it has none."""
    if tokenizer.pad_token_id is None:
        # Padding is always masked explicitly; the pad id's value never decides what is a token.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
