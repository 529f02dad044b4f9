"""The one error type raised at the API boundary for bad input: the message names the bad value and what is allowed."""


class SemkvError(ValueError):
    """Bad input to semkv (model path, method, budget, prompt, device...). The CLI prints it and exits with code 2."""
