"""A non-numeric task's correctness plugin for the tests (data.correctness=word_task:...).

Gold answers are words; a completion is right when its <answer> block holds the word, in any case.
`parity` grades IdTokenizer outputs (space-separated ids): the gold says whether a completion has
an even or an odd number of tokens."""

from dapo_train.task.answers import answer_block


def same_word(completion: str, gold: str) -> bool:
    block = answer_block(completion)
    return block is not None and block.strip().lower() == gold.lower()


def parity(completion: str, gold: str) -> bool:
    return ("even", "odd")[len(completion.split()) % 2] == gold
