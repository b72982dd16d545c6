"""Tools defined outside the package, named in a config as 'tool_plugin:<function>': one that works, one
that raises, one that returns a number, and two that cannot be described to the model."""


def word_count(text: str, unique: bool = False) -> str:
    """Count the words of a text.

    Args:
        text: The text whose words to count
        unique: Count each distinct word once
    """
    words = text.split()
    return str(len(set(words)) if unique else len(words))


def broken(text: str) -> str:
    """Fail on every call.

    Args:
        text: Anything
    """
    raise RuntimeError(f"cannot handle {text!r}")


def numeric(text: str) -> int:
    """Answer a number instead of text.

    Args:
        text: Anything
    """
    return len(text)


def undocumented(text: str) -> str:
    return text


def untyped(text):
    """Echo the text.

    Args:
        text: The text to echo
    """
    return text


NOT_A_FUNCTION = 42
